"""The grader's verdicts: what a test reports is what the test's own process verified.

- Forgeries of the verdict (tests/fixtures/grading/forgeries/: a counterfeit report written to
  every descriptor found through /proc or with C's write(), a thread and a daemon that keep
  writing, signals to the test's process, the reporter's functions overwritten) earn nothing
  in a lab whose code runs in the student's process (the fixture's 09-01 is marked so).
- A unittest.TestCase item (Hypothesis's state machines are some) that fails is a failure in
  the grader too, as it is in plain pytest.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course.integrity.checks import GRADING_FIXTURE, build_grading_fixture

WEAK = [] if os.geteuid() == 0 else ["--allow-weak-isolation"]
FORGERIES = sorted(p.name for p in (GRADING_FIXTURE / "forgeries").iterdir())


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> Path:
    """The fixture course and a class of the honest submission and every forgery, graded."""
    root = tmp_path_factory.mktemp("forgeries")
    course, klass = build_grading_fixture(root)
    for d in klass.iterdir():
        if d.name != "honest":
            shutil.rmtree(d)
    for name in FORGERIES:
        shutil.copytree(GRADING_FIXTURE / "forgeries" / name, klass / name)
    out = root / "grades"
    env = dict(os.environ, PYTHONPATH=str(course), OMP_NUM_THREADS="1")
    env.pop("LAB_IMPL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "course", "grade", "--class", str(klass), "--out", str(out),
         "--test-timeout", "5", "--lab-timeout", "90", "-j", "2", *WEAK],
        cwd=course, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forged_verdict_earns_nothing(graded, name):
    rows = {r["student"]: r for r in csv.DictReader((graded / "grades.csv").open())}
    assert float(rows[name]["09-01"]) == 0.0, rows[name]
    report = json.loads((graded / "students" / name / "grades.json").read_text())
    lab = next(lab for lab in report["labs"] if lab["id"] == "09-01")
    passed = [t["id"] for t in lab["tests"] if t["outcome"] == "passed"]
    assert not passed, f"{name}: passed {passed}"
    for t in lab["tests"]:
        assert t["message"], f"{name}: {t['id']} failed without saying why"


def test_the_honest_submission_keeps_every_point(graded):
    rows = {r["student"]: r for r in csv.DictReader((graded / "grades.csv").open())}
    assert (float(rows["honest"]["09-01"]), float(rows["honest"]["09-02"])) == (10.0, 6.0)


UNITTEST_ITEMS = '''
import unittest

from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule


class Fails(unittest.TestCase):
    def test_it(self):
        self.assertEqual(1, 2)


class Passes(unittest.TestCase):
    def test_it(self):
        self.assertEqual(2, 2)


class Machine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.n = 0

    @rule()
    def step(self):
        self.n += 1

    @invariant()
    def small(self):
        assert self.n < 2, "the machine's invariant broke"


TestMachine = Machine.TestCase
TestMachine.settings = settings(max_examples=5, derandomize=True, database=None)
'''


def test_a_failing_unittest_item_fails_in_the_grader_as_in_pytest(tmp_path):
    """The grading session's plugin decides each outcome itself; a TestCase item records its
    failure instead of raising it, and the plugin must read it there."""
    (tmp_path / "test_items.py").write_text(textwrap.dedent(UNITTEST_ITEMS))
    r, w = os.pipe()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(tmp_path / "test_items.py"), "-q", "-p",
         "no:cacheprovider", "-p", "_hypothesis_pytestplugin", "-p", "course.grading.plugin",
         f"--course-channel={w}", f"--rootdir={tmp_path}"],
        cwd=tmp_path, env=env, pass_fds=(w,), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as channel:
        messages = [json.loads(line) for line in channel]
    proc.wait(timeout=120)
    outcomes = {m["nodeid"].split("::", 1)[1]: m["outcome"] for m in messages
                if m.get("type") == "test"}
    assert outcomes == {"Fails::test_it": "failed", "Passes::test_it": "passed",
                        "TestMachine::runTest": "failed"}, outcomes
    machine = next(m for m in messages if m.get("nodeid", "").endswith("TestMachine::runTest"))
    assert "invariant broke" in machine["message"] + machine["detail"]


def test_the_grader_was_compared_with_pytest_on_every_lab():
    """planted_bugs/agreement.json covers every lab of the course, for the files as they are,
    with no disagreement (`python -m course check --write-agreement LAB` records a lab anew)."""
    from course.integrity.agreement import check_record
    from course.labs.catalog import discover

    assert check_record(discover()) == []


def test_the_record_follows_what_the_tests_read_and_not_the_reading_matter(tmp_path):
    """A lab's README, hints and measurement, and the docstrings and comments of its code,
    change no outcome, so editing them keeps its agreement record; editing its tests' code (or
    its starter's, or its solution's) asks for a new one."""
    from course.integrity.agreement import NOT_GRADED, inputs_digest
    from course.labs.catalog import REPO_ROOT, Lab, discover

    lab = next(lab for lab in discover() if lab.id == "02-01")
    copy = tmp_path / "course"
    moved = Lab(copy / lab.path.relative_to(REPO_ROOT))
    shutil.copytree(lab.path, moved.path)
    before = inputs_digest(moved, copy)
    for name in sorted(NOT_GRADED):
        with open(moved.path / name, "a") as f:
            f.write("\n")
    assert inputs_digest(moved, copy) == before
    starter = moved.path / "starter.py"
    source = starter.read_text(encoding="utf-8")
    starter.write_text(source.replace('"""', '"""A docstring edit. ', 1) + "# a comment\n",
                       encoding="utf-8")
    assert inputs_digest(moved, copy) == before  # docstrings and comments change no outcome
    tests = moved.path / "test_lab.py"
    source = tests.read_text(encoding="utf-8")
    tests.write_text(source + "\nassert x\n", encoding="utf-8")
    added = inputs_digest(moved, copy)
    assert added != before
    # A test's assert message is read only once its assertion has failed: rewording it keeps
    # the record; in the student's or the reference's code a test may read it.
    tests.write_text(source + "\nassert x, f'names the cause: {x}'\n", encoding="utf-8")
    assert inputs_digest(moved, copy) == added
    starter.write_text(starter.read_text(encoding="utf-8") + "\nassert x, 'a reason'\n",
                       encoding="utf-8")
    assert inputs_digest(moved, copy) != added


def test_a_test_the_session_runs_itself_is_ended_when_it_overruns(tmp_path):
    """In a lab whose code runs in a student's process, the session runs each test itself; a
    test still waiting on the student's process past its timeout and grace (pytest-timeout did
    not end it) is ended by killing that process, and reads "timed out"."""
    import time

    from course.grading import plugin
    from course.labs import student_process as sp
    from course.labs.loader import _load_module

    (tmp_path / "solution.py").write_text("import time\n\ndef hang():\n    time.sleep(600)\n")

    def test_body():
        proc = sp.current(tmp_path, "solution", "09-09", _load_module)
        try:
            proc.module.hang()
        except sp.StudentProcessError as exc:
            return {"outcome": "failed", "kind": "error", "message": str(exc)}
        return {"outcome": "passed"}

    sp.warm(tmp_path)  # its few seconds are not the test's
    start = time.monotonic()
    result = plugin._in_session(test_body, 0.5, 0.5)
    assert result["outcome"] == "timed_out", result
    assert "timed out" in result["message"]
    assert time.monotonic() - start < 20
    assert not sp._CURRENT, "the student's process was not stopped after the test"
