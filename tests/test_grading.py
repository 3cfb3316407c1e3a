"""Tests of `python -m course grade`: a small class of the fixture submissions graded end to end
(the full class of attacks runs in `python -m course check`), the reports, and the pieces."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from course.grading.grader import intake, published_tasks, read_commit, suspicious
from course.integrity.checks import GRADING_EXPECTATIONS, build_grading_fixture
from course.labs.catalog import discover

# The grader refuses a weaker sandbox than root's; the fixture runs test the grading, not the
# sandbox (tests/test_sandbox.py does), so a run that is not root takes what the machine allows.
WEAK = [] if os.geteuid() == 0 else ["--allow-weak-isolation"]
SMALL_CLASS = ("honest", "exit-at-import", "report-plugin", "patch-tests", "copies", "symlink",
               "hang")
# Graded once whole and once in shards (cheap ones: the comparison is of the bookkeeping).
SHARDED_CLASS = ("honest", "partial", "syntax-error", "all-solution", "exec-source", "paste")


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> Path:
    """The fixture course and a small class, graded once for the tests below."""
    root = tmp_path_factory.mktemp("grading")
    course, klass = build_grading_fixture(root)
    for d in klass.iterdir():
        if d.name not in SMALL_CLASS:
            shutil.rmtree(d)
    out = root / "grades"
    env = dict(os.environ, PYTHONPATH=str(course), OMP_NUM_THREADS="1")
    env.pop("LAB_IMPL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "course", "grade", "--class", str(klass), "--out", str(out),
         "--test-timeout", "2", "--lab-timeout", "60", *WEAK],
        cwd=course, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (root / "live.log").write_text(proc.stderr)
    return out


def test_each_submission_scores_what_it_should(graded):
    rows = {r["student"]: r for r in csv.DictReader((graded / "grades.csv").open())}
    assert sorted(rows) == sorted(SMALL_CLASS)
    for name in SMALL_CLASS:
        lab1, lab2, flag = GRADING_EXPECTATIONS[name]
        row = rows[name]
        assert (float(row["09-01"]), float(row["09-02"])) == (lab1, lab2), (name, row)
        assert flag in row["flags"], (name, row["flags"])
        # Fixed maxima, whatever ran; the GPU tier is counted apart and not run without a GPU.
        assert (row["cpu_max"], row["gpu_max"], row["gpu_points"]) == (
            "20.0", "6.0", "not run (no GPU)")
    assert rows["honest"]["flags"] == ""


def test_a_test_that_did_not_run_scores_zero_with_its_reason(graded):
    report = json.loads((graded / "students" / "hang" / "grades.json").read_text())
    tests = {t["id"].split("::")[-1]: t for lab in report["labs"] for t in lab["tests"]}
    assert tests["test_mean"]["outcome"] == "timed_out"
    assert "timed out" in tests["test_mean"]["message"]
    assert tests["test_double_on_the_gpu"]["outcome"] == "skipped"
    assert "needs a CUDA GPU" in tests["test_double_on_the_gpu"]["message"]
    exited = json.loads((graded / "students" / "exit-at-import" / "grades.json").read_text())
    (lab,) = [lab for lab in exited["labs"] if lab["id"] == "09-01"]
    assert {t["outcome"] for t in lab["tests"]} == {"exited"}
    assert lab["max_points"] == {"cpu": 10.0}


def test_grades_json_names_the_student_and_the_course(graded):
    report = json.loads((graded / "students" / "honest" / "grades.json").read_text())
    assert report["student"] == "honest"
    assert set(report) >= {"commit", "course_revision", "course_dirty", "isolation", "totals"}
    assert report["totals"]["cpu"] == {"points": 20.0, "max_points": 20.0}
    meta = json.loads((graded / "class.json").read_text())
    assert meta["students"] == sorted(SMALL_CLASS)
    assert (graded / "summary.md").read_text().startswith("## Grades")


def test_tampering_a_test_caught_is_the_labs_status_with_what_it_saw(graded):
    """patch-tests rewrites the test functions it finds at import. Lab 09-02 runs its tests
    beside the student's code: every test catches it, and every file says "tampered" and what
    was seen. Lab 09-01 runs the student's code in a process of its own: the rewrite reaches no
    test, and the lab is graded on what its code does (nothing: it defines no task)."""
    rows = {r["student"]: r for r in csv.DictReader((graded / "grades.csv").open())}
    log = (graded.parent / "live.log").read_text()
    name, seen = "patch-tests", "test_lab.test_double was replaced"
    assert rows[name]["09-02 status"] == "tampered", rows[name]
    assert rows[name]["09-01 status"] == "crashed", rows[name]
    report = json.loads((graded / "students" / name / "grades.json").read_text())
    (lab,) = [lab for lab in report["labs"] if lab["id"] == "09-02"]
    assert lab["status"] == "tampered"
    assert lab["reason"].startswith("test_double: the test's machinery changed while it ran: ")
    assert seen in lab["reason"] and lab["reason"].endswith(" (and 1 more test)"), lab["reason"]
    cpu = [t for t in lab["tests"] if t["tier"] == "cpu"]
    assert [t["kind"] for t in cpu] == ["tampered"] * 2
    assert len(lab["tampered"]) == 2
    assert f"09-02: tampered: {lab['reason']}" in rows[name]["flags"]
    text = (graded / "students" / name / "grades.txt").read_text()
    assert re.search(r"^09-02 .* tampered *$", text, re.M), text
    assert f"  09-02: tampered: {lab['reason']}" in text
    suite = ET.parse(graded / "students" / name / "junit" / "lab-09-02.xml").getroot()[0]
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert (props["status"], props["reason"]) == ("tampered", lab["reason"])
    assert {f.get("type") for f in suite.iter("failure")} == {"tampered"}
    assert re.search(rf"{name} 09-02: 0/6 tampered \(\d+ s\): test_double: ", log), log
    summary = (graded / "summary.md").read_text()
    assert re.search(r"\| patch-tests \|.*\| crashed \| tampered \|", summary), summary


def _junit_structure_problems(path: Path) -> list[str]:
    """The rules of pytest's junit-10.xsd that matter here, checked without the schema."""
    problems = []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    allowed_case_children = {"skipped", "errors", "failure", "system-out", "system-err"}
    for suite in suites:
        if suite.tag != "testsuite":
            problems.append(f"{suite.tag} under testsuites")
        for attr in ("name", "tests", "failures", "errors"):
            if attr not in suite.attrib:
                problems.append(f"testsuite without {attr}")
        for child in suite:
            if child.tag == "testcase":
                problems += [f"testcase holds {c.tag}" for c in child
                             if c.tag not in allowed_case_children]
            elif child.tag == "properties":
                problems += [f"property without name/value: {p.attrib}" for p in child
                             if set(p.attrib) != {"name", "value"}]
            elif child.tag not in ("system-out", "system-err", "testsuite"):
                problems.append(f"testsuite holds {child.tag}")
    return problems


def _pytest_junit_schema(tmp: Path) -> Path | None:
    """pytest's own junit-10.xsd: from JUNIT_XSD, or from pytest's source archive if pip's
    cache or a folder named by PYTEST_SDIST holds it (nothing is downloaded here)."""
    if os.environ.get("JUNIT_XSD"):
        return Path(os.environ["JUNIT_XSD"])
    for archive in Path(os.environ.get("PYTEST_SDIST", "/nonexistent")).glob("pytest-*.tar.gz"):
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("junit-10.xsd"))
            tar.extract(member, tmp, filter="data")
            return tmp / member.name
    return None


def test_junit_is_valid_for_every_lab_even_crashed_ones(graded, tmp_path):
    files = sorted(graded.glob("students/*/junit/*.xml"))
    assert len(files) == 3 * len(SMALL_CLASS)  # two labs and the exam
    schema_path = _pytest_junit_schema(tmp_path)
    for f in files:
        assert _junit_structure_problems(f) == [], f
    if schema_path is not None:
        import xmlschema

        schema = xmlschema.XMLSchema(str(schema_path))
        for f in files:
            schema.validate(str(f))
    suite = ET.parse(graded / "students" / "hang" / "junit" / "lab-09-01.xml").getroot()[0]
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["points.cpu"] == "8.75" and props["max_points.cpu"] == "10"
    assert int(suite.get("tests")) == 5  # the graded tests only (not the starter_ok one)


def test_read_commit_reads_head_without_running_git(tmp_path):
    repo = tmp_path / "fork"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("x")
    git = ["git", "-C", str(repo), "-c", "user.name=a", "-c", "user.email=a@b"]
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "m"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert read_commit(repo) == head.strip()
    assert read_commit(tmp_path) is None


def test_tasks_are_what_the_published_starter_leaves_to_write():
    source = (
        '__all__ = ["given", "task", "K"]\nfrom x import given\n'
        'def task():\n    raise NotImplementedError("lab 01-01, task 1: do it")\n'
        "class K:\n    def m(self):\n        raise NotImplementedError\n"
    )
    assert published_tasks(source) == ["K", "task"]
    for lab in discover():  # every real lab but the CUDA one has something to write in Python
        tasks = published_tasks((lab.path / "starter.py").read_text())
        assert tasks or (lab.path / "starter.cu").is_file(), lab.id


def test_intake_flags_given_code_that_differs_from_the_published_starter(tmp_path):
    """A flag only (the tests decide the points), naming the given definitions: here a lab
    03-01 starter begun before the course's given schedule() called lab 03-03's hooks (and
    before its given _make_output asked lab 04-04 for the drafts)."""
    (lab,) = [lab for lab in discover() if lab.id == "03-01"]
    starter = tmp_path / "fork" / lab.rel / "starter.py"
    starter.parent.mkdir(parents=True)
    starter.write_text((Path(__file__).parent / "fixtures" / "upgrade"
                        / "03-01-starter-before-swap-hooks.py.txt").read_text())
    (flag,) = intake(tmp_path / "fork", [lab]).lab_flags["03-01"]
    assert flag.startswith("given code changed: Scheduler.swap_space_cls (missing), "
                           "Scheduler.__init__, Scheduler._free_request, Scheduler.schedule, "
                           "Scheduler._preempt, Scheduler._allocate_on_admission (missing), "
                           "Scheduler.update_draft_token_ids (missing), Scheduler._make_output (")
    # Today's starter with a task written (and a comment in given code): no flag.
    today = (lab.path / "starter.py").read_text()
    starter.write_text(today.replace("    def schedule(self", "    # mine\n    def schedule(self")
                       .replace('raise NotImplementedError(\n        "lab 03-01, task 5',
                                'return False\n    raise NotImplementedError(\n'
                                '        "lab 03-01, task 5'))
    sub = intake(tmp_path / "fork", [lab])
    assert sub.files and "03-01" not in sub.lab_flags


def test_the_scan_names_what_reaches_for_the_grader():
    found = suspicious(b"import os\nos._exit(0)\nimport pytest\nos.environ['LAB_IMPL']='x'\n",
                       "starter.py")
    assert {"os._exit", "import pytest", "os.environ", "string mentioning 'LAB_IMPL'"} <= found
    assert suspicious(b"import math\nx = math.sqrt(2)\n", "starter.py") == set()


COMMAND_UNIT = r"""
import json, sys, tempfile
from pathlib import Path
from course.grading import sandbox
from course.grading.grader import CommandUnit, Instructor, RunContext, Submission
from course.labs.catalog import discover

staging = Path(tempfile.mkdtemp())
staging.chmod(0o711)
(staging / "work").mkdir(mode=0o711)
instructor = Instructor(discover(), staging)
ctx = RunContext(instructor, sandbox.probe(), staging / "work", [], lab_timeout=60)
writer = ("import json, sys; json.dump({'cases': [{'case': 'a', 'outcome': 'passed'}, "
          "{'case': 'b', 'outcome': 'failed', 'message': 'wrong'}]}, open(sys.argv[1], 'w'))")
unit = CommandUnit("engine-exam", "The engine exam", 9, ["{python}", "-c", writer, "{json}"],
                   ["a", "b", "c"])
r = unit.run(ctx, Submission("s", Path(".")))
print(json.dumps([r.points("cpu"), r.max_points, [(t.id, t.outcome) for t in r.tests]]))
"""


def test_a_command_unit_scores_its_cases_against_a_fixed_list(tmp_path):
    course, _ = build_grading_fixture(tmp_path)
    proc = subprocess.run([sys.executable, "-c", COMMAND_UNIT], cwd=course, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(course)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    points, maximum, cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert points == 3.0 and maximum == {"cpu": 9.0}
    assert cases == [["a", "passed"], ["b", "failed"], ["c", "not_run"]]


def _grade(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(course), OMP_NUM_THREADS="1")
    env.pop("LAB_IMPL", None)
    proc = subprocess.run([sys.executable, "-m", "course", "grade", *args, "--test-timeout", "2",
                           "--lab-timeout", "60", *WEAK] if "--merge" not in args else
                          [sys.executable, "-m", "course", "grade", *args],
                          cwd=course, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_shards_merged_give_the_rows_of_one_run_and_a_run_resumes(tmp_path):
    course, klass = build_grading_fixture(tmp_path)
    for d in klass.iterdir():
        if d.name not in SHARDED_CLASS:
            shutil.rmtree(d)
    whole = tmp_path / "whole"
    _grade(course, "--class", str(klass), "--out", str(whole))
    for i in (1, 2):
        _grade(course, "--class", str(klass), "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2")
    shard_students = [sorted(p.name for p in (tmp_path / f"s{i}" / "students").iterdir())
                      for i in (1, 2) if (tmp_path / f"s{i}" / "students").is_dir()]
    assert sorted(sum(shard_students, [])) == sorted(SHARDED_CLASS)  # each in exactly one shard
    merged = tmp_path / "merged"
    _grade(course, "--merge", *(str(tmp_path / f"s{i}") for i in (1, 2)), "--out",
           str(merged))
    for name in ("grades.csv", "gradebook.csv", "similarity.csv"):
        assert (merged / name).read_text() == (whole / name).read_text(), name
    # Each shard compares its own students (with the reference, and with each other).
    for i, students in zip((1, 2), shard_students):
        sim = list(csv.DictReader((tmp_path / f"s{i}" / "similarity.csv").open()))
        assert sim and {r["student"] for r in sim} <= set(students), (i, sim)
        assert {r["closest_student"] for r in sim} - {""} <= set(students), (i, sim)
    whole_sim = list(csv.DictReader((whole / "similarity.csv").open()))
    assert {r["student"] for r in whole_sim} == set(SHARDED_CLASS)
    rows = {r["student"]: r for r in csv.DictReader((whole / "grades.csv").open())}
    assert rows["all-solution"]["exam"] == "0.0" and rows["honest"]["exam"] == "4.0"
    assert rows["syntax-error"]["09-01 status"] == "does not import"
    # New objects built from the reference's source are the reference's code.
    assert rows["exec-source"]["09-01 status"] == "uses the reference"
    assert "a copy of the reference's code" in rows["exec-source"]["flags"]
    # Run again: every student is complete and unchanged, so nothing is graded.
    before = (whole / "students" / "honest" / "grades.json").read_text()
    proc = _grade(course, "--class", str(klass), "--out", str(whole))
    assert proc.stderr.count("graded before") == len(SHARDED_CLASS), proc.stderr
    assert (whole / "grades.csv").read_text() == (merged / "grades.csv").read_text()
    assert (whole / "students" / "honest" / "grades.json").read_text() == before
    # A killed run's class files are rebuilt from the students' reports.
    (whole / "grades.csv").unlink()
    _grade(course, "--merge", str(whole), "--out", str(whole))
    assert (whole / "grades.csv").read_text() == (merged / "grades.csv").read_text()


def test_grading_copies_hold_the_reference_as_bytecode_only(tmp_path):
    """What a lab is graded in: mini_vllm and the labs' solution.py import, from bytecode, with
    no source left to read or exec; a function's file is its module's file, as with source."""
    from course.grading.grader import hide_reference_source

    course, _ = build_grading_fixture(tmp_path)
    lab = course / "phase-09-demo" / "labs" / "lab-01-stats"
    hide_reference_source(course)
    assert not list((course / "mini_vllm").rglob("*.py"))
    assert not (lab / "solution.py").exists() and (lab / "solution.pyc").is_file()
    probe = (
        "import mini_vllm.stats as s\n"
        "from course.labs.loader import load_module\n"
        "from pathlib import Path\n"
        f"sol = load_module(Path({str(lab)!r}), 'solution', '09-01')\n"
        "assert s.add.__code__.co_filename == s.__file__, s.add.__code__.co_filename\n"
        "assert sol.add is s.add and s.add(2, 3) == 5\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(course))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=course, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr
    assert b"def add" not in (course / "mini_vllm" / "stats.pyc").read_bytes()
