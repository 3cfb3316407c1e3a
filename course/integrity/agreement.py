"""Does the grader give every test the outcome pytest gives it? (`course check`)

The grader decides each outcome itself: every test in a forked process inside the sandbox, the
student's code in a process of its own for the labs marked `student_process`, a unittest item's
failure read from where it records it. Where it and pytest part, a grade is not the tests'
verdict (a Hypothesis state machine passed in the grader whatever it found, until this check).
So, per lab and on the same code, both run:

- the solution and the untouched starter: every graded test;
- every planted bug: the test that rejects it (planted_bugs/seen_by.json), on a copy of the
  course with the bug applied.

`course grade` runs in place on the course (or the copy), as an instructor's run would, and
its grades.json is compared with pytest's outcomes: passed, skipped, or not passed (failed,
not implemented, crashed, timed out...). Any test on which they differ is a violation.

That is minutes per lab, so the result is kept in planted_bugs/agreement.json with a digest of
what it depends on: the lab's files (but NOT_GRADED, which no test reads, and a Python file's
docstrings and comments and a test's assert messages: `graded_bytes`), its labs.toml table, its
planted bugs and the tests that reject them, and the grading path's code (GRADING_PATH;
student_process.py for the labs that use it). `course check` compares the digests: a lab whose
inputs changed since its record fails the check with the command that records it again
(`python -m course check --write-agreement LAB`). mini_vllm is not among the inputs: the
reference is the same code for both sides, and the comparison is of the paths, not of it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.integrity.bugs import BUGS_DIR, load_bugs, load_seen_by
from course.labs.catalog import REPO_ROOT, Lab, lab_metadata
from course.labs.published import code_digest
from course.labs.runner import run_lab

RECORD = Path(BUGS_DIR) / "agreement.json"
# The code between a test and its grade: changing it reruns every lab's comparison.
GRADING_PATH = ("course/grading/plugin.py", "course/grading/sandbox.py",
                "course/grading/grader.py", "course/labs/student_process.py",
                "course/labs/loader.py")
# Only on the path of the labs marked `student_process` (no other lab starts one).
STUDENT_PROCESS_ONLY = "course/labs/student_process.py"
# Planted bugs of these labs are left out: each graded run builds the CUDA lab's kernels anew
# in the sandbox's own build folder (minutes a bug); its solution and starter are compared.
# What a student reads and no test imports or opens: editing it changes no outcome.
NOT_GRADED = frozenset({"README.md", "hints.toml", "measure.py"})
BUGS_LEFT_OUT = {"02-06": "each graded run of a planted bug rebuilds the emulated kernels"}


def _outcome(word: str) -> str:
    return word if word in ("passed", "skipped") else "not passed"


def graded_bytes(path: Path) -> bytes:
    """What of a file can change a test's outcome: a Python file's syntax tree without
    positions and docstrings (layout, comments and docstrings change none; no test reads a
    docstring), any other file's bytes. A file that does not parse counts as its bytes.

    In a test file (``test_*.py``) an ``assert``'s message is left out too: it is evaluated only
    once the assertion has failed, so it changes what a failure says, never whether it fails."""
    if path.suffix != ".py":
        return path.read_bytes()
    try:
        tree = ast.parse(path.read_bytes())
    except SyntaxError:
        return path.read_bytes()
    if path.name.startswith("test_"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                node.msg = None
    return code_digest(tree).encode()


def inputs_digest(lab: Lab, root: Path = REPO_ROOT) -> str:
    """What the comparison of `lab` depends on, as one SHA-256."""
    h = hashlib.sha256()
    files = [p for p in sorted(lab.path.rglob("*")) if p.is_file()
             and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".so", ".o"))
             and p.relative_to(lab.path).as_posix() not in NOT_GRADED]
    table = lab_metadata().get(lab.id, {})
    files += [root / BUGS_DIR / f"{lab.id}.py"]
    files += [root / f for f in GRADING_PATH
              if f != STUDENT_PROCESS_ONLY or table.get("student_process")]
    for p in files:
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + graded_bytes(p) + b"\0")
    h.update(json.dumps(table, sort_keys=True).encode())
    h.update(json.dumps(load_seen_by(root).get(lab.id, {}), sort_keys=True).encode())
    return h.hexdigest()


def graded_outcomes(root: Path, lab: Lab, impl: str, only: tuple[str, ...] = ()
                    ) -> tuple[dict[str, tuple[str, str]], str]:
    """{test id within test_lab.py: (outcome, message)} as a grading session gives them for
    `lab` of the course at `root` (the grader's own session: the sandbox, the plugin, the
    student's process), and the session's output when it broke."""
    from course.grading import grader, sandbox

    iso = sandbox.probe()
    work = Path(tempfile.mkdtemp(prefix="course-agreement-"))
    try:
        os.chmod(work, 0o711)
        run = grader.lab_session(root, lab, {}, {"test_timeout": 120, "kill_grace": 5},
                                 impl=impl, iso=iso, work=work, hide=[root],
                                 test_timeout=120, lab_timeout=3600, only_tests=only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = {}
    for m in run.messages:
        if m.get("type") == "test" and isinstance(m.get("nodeid"), str):
            name = m["nodeid"].split("::", 1)[-1]
            found[name] = (str(m.get("outcome")), str(m.get("message", "")))
    if not any(m.get("type") == "done" for m in run.messages):
        return {}, run.log_tail or f"the session ended early (exit {run.returncode})"
    return found, ""


def pytest_outcomes(root: Path, lab: Lab, impl: str, only: tuple[str, ...] = ()
                    ) -> tuple[dict[str, str], str]:
    """{test id: outcome} of every test, as plain pytest gives them."""
    run = run_lab(lab, impl, root=root, only=only)
    if run.broken:
        return {}, run.output[-2000:]
    return {t["nodeid"].split("::", 1)[-1]: t["outcome"] for t in run.tests}, ""


def compare(what: str, grader: dict[str, tuple[str, str]], pytest: dict[str, str]
            ) -> list[str]:
    """One line per test on which the two disagree (or that only one of them ran)."""
    lines = []
    for name in sorted(set(grader) | set(pytest)):
        if name not in pytest or name not in grader:
            lines.append(f"{what}: {name}: {'only the grader' if name in grader else 'only pytest'}"
                         " ran it")
            continue
        got, message = grader[name]
        if _outcome(got) != _outcome(pytest[name]):
            lines.append(f"{what}: {name}: pytest says {pytest[name]}, the grader {got}"
                         f"{f' ({message[:160]})' if message else ''}")
    return lines


@dataclass
class LabAgreement:
    lab: str
    digest: str
    disagreements: list[str] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"digest": self.digest, "disagreements": self.disagreements,
                "compared": self.compared, "seconds": round(self.seconds, 1)}


def compare_lab(lab: Lab, slots, root: Path = REPO_ROOT, has_cuda: bool = False,
                pool=None) -> LabAgreement:
    """The grader against pytest on `lab`: solution, starter, each planted bug's rejecting test.
    `slots`: course.integrity.checks.CopySlots for the bugs' copies; `pool`: an executor for
    the runs (they are independent), or None to run them one after another."""
    start = time.perf_counter()
    result = LabAgreement(lab.id, inputs_digest(lab, root))
    jobs = [(impl, None) for impl in ("solution", "starter")]
    seen_by = load_seen_by(root).get(lab.id, {})
    bugs = [] if lab.id in BUGS_LEFT_OUT else [
        b for b in load_bugs(lab)
        if seen_by.get(b.name) and (b.requires != "cuda" or has_cuda)]
    jobs += [("solution", bug) for bug in bugs]

    def one(job):
        impl, bug = job
        if bug is None:
            return impl, _both(root, lab, impl, ())
        with slots.copy_of(root) as copy:
            bug.apply(copy)
            return f"planted bug {bug.name}", _both(copy, lab, "solution", (seen_by[bug.name],))

    done = pool.map(one, jobs) if pool is not None else map(one, jobs)
    for what, (lines, count) in done:
        result.disagreements += lines
        kind = what if not what.startswith("planted bug") else "planted bugs"
        result.compared[kind] = result.compared.get(kind, 0) + count
    result.seconds = time.perf_counter() - start
    return result


def _both(root: Path, lab: Lab, impl: str, only: tuple[str, ...]) -> tuple[list[str], int]:
    what = impl if not only else f"planted bug run of {only[0]}"
    grader, broke = graded_outcomes(root, lab, impl, only)
    if broke:
        return [f"{what}: grading broke: {broke.strip().splitlines()[-1] if broke else ''}"], 0
    pytest, broke = pytest_outcomes(root, lab, impl, only)
    if broke:
        return [f"{what}: the pytest run broke: {broke.strip().splitlines()[-1]}"], 0
    return compare(what, grader, pytest), len(pytest)


def load_record(root: Path = REPO_ROOT) -> dict:
    try:
        return json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def write_record(results: list[LabAgreement], root: Path = REPO_ROOT) -> Path:
    record = load_record(root)
    labs = record.setdefault("labs", {})
    for r in results:
        labs[r.lab] = r.as_dict()
    record["command"] = "python -m course check --write-agreement [LAB ...]"
    record["labs"] = dict(sorted(labs.items()))
    (root / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return root / RECORD


def check_record(labs: list[Lab], root: Path = REPO_ROOT) -> list[str]:
    """Violations of the recorded comparison: a lab with no record, or recorded for other
    inputs, or whose record holds disagreements."""
    recorded = load_record(root).get("labs", {})
    problems = []
    for lab in labs:
        entry = recorded.get(lab.id)
        command = f"python -m course check --write-agreement {lab.id}"
        if entry is None:
            problems.append(f"the grader has not been compared with pytest on this lab: "
                            f"run `{command}` and commit {RECORD}")
        elif entry.get("digest") != inputs_digest(lab, root):
            problems.append(f"its files, planted bugs or the grading path changed since the "
                            f"grader was compared with pytest: run `{command}` and commit "
                            f"{RECORD}")
        else:
            problems += [f"the grader and pytest disagree: {d}"
                         for d in entry.get("disagreements", [])]
    return problems
