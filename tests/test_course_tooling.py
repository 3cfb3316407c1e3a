"""Tests of the course tooling itself, run on a tiny demo course built in a temporary folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from course.integrity.api import compare
from course.labs.catalog import REPO_ROOT, Lab
from course.labs.published import write_published
from course.labs.runner import LabRun
from course.student import dashboard
from course.upstream.refs import check_against_source, check_consistency

FIXTURE = Path(__file__).parent / "fixtures" / "demo_lab"
LAB = "phase-09-demo/labs/lab-01-demo"
ADD_TODO = (  # the demo starter's task 1, as written there
    'raise NotImplementedError(\n        "lab 09-01, task 1: implement add '
    '(hint: python -m course hint 09-01 1)"\n    )'
)

# The grader refuses a weaker sandbox than root's; these runs test the tooling, not the sandbox.
WEAK = [] if os.geteuid() == 0 else ["--allow-weak-isolation"]


@pytest.fixture
def demo(course_skeleton) -> Path:
    """A course with one lab (09-01) and the real tooling."""
    root = course_skeleton()
    shutil.copytree(FIXTURE, root / LAB)
    (root / "planted_bugs").mkdir()
    shutil.copy(FIXTURE.parent / "demo_planted_bugs.py", root / "planted_bugs" / "09-01.py")
    (root / "upstream_refs" / "map").mkdir(parents=True)
    shutil.copy(FIXTURE.parent / "demo_refs.toml", root / "upstream_refs" / "map" / "demo.toml")
    (root / "course" / "labs" / "labs.toml").write_text('[lab."09-01"]\npoints = 5\n')
    return root


def run(root: Path, *args: str, impl: str | None = "solution",
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Recorded lab results go beside the demo course, not into the user's cache.
    env = dict(os.environ, PYTHONPATH=str(root), XDG_CACHE_HOME=str(root.parent / "cache"))
    env.pop("LAB_IMPL", None)
    env.update(extra_env or {})
    if impl is not None:
        env["LAB_IMPL"] = impl
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_solution_is_the_default_and_passes(demo):
    proc = run(demo, "-m", "pytest", LAB, "-q", impl=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout


def test_starter_failures_are_one_line_not_a_traceback(demo):
    proc = run(demo, "-m", "pytest", LAB, "-q", impl="starter")
    out = proc.stdout
    assert proc.returncode == 1
    assert "not implemented yet: 2 tests" in out
    assert "test_add   lab 09-01, task 1: implement add" in out
    assert "test_bump  lab 09-01, task 2: implement Counter.bump" in out
    assert "Traceback" not in out and "raise NotImplementedError" not in out
    assert "1 passed, 2 not implemented" in out
    # After pytest's closing line: every task, next first, with where to read and a hint.
    tail = out[out.index("1 passed, 2 not implemented") :]
    assert "lab 09-01: 2 tasks to do, next first" in tail
    assert "next task 1   add  (starter.py:5)" in tail
    assert "python -m course hint 09-01 1" in tail


def test_other_failures_keep_their_full_report(demo):
    sol = demo / LAB / "solution.py"
    sol.write_text(sol.read_text().replace("return a + b", "return a * b"))
    proc = run(demo, "-m", "pytest", LAB, "-q")
    assert proc.returncode == 1
    assert "assert 6 == 5" in proc.stdout and "NOT IMPLEMENTED" not in proc.stdout


def test_unknown_lab_impl_is_a_one_line_error(demo):
    proc = run(demo, "-m", "pytest", LAB, "-q", impl="mine")
    assert proc.returncode == 4
    err = proc.stderr.strip().splitlines()
    assert err == [
        "ERROR: LAB_IMPL='mine' is not a lab implementation; use one of: solution, starter"
    ]


def test_a_starter_that_does_not_import_fails_each_test_clearly(demo):
    (demo / LAB / "starter.py").write_text("def add(:\n")
    proc = run(demo, "-m", "pytest", LAB, "-q", impl="starter")
    assert proc.returncode == 1
    assert "CANNOT LOAD  lab 09-01: starter.py does not import (SyntaxError" in proc.stdout


def test_check_passes_and_names_the_rejected_bugs(demo):
    proc = run(demo, "-m", "course", "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "add-subtracts" in proc.stdout and "bump-ignores-by" in proc.stdout
    assert proc.stdout.count("rejected") >= 2
    assert "All 1 labs pass the integrity checks." in proc.stdout


def test_check_runs_the_recorded_test_first_and_falls_back_when_it_no_longer_rejects(demo):
    """planted_bugs/seen_by.json: a recorded test that rejects its bug is the verdict; one that
    does not (here test_bump for add-subtracts) costs a full run, never a verdict; the copies
    leave nothing in the temporary folder."""
    tmp = demo.parent / "tmp"
    tmp.mkdir()
    (demo / "planted_bugs" / "seen_by.json").write_text(json.dumps(
        {"09-01": {"add-subtracts": "test_bump", "bump-ignores-by": "test_bump"}}))
    env_tmp = {"TMPDIR": str(tmp)}
    proc = run(demo, "-m", "course", "check", "--no-grading-path", extra_env=env_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"add-subtracts +rejected +by test_add ", proc.stdout), proc.stdout
    assert re.search(r"bump-ignores-by +rejected +by test_bump ", proc.stdout), proc.stdout
    assert "1 planted bug(s) were not rejected by the test" in proc.stdout
    assert not [p for p in tmp.iterdir() if p.name.startswith("course-")], list(tmp.iterdir())
    proc = run(demo, "-m", "course", "check", "--no-grading-path", "--write-seen-by")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((demo / "planted_bugs" / "seen_by.json").read_text()) == {
        "09-01": {"add-subtracts": "test_add", "bump-ignores-by": "test_bump"}}


def test_check_reports_a_bug_the_tests_miss(demo):
    tests = demo / LAB / "test_lab.py"
    tests.write_text(tests.read_text().replace("and c.bump(3) == 5", ""))
    proc = run(demo, "-m", "course", "check")
    assert proc.returncode == 1
    assert "planted bug 'bump-ignores-by': NOT REJECTED" in proc.stdout


def test_check_reports_a_test_that_passes_on_the_starter(demo):
    tests = demo / LAB / "test_lab.py"
    tests.write_text(
        tests.read_text()
        + "\n\ndef test_trivial():\n    assert lab.Counter(4).value == 4, 'starts at 4'\n"
    )
    proc = run(demo, "-m", "course", "check", "--no-bugs")
    assert proc.returncode == 1
    assert "passes on the untouched starter, so it proves nothing" in proc.stdout
    assert "test_trivial" in proc.stdout


def test_check_reports_api_drift_and_stale_bugs(demo):
    starter = demo / LAB / "starter.py"
    starter.write_text(
        starter.read_text().replace("def bump(self, by: int = 1)", "def bump(self, n=1)")
    )
    bugs = demo / "planted_bugs" / "09-01.py"
    bugs.write_text(bugs.read_text().replace('find="return a + b"', 'find="return a+b"'))
    proc = run(demo, "-m", "course", "check")
    assert proc.returncode == 1
    assert "API: Counter.bump: starter method(self, n=1) differs" in proc.stdout
    assert "`find` occurs 0 times" in proc.stdout


def test_grade_writes_json_and_junit_and_exits_zero_on_a_low_score(demo):
    out = demo / "grades"
    proc = run(demo, "-m", "course", "grade", "--out", str(out), impl=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "grades.json").read_text())
    (lab,) = report["labs"]
    assert lab["id"] == "09-01" and lab["status"] == "not started"
    assert (lab["passed"], lab["not_implemented"], lab["total"]) == (0, 2, 2)
    assert (lab["points"], lab["max_points"]) == ({"cpu": 0}, {"cpu": 5})
    outcomes = {t["id"].split("::")[-1]: t["outcome"] for t in lab["tests"]}
    # Graded tests only: the starter_ok test is not part of the grade.
    assert outcomes == {"test_add": "not_implemented", "test_bump": "not_implemented"}
    assert "<testsuite" in (out / "junit" / "lab-09-01.xml").read_text()


def test_grade_a_submission_against_the_published_tests(demo, tmp_path):
    student = tmp_path / "student"
    shutil.copytree(demo / LAB, student / LAB)
    # The student implements add, and "fixes" the tests so that everything passes.
    starter = student / LAB / "starter.py"
    starter.write_text(
        starter.read_text().replace(
            ADD_TODO, "return a + b"
        )
    )
    (student / LAB / "test_lab.py").write_text("def test_bump():\n    pass\n")
    out = demo / "grades"
    proc = run(demo, "-m", "course", "grade", "--submission", str(student), "--out", str(out),
               *WEAK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "grades.json").read_text())
    assert report["files_graded"] == [f"{LAB}/starter.py"]
    (lab,) = report["labs"]
    outcomes = {t["id"].split("::")[-1]: t["outcome"] for t in lab["tests"]}
    assert outcomes["test_add"] == "passed" and outcomes["test_bump"] == "not_implemented"
    # The lab's weight (5) shared by mark: add is 1 of 3.
    assert lab["points"]["cpu"] == pytest.approx(5 / 3, abs=1e-3)
    assert (lab["max_points"], lab["uses_reference"]) == ({"cpu": 5}, [])
    # The course's own files are untouched by grading.
    assert "NotImplementedError" in (demo / LAB / "starter.py").read_text()


def test_grade_gives_nothing_for_importing_the_reference(demo, tmp_path):
    # The reference lives in a package, as in mini_vllm; the starter is meant to write add.
    (demo / "mini_vllm").mkdir()
    (demo / "mini_vllm" / "__init__.py").write_text("")
    (demo / "mini_vllm" / "adder.py").write_text("def add(a, b):\n    return a + b\n")
    solution = demo / LAB / "solution.py"
    solution.write_text(
        solution.read_text().replace(
            "def add(a: int, b: int) -> int:\n    return a + b\n",
            "from mini_vllm.adder import add\n",
        )
    )
    student = tmp_path / "student"
    shutil.copytree(demo / LAB, student / LAB)
    starter = student / LAB / "starter.py"
    starter.write_text(
        starter.read_text().replace(
            f"def add(a: int, b: int) -> int:\n    {ADD_TODO}\n",
            "from mini_vllm.adder import add\n",
        )
    )
    out = demo / "grades"
    proc = run(demo, "-m", "course", "grade", "--submission", str(student), "--out", str(out),
               *WEAK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lab,) = json.loads((out / "grades.json").read_text())["labs"]
    assert lab["uses_reference"] == ["holds the reference's add"]
    assert lab["status"] == "uses the reference"
    # Found before the tests: they are not run (the lab scores 0 whatever they would say).
    assert lab["points"] == {"cpu": 0} and lab["passed"] == 0
    assert {t["message"] for t in lab["tests"]} == {
        "not run: the starter uses the reference's code (see the flags)"}
    assert "uses the reference (holds the reference's add)" in proc.stdout


def test_status_shows_progress_and_the_next_step(demo):
    sol = (demo / LAB / "solution.py").read_text()
    starter = demo / LAB / "starter.py"
    write_published([Lab(demo / LAB)], demo / "course" / "labs" / "published_starters.json")
    starter.write_text(
        starter.read_text().replace(
            ADD_TODO, "return a + b"
        ).replace("self.value = start", "self.value = int(start)")  # given code, changed
    )
    proc = run(demo, "-m", "course", impl=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/1] lab 09-01" in proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("09"))
    assert "1/2" in row and "in progress" in row and "task 2: implement Counter.bump" in row
    assert ("lab 09-01: given code changed: Counter.__init__ -- run `python -m course upgrade "
            "09-01`") in proc.stdout.splitlines()
    # The command to run next names this Python: a bare `pytest` may not be on PATH.
    assert f"LAB_IMPL=starter {sys.executable} -m pytest {LAB} -q" in proc.stdout
    assert sol  # the solution is untouched


def _run(tests: list[dict]) -> LabRun:
    lab = SimpleNamespace(phase="09", id="09-01", title="Demo")  # what a row shows of a lab
    return LabRun(lab, "starter", 0, tests, "", 1.0)


def test_status_wraps_the_next_step_at_words_and_says_which_tests_a_machine_did_not_run():
    passed = {"nodeid": "t::a", "outcome": "passed", "starter_ok": False, "points": 1,
              "message": ""}
    gpu = dict(passed, outcome="skipped", message="Skipped: needs a CUDA GPU: no GPU here")
    task = ("lab 09-01, task 2: implement Counter.bump so that it adds `by` to the value and "
            "returns the new value, which the next call starts from")
    todo = dict(passed, outcome="not_implemented", message=f"NOT IMPLEMENTED  {task}  (t.py:3)")
    rows = dashboard._rows(_run([passed, todo]))
    cells = [row[5] for row in rows]
    assert len(rows) > 1 and " ".join(cells) == task  # every word, none cut
    assert all(len(c) <= dashboard.NEXT_STEP_WIDTH for c in cells)
    assert rows[0][3:5] == ["1/2", "in progress"] and rows[1][:5] == ["", "", "", "", ""]
    assert dashboard._rows(_run([passed, gpu]))[0][3:5] == ["1/1", "done (CPU)"]
    assert dashboard._not_run(_run([passed, gpu])) == {"needs a CUDA GPU: no GPU here": 1}
    assert dashboard._rows(_run([passed]))[0][4] == "done"


def test_status_names_python_as_a_student_can_run_it(tmp_path):
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    assert dashboard._python(tmp_path, str(venv / "python")) == ".venv/bin/python"
    assert dashboard._python(tmp_path, sys.executable) == ".venv/bin/python"  # the same file
    assert dashboard._python(tmp_path / "elsewhere", sys.executable) == sys.executable


def test_list_shows_labs_in_order(demo):
    shutil.copytree(demo / LAB, demo / "phase-08-first/labs/lab-02-second")
    proc = run(demo, "-m", "course", "list")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("phase ")]
    assert [line.split()[2] for line in lines] == ["08-02", "09-01"]


def test_api_compare_flags_missing_names_and_signatures():
    import types

    a, b = types.ModuleType("a"), types.ModuleType("b")
    exec("__all__ = ['f', 'K']\ndef f(x, y=1): ...\nclass K:\n    def m(self): ...\n", a.__dict__)
    exec(
        "__all__ = ['f', 'K', 'g']\ndef f(x, y=2): ...\ndef g(): ...\n"
        "class K:\n    def m(self, z): ...\n    def extra(self): ...\n",
        b.__dict__,
    )
    problems = "\n".join(compare(a, b))
    assert "'g' is exported by solution.py but not by starter.py" in problems
    assert "f: starter(x, y=1) differs from solution(x, y=2)" in problems
    assert "K.m: starter method(self) differs" in problems
    assert "K.extra is in solution.py but not in starter.py" in problems


def _synthetic_upstream(tmp_path: Path) -> Path:
    src = tmp_path / "v9.9.9"
    (src / "vllm" / "core").mkdir(parents=True)
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    (src / "vllm" / "core" / "pool.py").write_text("# header\n\nclass Pool:\n    def take(self):\n")
    return src


def _synthetic_repo(tmp_path: Path, docstring_ref: str, map_line: int, text: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "mini_vllm").mkdir(parents=True)
    (repo / "upstream_refs" / "map").mkdir(parents=True)
    (repo / "mini_vllm" / "pool.py").write_text(
        f'class Pool:\n    """A pool.\n\n    upstream: {docstring_ref}\n    """\n'
    )
    (repo / "upstream_refs" / "map" / "pool.toml").write_text(
        f'[[ref]]\nsymbol = "mini_vllm.pool.Pool"\nfile = "vllm/core/pool.py"\nline = {map_line}\n'
        f'version = "9.9.9"\ntext = "{text}"\n'
    )
    return repo


def test_refs_checker_accepts_a_true_reference(tmp_path):
    src = _synthetic_upstream(tmp_path)
    repo = _synthetic_repo(tmp_path, "vllm/core/pool.py:3 @ v9.9.9", 3, "class Pool:")
    assert check_consistency(repo) == []
    problems, notes, checked = check_against_source([src], repo)
    assert (problems, notes, checked) == ([], [], 1)


def test_refs_checker_finds_a_moved_line_and_says_where_it_went(tmp_path):
    src = _synthetic_upstream(tmp_path)
    repo = _synthetic_repo(tmp_path, "vllm/core/pool.py:2 @ v9.9.9", 2, "class Pool:")
    problems, _, _ = check_against_source([src], repo)
    assert len(problems) == 1 and "found at line 3" in problems[0]


def test_refs_checker_finds_unmapped_and_unused_references(tmp_path):
    repo = _synthetic_repo(tmp_path, "vllm/core/pool.py:4 @ v9.9.9", 3, "class Pool:")
    problems = check_consistency(repo)
    assert any("pool.py:4 @ v9.9.9" in p and "not in the map" in p for p in problems)
    assert any("pool.py:3 @ v9.9.9" in p and "never used" in p for p in problems)


def test_refs_checker_says_which_versions_it_could_not_check(tmp_path):
    repo = _synthetic_repo(tmp_path, "vllm/core/pool.py:3 @ v9.9.9", 3, "class Pool:")
    problems, notes, checked = check_against_source([], repo)
    assert problems == [] and checked == 0 and "not checked" in notes[0]


def test_every_upstream_reference_in_the_course_is_mapped_and_every_entry_used():
    problems = check_consistency(REPO_ROOT)
    assert not problems, "\n".join(problems)


def test_a_bug_only_an_ungraded_test_sees_counts_only_in_given_code(demo):
    """A planted bug is rejected by graded tests; starter_ok tests count only for a bug marked
    given=True (in code the lab gives, which no graded test can reach)."""
    given = "\n\ndef double(x: int) -> int:\n    return 2 * x\n"
    for name in ("starter.py", "solution.py"):
        path = demo / LAB / name
        path.write_text(path.read_text() + given)
    tests = demo / LAB / "test_lab.py"
    tests.write_text(
        tests.read_text()
        + "\n\n@pytest.mark.starter_ok\ndef test_the_given_helper():\n"
        + "    assert lab.double(3) == 6, 'double(3) should be 6'\n"
    )
    bugs = demo / "planted_bugs" / "09-01.py"
    bug = (
        '    PlantedBug(name="double-triples", description="the given helper triples",\n'
        '               file=f"{LAB}/solution.py", find="return 2 * x", replace="return 3 * x"'
        "GIVEN),\n]"
    )
    text = bugs.read_text().rstrip()
    assert text.endswith("]")
    bugs.write_text(text[:-1] + bug.replace("GIVEN", ""))
    proc = run(demo, "-m", "course", "check")
    assert proc.returncode == 1
    assert "planted bug 'double-triples': NOT REJECTED" in proc.stdout
    assert "only crashes or ungraded tests fail" in proc.stdout
    bugs.write_text(text[:-1] + bug.replace("GIVEN", ", given=True"))
    proc = run(demo, "-m", "course", "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "double-triples" in proc.stdout and "test_the_given_helper" in proc.stdout


# --- null starters (course/integrity/null_starters.py, null_check.py) ---------------------------

GENERATOR_CASE = '''__all__ = ["Stream", "first"]


class Stream:
    def __init__(self, items):
        """Given: not a task."""
        self.items = items

    async def each(self, n: int):
        """Task 2: yield the first n items."""
        raise NotImplementedError("lab 09-01, task 2: implement Stream.each")
        yield  # makes it an async generator

    @staticmethod
    def pick(k, default=None):
        raise NotImplementedError("lab 09-01, task 3: implement Stream.pick")


def first(*, key):
    raise NotImplementedError("lab 09-01, task 1: implement first")  # a comment that goes too
'''


def test_null_variants_of_the_demo_starter_empty_every_task_four_ways():
    from course.integrity.null_starters import VARIANTS, null_variants

    source = (FIXTURE / "starter.py").read_text()
    variants = null_variants(source)
    assert list(variants) == list(VARIANTS) == ["pass", "return-none", "return-first", "raise"]
    # What add(2, 3) and Counter(1).bump(3) give in each; the given __init__ stays.
    expected = {"pass": (None, None), "return-none": (None, None), "return-first": (2, 3)}
    for name, text in variants.items():
        assert "NotImplementedError" not in text, f"{name}: a task still raises"
        assert text.startswith('__all__ = ["Counter", "add"]') and "self.value = start" in text
        module: dict = {}
        exec(compile(text, f"<{name}>", "exec"), module)
        counter = module["Counter"](1)
        if name == "raise":
            with pytest.raises(RuntimeError, match="null starter"):
                module["add"](2, 3)
            with pytest.raises(RuntimeError, match="null starter"):
                counter.bump(3)
        else:
            assert (module["add"](2, 3), counter.bump(3)) == expected[name], name
        assert counter.value == 1, f"{name}: the given constructor changed"


def test_null_variants_keep_generators_docstrings_and_given_code():
    import asyncio

    from course.integrity.null_starters import null_variants, task_bodies

    assert [t.qualname for t in task_bodies(GENERATOR_CASE)] == [
        "Stream.each", "Stream.pick", "first"]
    got = {}
    for name, text in null_variants(GENERATOR_CASE).items():
        assert '"""Task 2: yield the first n items."""' in text and "a comment" not in text
        module: dict = {}
        exec(compile(text, f"<{name}>", "exec"), module)
        stream = module["Stream"]("abc")

        async def drain(gen):
            return [x async for x in gen]

        try:
            got[name] = (asyncio.run(drain(stream.each(2))), module["Stream"].pick(7),
                         module["first"](key=4))
        except RuntimeError as exc:
            got[name] = str(exc)
    assert got == {"pass": ([], None, None), "return-none": ([None], None, None),
                   "return-first": ([2], 7, 4), "raise": "null starter"}


def test_check_names_a_graded_test_that_passes_on_a_null_starter(demo):
    """A test of "changes nothing" alone passes when bump does nothing: `course check` names the
    lab, the variant and the test; the record keeps the verdict until the inputs change."""
    tests = demo / LAB / "test_lab.py"
    original = tests.read_text()
    tests.write_text(original + (
        "\n\ndef test_bump_by_zero_changes_nothing():\n"
        "    c = lab.Counter(4)\n    c.bump(0)\n    assert c.value == 4, 'bump(0) keeps 4'\n"))
    args = ("-m", "course", "check", "09-01", "--no-bugs", "--no-exam")
    proc = run(demo, *args, "--write-null-record")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # pass and return-none leave the value alone; so does return-first (bump(0) returns 0).
    for variant in ("pass", "return-none", "return-first"):
        assert (f"lab 09-01: null starter '{variant}' passes graded test "
                "test_bump_by_zero_changes_nothing") in proc.stdout, proc.stdout
    assert "null starter 'raise' passes" not in proc.stdout
    record = json.loads((demo / "planted_bugs" / "null_starters.json").read_text())
    assert record["09-01"]["passing"]["pass"] == ["test_bump_by_zero_changes_nothing"]

    proc = run(demo, *args)  # nothing changed: the recorded verdict, without a run
    assert proc.returncode == 1 and "09-01  recorded: 3 graded test pass(es)" in proc.stdout
    assert "(recorded in planted_bugs/null_starters.json)" in proc.stdout

    # Paired with a bump that must have its effect, the test no longer passes for nothing; the
    # changed test file makes the record stale, so the variants run again.
    tests.write_text(original + (
        "\n\ndef test_bump_by_zero_changes_nothing():\n"
        "    c = lab.Counter(4)\n    assert c.bump(2) == 6, 'bump(2) adds 2'\n    c.bump(0)\n"
        "    assert c.value == 6, 'bump(0) keeps 6'\n"))
    proc = run(demo, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "09-01  ran 4 variants" in proc.stdout and "no graded test passes" in proc.stdout
    assert "python -m course check 09-01 --write-null-record" in proc.stdout  # the note
