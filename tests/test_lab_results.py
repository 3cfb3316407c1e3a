"""Remembered lab results (course/labs/results.py): an untouched lab runs nothing, an unchanged
one is answered from the cache, and a change to any input of the key runs the lab again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course.labs import results
from course.labs.catalog import REPO_ROOT, Lab
from course.labs.published import stale_labs, write_published
from course.labs.runner import LabRun

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "demo_lab"
LAB = "phase-09-demo/labs/lab-01-demo"


@pytest.fixture
def course(tmp_path: Path, monkeypatch, course_skeleton) -> Path:
    """A course with one lab (09-01), the real tooling and a stand-in mini_vllm package."""
    root = course_skeleton()
    (root / "mini_vllm").mkdir()
    (root / "mini_vllm" / "__init__.py").write_text("VERSION = 1\n")
    shutil.copytree(FIXTURE, root / LAB)
    (root / "course" / "labs" / "labs.toml").write_text('[lab."09-01"]\npoints = 5\n')
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in results.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    results.course_digest.cache_clear()
    return root


def _lab(root: Path) -> Lab:
    return Lab(root / LAB)


class FakeRunner:
    """Stands in for running a lab's tests: records which labs ran, passes them all."""

    def __init__(self):
        self.ran: list[str] = []

    def __call__(self, labs, impl, jobs):
        self.ran += [lab.id for lab in labs]
        test = {"nodeid": "test_lab.py::test_add", "outcome": "passed", "starter_ok": False,
                "points": 1, "message": ""}
        return [LabRun(lab, impl, 0, [test], "", 1.0) for lab in labs]


def _edit(path: Path, text: str = "\n# edited\n") -> None:
    path.write_text(path.read_text() + text)


# Each input of the key, and how to change it.
def _student_file(root, mp):
    _edit(root / LAB / "starter.py")


def _tests(root, mp):
    _edit(root / LAB / "test_lab.py")


def _given_file(root, mp):
    _edit(root / LAB / "hints.toml")


def _new_data_file(root, mp):
    (root / LAB / "data.txt").write_text("1 2 3\n")


def _mini_vllm(root, mp):
    _edit(root / "mini_vllm" / "__init__.py")


def _course_tooling(root, mp):
    _edit(root / "course" / "labs" / "numerics.py")


def _conftest(root, mp):
    _edit(root / "conftest.py")


def _pyproject(root, mp):
    _edit(root / "pyproject.toml")


def _torch_version(root, mp):
    real = results._version
    mp.setattr(results, "_version", lambda p: "9.9.9" if p == "torch" else real(p))


def _python_version(root, mp):
    mp.setattr(results.sys, "version", "3.99.0 (edited)")


def _kernel_backend(root, mp):
    mp.setenv("MINI_VLLM_KERNEL_BACKEND", "emulation-asan")


def _hypothesis_profile(root, mp):
    mp.setenv("HYPOTHESIS_PROFILE", "thorough")


def _gpu(root, mp):
    real = results.environment
    mp.setattr(results, "environment", lambda: {**real(), "gpu": str(real()["gpu"] != "True")})


CHANGES = [_student_file, _tests, _given_file, _new_data_file, _mini_vllm, _course_tooling,
           _conftest, _pyproject, _torch_version, _python_version, _kernel_backend,
           _hypothesis_profile, _gpu]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_changing_any_input_of_the_key_runs_the_lab_again(course, monkeypatch, change):
    runner = FakeRunner()
    monkeypatch.setattr(results, "run_labs", runner)
    lab = _lab(course)
    first = results.lab_runs([lab], "starter", 1)
    again = results.lab_runs([lab], "starter", 1)
    assert runner.ran == ["09-01"], "the second call must be answered from the cache"
    assert first[0].origin == "ran" and again[0].origin == "cached"
    assert again[0].tests == first[0].tests
    change(course, monkeypatch)
    results.course_digest.cache_clear()  # a new process would hash the course anew
    third = results.lab_runs([lab], "starter", 1)
    assert runner.ran == ["09-01", "09-01"], f"{change.__name__} did not run the lab again"
    assert third[0].origin == "ran"


def test_the_other_implementation_and_no_cache_run_again(course, monkeypatch):
    runner = FakeRunner()
    monkeypatch.setattr(results, "run_labs", runner)
    lab = _lab(course)
    results.lab_runs([lab], "starter", 1)
    results.lab_runs([lab], "solution", 1)
    results.lab_runs([lab], "starter", 1, use_cache=False)
    assert runner.ran == ["09-01"] * 3


def test_a_broken_run_is_not_remembered(course, monkeypatch):
    calls = []

    def broken(labs, impl, jobs):
        calls.append(1)
        return [LabRun(lab, impl, 4, [], "usage error", 0.1) for lab in labs]

    monkeypatch.setattr(results, "run_labs", broken)
    results.lab_runs([_lab(course)], "starter", 1)
    results.lab_runs([_lab(course)], "starter", 1)
    assert len(calls) == 2


def test_an_untouched_lab_is_not_started_without_running(course, monkeypatch):
    runner = FakeRunner()
    monkeypatch.setattr(results, "run_labs", runner)
    lab = _lab(course)
    published = course / "course" / "labs" / "published_starters.json"
    write_published([lab], published)
    monkeypatch.setattr(results, "load_published",
                        lambda: json.loads(published.read_text()))
    (run,) = results.lab_runs([lab], "starter", 1)
    assert runner.ran == [] and run.origin == "untouched"
    assert run.status == "not started" and run.next_step == "task 1: implement add"
    (run,) = results.lab_runs([lab], "solution", 1)  # the reference is never "untouched"
    assert runner.ran == ["09-01"]
    _edit(course / LAB / "starter.py")  # one byte of the student's: it runs
    (run,) = results.lab_runs([lab], "starter", 1)
    assert runner.ran == ["09-01", "09-01"] and run.origin == "ran"


def test_the_published_digests_match_the_starters():
    """course/labs/published_starters.json is what "untouched" is measured against."""
    from course.labs.catalog import discover

    stale = stale_labs(discover())
    assert not stale, (f"the published digests of labs {', '.join(stale)} are stale; after "
                       "changing a starter run: python -m course.labs.published")


def test_the_dashboard_runs_a_changed_lab_once_then_says_cached(course):
    """End to end, with the real test run: `python -m course` twice, then after an edit."""
    env = dict(os.environ, PYTHONPATH=str(course))
    env.pop("LAB_IMPL", None)

    def dashboard():
        proc = subprocess.run([sys.executable, "-m", "course", "--no-exam"], cwd=course, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc, next(line for line in proc.stdout.splitlines() if line.startswith("09"))

    starter = course / LAB / "starter.py"
    starter.write_text(starter.read_text().replace(
        'raise NotImplementedError(\n        "lab 09-01, task 1: implement add '
        '(hint: python -m course hint 09-01 1)"\n    )', "return a + b"))
    proc, row = dashboard()
    assert "Running the tests of 1 lab(s)" in proc.stderr and row.split()[-2:] != ["cached"]
    assert "1/2" in row and "in progress" in row
    proc, row = dashboard()
    assert "Running the tests" not in proc.stderr and row.split()[-1] == "cached"
    assert "1/2" in row and "in progress" in row and "1 lab(s) cached" in proc.stdout
    _edit(starter)
    proc, row = dashboard()
    assert "Running the tests of 1 lab(s)" in proc.stderr and row.split()[-1] != "cached"
