"""`python -m course check`: the course integrity checks of DESIGN.md, for every lab.

1. the solution passes every test;
2. the untouched starter fails every graded test (tests marked `starter_ok` are exempt);
3. starter.py and solution.py expose the same API;
4. every planted bug is rejected: with the bug applied to a copy of the repository, at least one
   of the lab's tests fails.
"""

from __future__ import annotations

import ast
import contextlib
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.integrity.api import compare
from course.integrity.bugs import BUGS_DIR, SEEN_BY, PlantedBug, bugs_path, load_bugs, load_seen_by
from course.labs.catalog import REPO_ROOT, Lab, copy_ignore, lab_metadata
from course.labs.loader import load_module
from course.labs.runner import LabRun, run_lab
from course.student.hints import check_hints
from course.student.measure import check_predict
from course.upstream.refs import check_consistency
from course.upstream.today import check_today_consistency

_RAISE_RE = re.compile(r"raise NotImplementedError\((?P<arg>[^)]*)\)")


@dataclass
class BugResult:
    bug: PlantedBug
    status: str  # "rejected", "NOT REJECTED", "not checked", "invalid"
    detail: str = ""
    seconds: float = 0.0  # wall time of the check (the copy, the build and the test runs)
    seen_by: str = ""  # the test id that rejected it (for planted_bugs/seen_by.json)
    first: str = ""  # the recorded test run first, when there was one


@dataclass
class LabCheck:
    lab: Lab
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bugs: list[BugResult] = field(default_factory=list)
    solution: LabRun | None = None
    starter: LabRun | None = None


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check_starter_messages(lab: Lab) -> list[str]:
    """Each `raise NotImplementedError(...)` in the starter names this lab and a task number
    (and the hint command for that task)."""
    problems = []
    text = (lab.path / "starter.py").read_text(encoding="utf-8")
    expected = re.compile(rf"lab {re.escape(lab.id)}, task (\d+): \S")
    for m in _RAISE_RE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found = expected.search(m["arg"])
        if not found:
            problems.append(
                f'starter.py:{line}: NotImplementedError should say "lab {lab.id}, task N: ..."'
            )
        else:
            hint = f"python -m course hint {lab.id} {found[1]}"
            if hint not in " ".join(m["arg"].replace('"', " ").split()):
                problems.append(f"starter.py:{line}: the message should end with ({hint})")
    if not _RAISE_RE.search(text) and not (lab.path / "starter.cu").is_file():
        problems.append("starter.py leaves nothing to implement (no NotImplementedError)")
    return problems


def check_test_messages(lab: Lab) -> list[str]:
    """Every `assert` in the lab's tests has a message. A student who fails a bare one reads
    pytest's values and the test's rule but not what went wrong; and past the first failure of
    a run, a report shows only the message's first line (course/labs/feedback.py)."""
    try:
        tree = ast.parse(lab.test_file.read_bytes())
    except SyntaxError:
        return []  # the test run reports it
    bare = sorted(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is None)
    if not bare:
        return []
    lines = ", ".join(map(str, bare[:8])) + (f" and {len(bare) - 8} more" if len(bare) > 8 else "")
    return [f"{lab.test_file.name}: {len(bare)} assert(s) without a message (lines {lines}); "
            "add one that says what was expected, what came and the likely cause"]


def check_runs(check: LabCheck, root: Path) -> None:
    lab = check.lab
    sol = check.solution = run_lab(lab, "solution", root=root)
    if sol.broken:
        check.violations.append(
            f"solution: the test run broke (pytest exit {sol.exit_code}):\n" + _tail(sol.output)
        )
    else:
        for t in sol.by_outcome("failed", "not_implemented", graded=False):
            check.violations.append(f"solution fails {t['nodeid']}: {t['message']}")
        skipped = sol.by_outcome("skipped", graded=False)
        if skipped:
            check.notes.append(f"{len(skipped)} tests skipped here ({skipped[0]['message']})")
        if not sol.graded:
            check.notes.append("no graded test ran on this machine")
    st = check.starter = run_lab(lab, "starter", root=root)
    if st.broken:
        check.violations.append(
            f"starter: the test run broke (pytest exit {st.exit_code}):\n" + _tail(st.output)
        )
    else:
        for t in st.by_outcome("passed"):
            check.violations.append(
                f"passes on the untouched starter, so it proves nothing: {t['nodeid']} "
                f"(mark it starter_ok if that is intended)"
            )


def check_api(check: LabCheck) -> None:
    lab = check.lab
    try:
        starter = load_module(lab.path, "starter", lab.id)
        solution = load_module(lab.path, "solution", lab.id)
    except Exception as exc:
        check.violations.append(f"cannot import for the API check: {exc}")
        return
    check.violations.extend(f"API: {p}" for p in compare(starter, solution))


class CopySlots:
    """Folders for the planted bugs' copies of the repository, reused from one bug to the next.

    A copy always lives at the same path of its slot, so that what a bug's test run builds from
    the files the bug leaves alone (the CPU emulation's objects of every kernel source it does not
    edit, keyed by their path) is found by the next bug's run instead of built again. There is
    one slot per bug running at a time; everything, builds included, lives under one temporary
    folder that :meth:`close` removes.
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="course-check-"))
        self._free: queue.SimpleQueue[Path] = queue.SimpleQueue()
        self._count = 0
        self._lock = threading.Lock()

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @contextlib.contextmanager
    def copy_of(self, root: Path):
        """A fresh copy of ``root`` in a free slot, removed when the block ends."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                self._count += 1
                slot = self.root / f"slot-{self._count}"
        copy = slot / "repo"
        try:
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(root, copy, ignore=copy_ignore)
            yield copy
        finally:
            shutil.rmtree(copy, ignore_errors=True)
            self._free.put(slot)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def check_bug(lab: Lab, bug: PlantedBug, has_cuda: bool, root: Path = REPO_ROOT,
              slots: CopySlots | None = None, first: str = "") -> BugResult:
    """Run ``lab``'s tests on a copy of ``root`` with ``bug`` applied (in one of ``slots``, or
    in a copy of its own). ``first``: a test id that rejected the bug before
    (planted_bugs/seen_by.json), run alone first; the lab's tests run only when it does not
    reject the bug."""
    own = slots is None
    slots = CopySlots() if own else slots
    try:
        start = time.perf_counter()
        result = _check_bug(lab, bug, has_cuda, root, slots, first)
        result.first = first
        result.seconds = time.perf_counter() - start
        return result
    finally:
        if own:
            slots.close()


def _check_bug(lab: Lab, bug: PlantedBug, has_cuda: bool, root: Path,
               slots: CopySlots, first: str) -> BugResult:
    problems = bug.problems(root)
    if problems:
        return BugResult(bug, "invalid", "; ".join(problems))
    if bug.requires == "cuda" and not has_cuda:
        return BugResult(bug, "not checked", "needs a CUDA GPU")
    # A tier runs only its own tests: the bug must be seen by the kind of test meant to see it.
    tier = ("-m", bug.requires) if bug.requires else ()
    env = {"MINI_VLLM_BUILD_DIR": str(slots.build_dir)}
    with slots.copy_of(root) as copy:
        bug.apply(copy)
        run = None
        if first:  # the test that saw it last time: when it still does, that is the verdict
            run = run_lab(lab, "solution", root=copy, extra_args=tier, extra_env=env,
                          only=(first,))
            if not (run.exit_code == 1 and _rejections(run, bug.given)):
                run = None
        if run is None:
            run = run_lab(lab, "solution", root=copy, extra_args=("-x", *tier), extra_env=env)
        if run.exit_code == 1 and not _rejections(run, bug.given):
            # The first failure was a crash; look further for a test that fails on behaviour.
            run = run_lab(lab, "solution", root=copy, extra_args=tier, extra_env=env)
    rejecting = _rejections(run, bug.given)
    by = f", {bug.requires} tier" if bug.requires else ""
    if run.exit_code == 1 and rejecting:
        t = rejecting[0]
        test_id = t["nodeid"].split("::", 1)[-1]
        return BugResult(bug, "rejected", f"by {test_id} ({t['exception']}{by})",
                         seen_by=test_id)
    skipped = run.by_outcome("skipped", graded=False)
    if run.exit_code == 0 and run.tests and len(skipped) == len(run.tests):
        return BugResult(bug, "not checked", f"the {bug.requires} tests were all skipped here "
                         f"({skipped[0]['message']})")
    if run.exit_code == 5 and bug.requires:
        return BugResult(bug, "invalid", f"no test of lab {lab.id} is marked {bug.requires}")
    if run.exit_code == 0:
        return BugResult(bug, "NOT REJECTED", "every test passed with the bug in place")
    crashes = run.by_outcome("failed", "not_implemented", graded=False)
    if run.exit_code == 1 and crashes:
        t = crashes[0]
        return BugResult(
            bug,
            "NOT REJECTED",
            f"only crashes or ungraded tests fail ({t['nodeid'].split('::', 1)[-1]}: "
            f"{t.get('exception') or t['outcome']}); a graded test must fail on an assertion or "
            "a documented error",
        )
    return BugResult(
        bug,
        "NOT REJECTED",
        f"the test run broke instead (exit {run.exit_code}):\n" + _tail(run.output),
    )


# A failure of these kinds says the code did not load or run, not that the tests caught the bug.
CRASH_TYPES = {
    "ImportError", "ModuleNotFoundError", "AttributeError", "SyntaxError", "IndentationError",
    "NameError", "LabImplError", "NotImplementedError", "",
}


def _rejections(run: LabRun, given: bool = False) -> list[dict]:
    """Graded tests (not starter_ok) that failed on an assertion or a documented error; for a
    bug in given code, the lab's tests of that code (starter_ok) count too."""
    failed = run.by_outcome("failed", graded=not given)
    return [t for t in failed if t.get("exception", "") not in CRASH_TYPES]


def check_lab(lab: Lab, *, bugs_required: bool = True, root: Path = REPO_ROOT) -> LabCheck:
    """The checks of one lab but its planted-bug runs, which the caller runs with check_bug."""
    check = LabCheck(lab)
    missing = lab.missing_files()
    if missing:
        check.violations.append(f"missing {', '.join(missing)}")
        return check
    check.violations.extend(check_starter_messages(lab))
    check.violations.extend(check_test_messages(lab))
    check.violations.extend(f"hints: {p}" for p in check_hints(lab))
    check.violations.extend(f"measure: {p}" for p in check_predict(lab))
    if (lab.path / "planted_bugs.py").exists():
        check.violations.append(
            f"planted_bugs.py belongs in {bugs_path(lab).relative_to(lab.phase_dir.parent)}, "
            f"not in the student's lab folder (it quotes the reference)"
        )
    check_api(check)
    check_runs(check, root)
    if bugs_required:
        try:
            listed = load_bugs(lab)
        except Exception as exc:
            check.violations.append(f"{BUGS_DIR}/{lab.id}.py: {exc}")
        else:
            if not listed:
                check.violations.append(
                    f"no planted bugs ({BUGS_DIR}/{lab.id}.py with BUGS = [...])"
                )
            if len({b.name for b in listed}) != len(listed):
                check.violations.append("planted bug names are not unique")
            check_seen_by_alone(check, root)
    return check


def check_seen_by_alone(check: LabCheck, root: Path) -> None:
    """The tests planted_bugs/seen_by.json names for this lab pass on the reference when run
    alone, as `course check` runs them first on a planted bug (a test that failed alone for
    another reason would reject every bug it names)."""
    tests = sorted(set(load_seen_by(root).get(check.lab.id, {}).values()))
    if not tests:
        return
    run = run_lab(check.lab, "solution", root=root, only=tuple(tests))
    if run.broken:  # a test it names is gone: those bugs run the lab's tests, as without it
        check.notes.append(f"{BUGS_DIR}/{SEEN_BY} names tests that do not run (pytest exit "
                           f"{run.exit_code}); rewrite it: python -m course check --write-seen-by")
    for t in run.by_outcome("failed", "not_implemented", graded=False):
        check.violations.append(f"{BUGS_DIR}/{SEEN_BY}: {t['nodeid'].split('::', 1)[-1]} fails "
                                "on the reference when run alone")


def check_metadata(labs: list[Lab]) -> list[str]:
    """course/labs/labs.toml has a table for every lab and none for a lab that does not exist; every
    engine part is a name that both the starter and the solution export."""
    try:
        meta = lab_metadata()
    except ValueError as exc:
        return [str(exc)]
    ids = {lab.id for lab in labs}
    problems = [f"course/labs/labs.toml: no table for lab {i}" for i in sorted(ids - set(meta))]
    problems += [f"course/labs/labs.toml: lab {i} does not exist" for i in sorted(set(meta) - ids)]
    for lab in labs:
        for name in (*lab.engine_parts, *lab.meta.get("notebook", ())):
            for impl in ("starter", "solution"):
                if name not in _exported_names(lab, impl):
                    problems.append(
                        f"course/labs/labs.toml: lab {lab.id}: engine part {name!r} is not in "
                        f"{impl}.py's __all__"
                    )
    return problems


def _exported_names(lab: Lab, impl: str) -> set[str]:
    """Names in a lab file's `__all__`, read from its source (nothing is imported)."""
    import ast

    tree = ast.parse((lab.path / f"{impl}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


def check_course() -> list[str]:
    """Checks that concern the course as a whole rather than one lab."""
    from course.labs.catalog import discover

    problems = [f"upstream refs: {p}" for p in check_consistency(REPO_ROOT)]
    problems += [f"upstream today: {p}" for p in check_today_consistency(REPO_ROOT)]
    return problems + check_metadata(discover())


def _tail(text: str, n: int = 15) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[-n:])


# --- the grading path, end to end ---------------------------------------------------------------

GRADING_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "grading"
FIXTURE_LAB = "phase-09-demo/labs/lab-01-stats"


def build_grading_fixture(dest: Path) -> tuple[Path, Path]:
    """A two-lab course with this checkout's tooling (dest/course) and a class of submissions
    (dest/class): an honest one, one per known attack, and a hanging one."""
    course = dest / "course"
    course.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "course", course / "course", ignore=copy_ignore)
    shutil.copy(REPO_ROOT / "conftest.py", course)
    (course / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "--import-mode=importlib -p no:cacheprovider"\n'
    )
    for part in ("mini_vllm", "phase-09-demo"):
        shutil.copytree(GRADING_FIXTURE / part, course / part)
    shutil.copy(GRADING_FIXTURE / "course" / "labs" / "labs.toml",
                course / "course" / "labs" / "labs.toml")
    klass = dest / "class"
    shutil.copytree(GRADING_FIXTURE / "submissions", klass)
    # A starter that is a link to the lab's solution (made here: its target is an absolute path).
    link = klass / "symlink" / FIXTURE_LAB / "starter.py"
    link.parent.mkdir(parents=True, exist_ok=True)  # git keeps no empty folder
    link.unlink(missing_ok=True)
    link.symlink_to(course / FIXTURE_LAB / "solution.py")
    return course, klass


# What each fixture submission may score at most, per lab (09-01 is worth 10, 09-02 6), and the
# flag its report must carry. Submissions that leave 09-02 as published score 0 there without a
# run; the honest one, and those whose attack aims at the next lab (conftest-append) or at the
# reports of the whole session (report-plugin), have their own 09-02 and must keep its 6 points.
GRADING_EXPECTATIONS = {
    # name: (09-01 points, 09-02 cpu points, a substring the flags must contain or "")
    "honest": (10.0, 6.0, ""),
    "exit-at-import": (0.0, 0.0, "os._exit"),
    "pytest-exit": (0.0, 0.0, "import pytest"),
    "report-plugin": (0.0, 6.0, "_pytest"),
    "conftest-append": (0.0, 6.0, "conftest"),
    "atexit-rewrite": (0.0, 0.0, "atexit"),
    "orphan": (0.0, 0.0, "os.setsid"),
    "env-switch": (0.0, 0.0, "uses the reference"),
    "hidden-all": (0.0, 0.0, "uses the reference"),
    "sys-modules": (0.0, 0.0, "uses the reference"),
    "copies": (0.0, 0.0, "uses the reference"),
    "patch-tests": (0.0, 0.0, "sys.modules"),
    "paste": (0.0, 0.0, "the reference's code"),
    "symlink": (0.0, 0.0, "symbolic link"),
    "pth-file": (0.0, 0.0, ".pth"),
    # add, histogram and bump pass (1.25 + 2.5 + 5); mean is killed; 09-02 hangs at import.
    "hang": (8.75, 0.0, "import signal"),
    # The class of an instructor's trial (issue 30): honest work, half and whole, and the ways a
    # submission goes wrong that the reports must name.
    "partial": (2.5, 0.0, ""),
    "all-solution": (0.0, 0.0, "uses the reference"),
    "exec-source": (0.0, 0.0, "a copy of the reference's code"),
    "syntax-error": (0.0, 0.0, ""),
    "writer": (1.25, 0.0, "os.environ"),
    "sleeper": (0.0, 0.0, "timed out (5 tests)"),
    "memory-hog": (0.0, 0.0, ""),
}
# The status of each unit (09-01, 09-02, the fixture's exam) and the exam's points. The exam runs
# a lab only when it is the student's own work: copied, pasted or broken labs earn nothing there.
GRADING_STATUSES = {
    "honest": ("done", "done", "done", 4.0),
    "partial": ("in progress", "not started", "in progress", 2.0),
    "all-solution": ("uses the reference", "uses the reference", "not started", 0.0),
    "copies": ("uses the reference", "not started", "not started", 0.0),
    "exec-source": ("uses the reference", "not started", "not started", 0.0),
    "paste": ("similarity", "not started", "not started", 0.0),
    "syntax-error": ("does not import", "not started", "not started", 0.0),
    "pytest-exit": ("does not import", "not started", "not started", 0.0),
    "exit-at-import": ("crashed", "not started", "in progress", 0.0),
    "sleeper": ("timed out (5 tests)", "not started", "in progress", 0.0),
    "hang": ("timed out (1 test)", "timed out (2 tests)", "in progress", 2.0),
    "writer": ("in progress", "not started", "in progress", 0.0),
    "symlink": ("not started", "not started", "not started", 0.0),
    "memory-hog": ("memory limit", "not started", "memory limit", 0.0),
    # Caught by the tests themselves: a pytest plugin registered, the test functions rewritten.
    # 09-01 runs the student's code in a process of its own: a plugin registered or tests
    # rewritten there reach nothing. 09-02 runs its tests beside the student's code, where
    # rewriting them is caught ("tampered").
    "report-plugin": ("not started", "done", "in progress", 0.0),
    "patch-tests": ("crashed", "tampered", "in progress", 0.0),
}
FIXTURE_MEMORY_GIB = 1.5  # the fixture class's --memory-limit (the hog asks for 6 GiB; the writer
# leaves up to 1.1 GiB in its tmpfs folders, beside the test's process and the student's)
WRITER_MARK = "course-fixture-writer-"  # what the writer submission names its files
PTH_NAME = "course_grading_fixture_attack.pth"


def check_grading_path(workdir: Path | None = None, jobs: int = 2) -> tuple[list[str], dict]:
    """Grade the fixture class end to end with `python -m course grade --class` and compare
    each submission's points with GRADING_EXPECTATIONS. Returns (problems, facts)."""
    import csv
    import json
    import site
    import subprocess
    import sys
    import time

    from course.grading import STATUSES, status_word

    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="course-grading-check-")) if own else workdir
    problems: list[str] = []
    try:
        course, klass = build_grading_fixture(workdir)
        out = workdir / "grades"
        sites = [Path(p) for p in site.getsitepackages()]
        env = dict(os.environ, PYTHONPATH=str(course), OMP_NUM_THREADS="1")
        env.pop("LAB_IMPL", None)
        test_timeout, lab_timeout = 2, 60
        start = time.monotonic()
        # Graded as a GitHub workflow grades a class: two shards, then a merge.
        runs = [["--class", str(klass), "--out", str(workdir / f"shard-{i}"), "--shard",
                 f"{i}/2", "-j", str(jobs), "--memory-limit", str(FIXTURE_MEMORY_GIB),
                 # Not root: the sandbox this machine allows (the writer's check still holds
                 # with user namespaces; only the weakest level would fail it).
                 *([] if os.geteuid() == 0 else ["--allow-weak-isolation"]),
                 "--test-timeout", str(test_timeout),
                 "--lab-timeout", str(lab_timeout)] for i in (1, 2)]
        runs.append(["--merge", str(workdir / "shard-1"), str(workdir / "shard-2"), "--out",
                     str(out)])
        for args in runs:
            proc = subprocess.run([sys.executable, "-m", "course", "grade", *args],
                                  cwd=course, env=env, capture_output=True, text=True,
                                  timeout=1800)
            if proc.returncode != 0:
                break
        seconds = time.monotonic() - start
        facts = {"seconds": round(seconds, 1), "exit": proc.returncode, "out": str(out)}
        if proc.returncode != 0 or not (out / "grades.csv").is_file():
            return [f"grading the fixture class failed (exit {proc.returncode}, "
                    f"`course grade {' '.join(args[:1])}`):\n"
                    + _tail(proc.stdout + proc.stderr, 30)], facts
        snapshot = {p: p.read_bytes() for p in out.rglob("grades.json")}
        time.sleep(6)  # the orphan's daemon would strike now
        for p, data in snapshot.items():
            if p.read_bytes() != data:
                problems.append(f"{p.relative_to(out)} changed after grading finished")
        for d in sites:
            if (d / PTH_NAME).exists():
                (d / PTH_NAME).unlink()
                problems.append(f"a submission wrote {PTH_NAME} into {d}")
        rows = {r["student"]: r for r in csv.DictReader((out / "grades.csv").open())}
        for name, (lab1, lab2, flag) in GRADING_EXPECTATIONS.items():
            row = rows.get(name)
            if row is None:
                problems.append(f"{name}: no row in grades.csv")
                continue
            got = (float(row["09-01"] or 0), float(row["09-02"] or 0))
            if name in ("honest", "hang", "conftest-append", "report-plugin"):
                ok = got == (lab1, lab2)
            else:
                ok = got[0] <= lab1 and got[1] == lab2
            if not ok:
                problems.append(f"{name}: scored {got} (09-01, 09-02), expected {(lab1, lab2)}")
            if flag and flag not in row["flags"]:
                problems.append(f"{name}: flags lack {flag!r}: {row['flags']!r}")
            if row["cpu_max"] != "20.0":
                problems.append(f"{name}: CPU maximum {row['cpu_max']}, expected 20 (fixed)")
            unknown = [s for s in (row[k] for k in row if k.endswith(" status"))
                       if status_word(s) not in STATUSES]
            if unknown:
                problems.append(f"{name}: statuses outside the documented list: {unknown}")
            if name in GRADING_STATUSES:
                *statuses, exam = GRADING_STATUSES[name]
                got_statuses = [row[f"{u} status"] for u in ("09-01", "09-02", "exam")]
                if got_statuses != statuses or float(row["exam"] or 0) != exam:
                    problems.append(f"{name}: statuses {got_statuses}, exam {row['exam']}; "
                                    f"expected {statuses}, exam {exam}")
            report = json.loads((out / "students" / name / "grades.json").read_text())
            for lab in report["labs"]:
                peak = lab.get("peak_memory_mib")
                if peak is not None and peak > FIXTURE_MEMORY_GIB * 1024:
                    problems.append(f"{name}: {lab['id']} held {peak} MiB, over the limit")
                junit = out / "students" / name / lab["junit"]
                if not junit.is_file():
                    problems.append(f"{name}: no JUnit file for {lab['id']}")
        left = [str(p) for d in ("/tmp", "/dev/shm") for p in Path(d).glob(WRITER_MARK + "*")]
        left += [str(p) for p in workdir.rglob(WRITER_MARK + "*")]
        if left:
            problems.append(f"the writer's files outlived the run: {', '.join(left[:4])}")
            for f in left:
                Path(f).unlink(missing_ok=True)
        if rows.get("honest", {}).get("flags"):
            problems.append(f"honest: flagged: {rows['honest']['flags']}")
        budget = 2 * lab_timeout * len(GRADING_EXPECTATIONS) / jobs + 120
        if seconds > budget:
            problems.append(f"grading the fixture class took {seconds:.0f} s (budget {budget:.0f})")
        return problems, facts
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
