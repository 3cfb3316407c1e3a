"""Grading students' work against the instructor's copy of the course.

The trust model, in order:

1. Everything that decides a grade comes from the instructor's checkout, snapshotted before any
   student code runs: the tests, the tooling, mini_vllm, and the *manifest* (every graded test,
   its weight and tier), collected with the reference solution. A lab's maximum is its weight in
   course/labs/labs.toml, whatever runs: a test that did not run scores 0 with its reason.
2. A submission contributes only its starter files, read without following links.
3. Each lab runs in its own copy of the course (no other lab's student code) through
   course.grading.sandbox, in a pytest session that never imports student code itself: each test
   runs in a forked child (see course.grading.plugin), and only the session's verified messages
   reach the grader, which writes every report.
4. Beyond the tests: a reference check (does the starter take the reference's objects?), a scan
   for code that reaches into the grader, and a similarity report (course.grading.similarity).

A graded unit is anything with an id, a title, fixed maxima per tier and a run method: labs are
`LabUnit`; a command that writes a list of cases (the engine exam) is `CommandUnit`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import py_compile
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import course.grading.sandbox as sandbox
from course.grading.roster import shard_of
from course.labs.catalog import REPO_ROOT, Lab, copy_ignore
from course.labs.published import STUDENT_FILES, changed_given

MAX_FILE_BYTES = 1 << 20
TIERS = ("cpu", "gpu")
# What the course copy for one lab holds besides the lab itself.
TREE_PARTS = ("course", "mini_vllm", "conftest.py", "pyproject.toml")
# Grading sessions load exactly these plugins (no autoloading of whatever else is installed).
SESSION_PLUGINS = ("-p", "no:cacheprovider", "-p", "pytest_timeout", "-p",
                   "_hypothesis_pytestplugin", "-p", "course.grading.plugin")


# --- the instructor's side ----------------------------------------------------------------------


def published_tasks(source: str) -> list[str]:
    """Names in `__all__` whose published definition raises NotImplementedError: what the student
    writes. Every other exported name is a helper the starter gives."""
    tree = ast.parse(source)
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = set(ast.literal_eval(node.value))
    tasks = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
            node.name in exported
        ):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Raise) and "NotImplementedError" in ast.dump(sub.exc or sub):
                    tasks.append(node.name)
                    break
    return sorted(tasks)


def given_names(lab: Lab) -> list[str]:
    """The exported names of the published starter that are not tasks (helpers it gives)."""
    source = (lab.path / "starter.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = list(ast.literal_eval(node.value))
    tasks = set(published_tasks(source))
    return sorted(n for n in exported if n not in tasks)


def student_files(lab: Lab) -> list[str]:
    """The files of `lab` a submission may replace: starter.py when it has something to write,
    starter.cu when there is one. (Lab 02-06's starter.py only builds the student's kernels; a
    submitted one is ignored.)"""
    names = []
    starter = lab.path / "starter.py"
    if starter.is_file() and published_tasks(starter.read_text(encoding="utf-8")):
        names.append("starter.py")
    if (lab.path / "starter.cu").is_file():
        names.append("starter.cu")
    return names


TRITON_IMPORT = re.compile(r"^import triton\b", re.M)


def hide_reference_source(tree: Path) -> None:
    """The reference's Python in a course copy becomes bytecode only: every module of mini_vllm
    and every lab's solution.py. They still import (the tests' oracles, the engine pieces of
    labs that are not the student's) but there is no source to read, copy or exec. Code taken
    from the bytecode itself is the reference's code, which the reference check recognises by
    its shape (course.grading.plugin).

    Each file is compiled under its own final path, so a function's `co_filename` equals its
    module's `__file__`, as it does with source (mini_vllm.worker.model_runner relies on it).

    A module of Triton kernels keeps its source: Triton compiles (and interprets) a kernel from
    its source text. A submitted piece that is the reference's object is still caught
    (course.grading.plugin's reference check reads a kernel's function too), and a copy of its
    source by the similarity comparison."""
    tree = tree.resolve()
    sources = [*(tree / "mini_vllm").rglob("*.py"), *tree.glob("phase-*/labs/lab-*/solution.py")]
    for src in sources:
        if TRITON_IMPORT.search(src.read_text(encoding="utf-8")):
            continue
        compiled = src.with_suffix(".pyc")
        py_compile.compile(str(src), cfile=str(compiled), dfile=str(compiled), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        src.unlink()


class Instructor:
    """The instructor's checkout, snapshotted, and the manifest of graded tests."""

    def __init__(self, labs: list[Lab], staging: Path, root: Path = REPO_ROOT):
        self.labs = labs
        self.root = root
        self.snapshot = staging / "course"
        self.snapshot.mkdir()
        for part in TREE_PARTS:
            src = root / part
            if src.is_dir():
                shutil.copytree(src, self.snapshot / part, ignore=copy_ignore)
            elif src.is_file():
                shutil.copy2(src, self.snapshot / part)
        for lab in labs:
            shutil.copytree(lab.path, self.snapshot / lab.rel, ignore=copy_ignore)
        self.revision, self.dirty = git_state(root)
        self.manifest = collect_manifest(self.snapshot, labs)
        self.specs = {lab.id: self._spec(lab) for lab in labs}

    def _spec(self, lab: Lab) -> dict:
        source = (lab.path / "starter.py").read_text(encoding="utf-8")
        return {
            "tasks": published_tasks(source),
            "published_source": source,
            "reference_check": True,
            "student_files": student_files(lab),
        }


def git_state(root: Path) -> tuple[str, bool]:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=60
        ).stdout.strip()

    try:
        return git("rev-parse", "HEAD") or "unknown", bool(git("status", "--porcelain"))
    except Exception:
        return "unknown", False


def collect_manifest(snapshot: Path, labs: list[Lab]) -> dict[str, list[dict]]:
    """Every test of every lab, collected in the snapshot with the reference solution."""
    out = snapshot.parent / "manifest.json"
    files = [f"{lab.rel}/test_lab.py" for lab in labs]
    env = dict(os.environ, LAB_IMPL="solution", PYTHONPATH=str(snapshot), OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "--collect-only", "-q", *SESSION_PLUGINS,
         f"--course-manifest={out}"],
        cwd=snapshot, env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0 or not out.is_file():
        raise GradingError(
            "collecting the graded tests in the instructor's checkout failed "
            f"(pytest exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    by_lab: dict[str, list[dict]] = {lab.id: [] for lab in labs}
    for t in json.loads(out.read_text())["tests"]:
        by_lab.setdefault(t["lab"], []).append(t)
    return by_lab


class GradingError(Exception):
    """Grading itself broke (not the student's code)."""


# --- the student's side -------------------------------------------------------------------------


@dataclass
class Submission:
    name: str
    path: Path
    commit: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # "lab rel/starter.py" -> content
    flags: list[str] = field(default_factory=list)
    lab_flags: dict[str, list[str]] = field(default_factory=dict)
    login: str = ""  # the LMS login, from the roster
    missing: str | None = None  # why there is nothing to grade (a clone that failed)
    broken: dict[str, str] = field(default_factory=dict)  # lab id -> why it cannot import
    zeroed: dict[str, str] = field(default_factory=dict)  # lab id -> the similarity finding

    def flag(self, lab_id: str | None, text: str) -> None:
        if lab_id is None:
            self.flags.append(text)
        else:
            self.lab_flags.setdefault(lab_id, []).append(text)


def read_commit(path: Path) -> str | None:
    """HEAD of a git checkout, read from its files (no git command runs in a student's repo)."""
    git = path / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            target = git.read_text().strip().removeprefix("gitdir:").strip()
            git = (path / target).resolve()
        head = (git / "HEAD").read_text().strip()
        bases = [git]
        if (git / "commondir").is_file():
            bases.append((git / (git / "commondir").read_text().strip()).resolve())
        if head.startswith("ref:"):
            ref, head = head[4:].strip(), ""
            for base in bases:
                if (base / ref).is_file():
                    head = (base / ref).read_text().strip()
                    break
                packed = base / "packed-refs"
                if packed.is_file():
                    for line in packed.read_text().splitlines():
                        if line.endswith(" " + ref):
                            head = line.split()[0]
                if head:
                    break
        return head if re.fullmatch(r"[0-9a-f]{40}", head) else None
    except OSError:
        return None


def _read_no_links(root: Path, rel: str) -> tuple[bytes | None, str | None]:
    """The bytes of root/rel, refusing any symbolic link on the way; (None, why) otherwise."""
    current = root
    for part in Path(rel).parts:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None, None
        if stat.S_ISLNK(st.st_mode):
            return None, f"{current.relative_to(root)} is a symbolic link; not graded"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{rel}: not a regular file; not graded"
    if st.st_size > MAX_FILE_BYTES:
        return None, f"{rel}: larger than {MAX_FILE_BYTES} bytes; not graded"
    fd = os.open(current, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return os.read(fd, MAX_FILE_BYTES + 1), None
    finally:
        os.close(fd)


def intake(path: Path, labs: list[Lab], name: str | None = None) -> Submission:
    """Read a submission's starter files (only those; nothing else of a fork is used)."""
    sub = Submission(name or safe_name(path.name), path, read_commit(path))
    for lab in labs:
        allowed = student_files(lab)
        for fname in STUDENT_FILES:
            rel = f"{lab.rel}/{fname}"
            data, why = _read_no_links(path, rel)
            if why:
                sub.flag(lab.id, why)
                continue
            if data is None:
                continue
            published = (lab.path / fname).read_bytes()
            if fname not in allowed:
                if data != published:
                    sub.flag(lab.id, f"{fname}: nothing to write in this file; the published one "
                             "is graded instead")
                continue
            if data != published:
                sub.files[rel] = data
                changed = changed_given(lab.id, data.decode("utf-8", "replace")) if (
                    fname == "starter.py") else []
                if changed:  # a flag only: the tests decide the points
                    sub.flag(lab.id, f"given code changed: {', '.join(changed)} (python -m "
                             f"course upgrade {lab.id} carries the work onto the published one)")
    return sub


def static_check(sub: Submission, labs: list[Lab]) -> None:
    """A starter.py that does not parse cannot import: found here, in milliseconds, so that its
    lab scores 0 in every test (none of them runs) with the error and its line."""
    for lab in labs:
        rel = f"{lab.rel}/starter.py"
        if rel not in sub.files:
            continue
        try:
            ast.parse(sub.files[rel], filename=rel)
        except SyntaxError as exc:
            sub.broken[lab.id] = (f"{type(exc).__name__}: {exc.msg} (starter.py line "
                                  f"{exc.lineno})")
        except ValueError as exc:  # null bytes
            sub.broken[lab.id] = f"starter.py cannot be read as Python: {exc}"


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "student"


# --- static scan: code that reaches for the grader ----------------------------------------------

_SUSPICIOUS_MODULES = {
    "pytest", "_pytest", "pluggy", "atexit", "signal", "ctypes", "gc", "inspect", "subprocess",
    "socket", "multiprocessing", "importlib", "builtins", "site", "sitecustomize", "course",
    "shutil", "sys", "resource", "pty", "mmap",
}
_SUSPICIOUS_ATTRS = {
    ("os", "_exit"), ("os", "fork"), ("os", "setsid"), ("os", "system"), ("os", "environ"),
    ("os", "putenv"), ("os", "kill"), ("os", "killpg"), ("os", "execv"), ("os", "execve"),
    ("os", "popen"), ("os", "write"), ("os", "dup2"), ("sys", "exit"), ("sys", "modules"),
    ("sys", "_getframe"), ("sys", "settrace"), ("sys", "setprofile"), ("sys", "path"),
}
_SUSPICIOUS_NAMES = {"__import__", "exec", "eval", "compile", "exit", "quit", "globals",
                     "__builtins__", "breakpoint"}


def suspicious(source: bytes, filename: str) -> set[str]:
    """What in a Python file reaches beyond the lab: process control, the test machinery, the
    environment, dynamic code. Names only, for an instructor to read; nothing is scored."""
    if not filename.endswith(".py"):
        return {f"#include {m}" for m in re.findall(rb'#\s*include\s*[<"]([^>"]+)', source)
                for m in [m.decode(errors="replace")]}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] in _SUSPICIOUS_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _SUSPICIOUS_MODULES or node.module == "os":
                found |= {f"from {node.module} import {a.name}" for a in node.names
                          if node.module != "os" or ("os", a.name) in _SUSPICIOUS_ATTRS}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in _SUSPICIOUS_ATTRS:
                found.add(f"{node.value.id}.{node.attr}")
            if node.attr.startswith("__") and node.attr in ("__code__", "__globals__"):
                found.add(f".{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _SUSPICIOUS_NAMES:
            found.add(f"{node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for needle in ("conftest", ".pth", "grades", "/proc/", "LAB_IMPL", "COURSE_"):
                if needle in node.value:
                    found.add(f"string mentioning {needle!r}")
    return found


# --- graded units -------------------------------------------------------------------------------


@dataclass
class TestScore:
    id: str
    tier: str
    outcome: str  # passed failed not_implemented skipped timed_out crashed exited not_run
    points: float
    max_points: float
    message: str = ""
    kind: str = ""
    detail: str = ""
    seconds: float = 0.0


@dataclass
class UnitResult:
    id: str
    title: str
    kind: str
    folder: str = ""
    status: str = ""
    max_points: dict[str, float] = field(default_factory=dict)
    tests: list[TestScore] = field(default_factory=list)
    uses_reference: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # grading itself broke
    log: str = ""
    reason: str = ""  # why the status, in one line (the error of a lab that does not import)
    peak_memory: int | None = None  # bytes, where the sandbox's memory limit can tell
    notes: list[str] = field(default_factory=list)  # e.g. the exam's composition

    def points(self, tier: str) -> float:
        if self.uses_reference:
            return 0.0
        return round(sum(t.points for t in self.tests if t.tier == tier), 6)

    def count(self, *outcomes: str) -> int:
        return sum(t.outcome in outcomes for t in self.tests)


@dataclass
class RunContext:
    instructor: Instructor
    iso: sandbox.Isolation
    work: Path  # where workspaces go
    hide: list[Path]
    impl: str = "starter"
    test_timeout: float = 60.0
    lab_timeout: float = 900.0
    kill_grace: float = 5.0
    skip_untouched: bool = True
    only_tests: tuple[str, ...] = ()


def lab_session(snapshot: Path, lab: Lab, files: dict[str, bytes], spec: dict, *, impl: str,
                iso: sandbox.Isolation, work: Path, hide: list[Path], test_timeout: float,
                lab_timeout: float, only_tests: tuple[str, ...] = ()) -> sandbox.SessionRun:
    """One grading session of `lab`: a workspace holding the course of `snapshot` (its tooling,
    mini_vllm, the lab) with `files` (the student's, by path) written over it, sealed, and the
    lab's tests run there in the sandbox with the grading plugin (`spec`: what it checks)."""
    ws = sandbox.Workspace(work, iso)
    try:
        for part in TREE_PARTS:
            src = snapshot / part
            if src.is_dir():
                shutil.copytree(src, ws.tree / part, ignore=copy_ignore)
            elif src.is_file():
                ws.tree.mkdir(exist_ok=True)
                shutil.copy2(src, ws.tree / part)
        shutil.copytree(snapshot / lab.rel, ws.tree / lab.rel, ignore=copy_ignore)
        if impl == "starter":  # graded against the reference itself, it stays
            hide_reference_source(ws.tree)
        for rel, data in files.items():
            (ws.tree / rel).write_bytes(data)
        spec_path = ws.root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        ws.seal()
        os.chmod(spec_path, 0o444)
        tests = [f"{lab.rel}/test_lab.py::{t}" for t in only_tests] or [f"{lab.rel}/test_lab.py"]
        argv = [
            sandbox.python(), "-m", "pytest", *tests, "-q", "-s", "--no-header",
            *SESSION_PLUGINS, "--course-channel={channel}", f"--course-spec={spec_path}",
            f"--timeout={test_timeout:g}",
        ]
        # COURSE_STUDENT_PROCESS: labs marked `student_process` in labs.toml run the student's
        # code in a process of its own, apart from each test's verdict.
        env = sandbox.minimal_env(ws, {"LAB_IMPL": impl, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                       "COURSE_STUDENT_PROCESS": "1"})
        return sandbox.run_session(argv, ws, env, lab_timeout, hide)
    finally:
        ws.remove()


class LabUnit:
    kind = "lab"

    def __init__(self, lab: Lab, manifest: list[dict]):
        self.lab = lab
        self.id, self.title = lab.id, lab.title
        self.graded = [t for t in manifest if not t["starter_ok"]]
        weights = {tier: sum(t["weight"] for t in self.graded if t["tier"] == tier)
                   for tier in TIERS}
        # The lab's weight is its maximum in every tier it has tests in, shared by mark weight.
        self.max_points = {tier: float(lab.points) for tier in TIERS if weights[tier] > 0}
        self.test_max = {
            t["nodeid"]: lab.points * t["weight"] / weights[t["tier"]] for t in self.graded
        }

    def run(self, ctx: RunContext, sub: Submission) -> UnitResult:
        lab = self.lab
        result = UnitResult(self.id, self.title, self.kind, lab.rel, max_points=self.max_points)
        result.flags.extend(sub.lab_flags.get(lab.id, []))
        if sub.missing:
            return self._without_run(result, "not_run", f"not run: {sub.missing}",
                                     "not submitted", sub.missing)
        if ctx.skip_untouched and not any(r.startswith(lab.rel + "/") for r in sub.files):
            # The published starter fails every graded test (`course check` proves it): no need
            # to run it to know that the lab scores 0.
            return self._without_run(
                result, "not_implemented",
                "not started: the submission leaves this lab's starter as published",
                "not started", "")
        if lab.id in sub.broken:
            why = sub.broken[lab.id]
            return self._without_run(result, "failed", f"does not import: {why}",
                                     "does not import", why)
        if lab.id in sub.zeroed:
            why = sub.zeroed[lab.id]
            return self._without_run(result, "not_run", f"not run: {why}", "similarity", why)
        spec = dict(ctx.instructor.specs[lab.id], test_timeout=ctx.test_timeout,
                    kill_grace=ctx.kill_grace)
        files = {rel: data for rel, data in sub.files.items() if rel.startswith(lab.rel + "/")}
        run = lab_session(ctx.instructor.snapshot, lab, files, spec, impl=ctx.impl, iso=ctx.iso,
                          work=ctx.work, hide=ctx.hide, test_timeout=ctx.test_timeout,
                          lab_timeout=ctx.lab_timeout, only_tests=ctx.only_tests)
        result.seconds = run.seconds
        result.log = run.log_tail
        result.peak_memory = run.peak_memory_bytes
        self._score(result, run, ctx)
        return result

    def _without_run(self, result: UnitResult, outcome: str, message: str, status: str,
                     reason: str) -> UnitResult:
        """Every graded test scores 0 for one reason known before anything runs (0 s)."""
        for t in self.graded:
            result.tests.append(TestScore(t["nodeid"], t["tier"], outcome, 0.0,
                                          self.test_max[t["nodeid"]], message))
        result.status, result.reason = status, reason
        return result

    def _score(self, result: UnitResult, run: sandbox.SessionRun, ctx: RunContext) -> None:
        seen: dict[str, dict] = {}
        started = collect_error = False
        reference = None
        for msg in run.messages:
            kind = msg.get("type")
            if kind == "start":
                started = True
            elif kind == "collect_error":
                collect_error = True
            elif kind == "reference":
                reference = msg
            elif kind == "test" and msg.get("nodeid") in self.test_max:
                seen.setdefault(msg["nodeid"], msg)  # the first report of a test counts
        finished = any(m.get("type") == "done" for m in run.messages)
        if run.timed_out:
            why = f"not run: the lab's time budget ({ctx.lab_timeout:g} s) ran out"
        elif collect_error:
            why = "not run: the test file did not collect"
        elif not finished:
            why = "not run: the grading session ended early"
        elif reference is not None and reference.get("findings"):
            why = "not run: the starter uses the reference's code (see the flags)"
        else:
            why = "not run"
        for t in self.graded:
            msg = seen.get(t["nodeid"])
            maximum = self.test_max[t["nodeid"]]
            if msg is None:
                result.tests.append(TestScore(t["nodeid"], t["tier"], "not_run", 0.0, maximum,
                                              why))
                continue
            outcome = msg.get("outcome", "crashed")
            message = str(msg.get("message", ""))
            if outcome == "skipped":
                message = f"not run: {message}"
            result.tests.append(TestScore(
                t["nodeid"], t["tier"], outcome, maximum if outcome == "passed" else 0.0,
                maximum, message, str(msg.get("kind", "")), str(msg.get("detail", "")),
                float(msg.get("duration", 0.0) or 0.0),
            ))
        if reference is not None:
            if reference.get("findings"):
                result.uses_reference = [str(f) for f in reference["findings"]][:20]
            elif reference.get("error"):
                # The student's module did not load: no test passes without it, whatever a test
                # that never reaches it (a state machine's setup) says.
                why = str(reference["error"]).strip().splitlines()[0][:300]
                result.tests = [TestScore(t.id, t.tier, "failed", 0.0, t.max_points,
                                          f"does not import: {why}", "import")
                                for t in result.tests]
                result.status, result.reason = "does not import", why
                return
            elif "findings" not in reference and ctx.impl == "starter":
                result.flags.append(
                    f"reference check did not finish: {reference.get('message', '')[:200]}")
        if run.memory_limit_hit:
            # Under a cgroup the kernel kills the test that went over: it shows as crashed.
            limit = ctx.iso.limits.memory_bytes / 2**30
            for t in result.tests:
                if t.outcome == "crashed" or sandbox.looks_like_memory_error(t.message + t.detail):
                    t.message = f"stopped at the memory limit ({limit:g} GiB): {t.message}"
        if not started and not run.timed_out:
            result.error = ("the grading session did not start (a problem of the grader, not of "
                            f"the submission):\n{run.log_tail[-2000:]}")
        result.status, result.reason = _status(result, run)


# Every status a unit can have, the same word in grades.txt, grades.csv, summary.md, the JUnit
# files and the live log. "timed out" carries its count: "timed out (3 tests)". (`status_word`
# gives the word.)
STATUSES = ("not started", "does not import", "crashed", "timed out", "memory limit",
            "uses the reference", "tampered", "similarity", "in progress", "done",
            "not submitted", "not run here", "error")


def status_word(status: str) -> str:
    """The status without its count ("timed out (3 tests)" -> "timed out")."""
    return status.split(" (", 1)[0]


def _status(r: UnitResult, run: sandbox.SessionRun) -> tuple[str, str]:
    """(status, reason): what went wrong first, in the order an instructor would look."""
    if r.error:
        return "error", r.error.splitlines()[0]
    if r.uses_reference:
        return "uses the reference", "; ".join(r.uses_reference)
    from course.grading.reports import tampered_reason

    caught = tampered_reason(r)
    if caught:
        return "tampered", caught
    ran = [t for t in r.tests if t.outcome != "skipped"]
    failed = [t for t in ran if t.outcome != "passed"]
    passed = len(ran) - len(failed)
    hogs = [t for t in failed if sandbox.looks_like_memory_error(t.message)]
    if run.memory_limit_hit or hogs:
        where = f" ({hogs[0].id.split('::', 1)[-1]}: {hogs[0].message[:120]})" if hogs else ""
        return "memory limit", f"the lab's memory limit was reached{where}"
    timed = [t for t in ran if t.outcome == "timed_out" or t.kind == "timeout"
             or (run.timed_out and t.outcome == "not_run")]
    if run.timed_out or timed:
        n = len(timed)
        return f"timed out ({n} test{'s' * (n != 1)})", (
            "the lab's time budget ran out" if run.timed_out else
            f"{timed[0].id.split('::', 1)[-1]} overran its time limit")
    if not ran:
        return "not run here", "no graded test runs on this machine"
    if passed == len(ran):
        return "done", ""
    if passed:
        return "in progress", ""
    crashes = [t for t in failed if t.outcome in ("crashed", "exited")
               or t.kind in ("error", "exit", "import")]
    if crashes:
        return "crashed", crashes[0].message.splitlines()[0][:200] if crashes[0].message else (
            crashes[0].outcome)
    if all(t.outcome == "not_implemented" for t in failed):
        return "not started", ""
    return "in progress", ""


class CommandUnit:
    """A graded unit run as a child command in the sandbox, e.g. the engine exam:
    `argv` ("{python}", "{impl}", "{channel}" and "{json}" substituted) runs in a full course
    copy holding all of the submission's files and reports its cases ({"case" or "id",
    "outcome", "message"}; a list, or a report with a "cases" list): as a JSON line on the
    descriptor substituted for "{channel}" (a report with "cases"), else in the file at the
    path substituted for "{json}". `cases` (the instructor's list, fixed before anything runs)
    share `points` equally; a case that is missing from the report scores 0. The engine exam
    reports on the channel from a process that runs no student code (its engines run in
    processes that hold no descriptor of it); a "{json}" file can be written by any process of
    the sandbox: trust it as much as the command's own isolation (see the README).

    `follows` names the labs whose code the command runs: it runs after them, with only those
    of them that are the student's own work (see `own_work`), and not at all when there is
    none."""

    kind = "command"

    def __init__(self, unit_id: str, title: str, points: float, argv: list[str],
                 cases: list[str], tier: str = "cpu", follows: tuple[str, ...] = ()):
        self.id, self.title, self.argv, self.cases, self.tier = unit_id, title, argv, cases, tier
        self.max_points = {tier: float(points)}
        self.per_case = float(points) / max(1, len(cases))
        self.follows = follows

    def skip(self, why: str) -> UnitResult:
        """0 points in every case, in 0 s, with the reason."""
        result = UnitResult(self.id, self.title, self.kind, max_points=self.max_points,
                            status="not started", reason=why)
        result.tests = [TestScore(case, self.tier, "not_run", 0.0, self.per_case,
                                  f"not run: {why}") for case in self.cases]
        return result

    def run(self, ctx: RunContext, sub: Submission) -> UnitResult:
        result = UnitResult(self.id, self.title, self.kind, max_points=self.max_points)
        ws = sandbox.Workspace(ctx.work, ctx.iso)
        try:
            shutil.copytree(ctx.instructor.snapshot, ws.tree)
            if ctx.impl == "starter":  # graded against the reference itself, it stays
                hide_reference_source(ws.tree)
            for rel, data in sub.files.items():
                (ws.tree / rel).write_bytes(data)
            ws.seal()
            out = ws.out / "cases.json"
            argv = [a.replace("{json}", str(out)).replace("{python}", sandbox.python())
                    .replace("{impl}", ctx.impl) for a in self.argv]
            env = sandbox.minimal_env(ws, {"LAB_IMPL": ctx.impl})
            run = sandbox.run_session(argv, ws, env, ctx.lab_timeout, ctx.hide)
            try:
                if any("{channel}" in a for a in self.argv):
                    reports = [m for m in run.messages if isinstance(m.get("cases"), list)]
                    data = reports[-1] if reports else {}
                else:
                    data = json.loads(out.read_text())
                listed = data.get("cases", []) if isinstance(data, dict) else data
                reported = {str(c.get("case", c.get("id"))): c for c in listed
                            if isinstance(c, dict)}
            except (OSError, ValueError, AttributeError, TypeError):
                reported = {}
        finally:
            ws.remove()
        result.seconds, result.log = run.seconds, run.log_tail
        for case in self.cases:
            c = reported.get(case)
            outcome = str(c.get("outcome", "failed")) if c else "not_run"
            message = str(c.get("message", ""))[:2000] if c else (
                "not run: the time budget ran out" if run.timed_out else "not run: no result")
            result.tests.append(TestScore(case, self.tier, outcome,
                                          self.per_case if outcome == "passed" else 0.0,
                                          self.per_case, message))
        result.status, result.reason = _status(result, run)
        return result


def own_work(unit: CommandUnit, sub: Submission, results: dict[str, UnitResult]
             ) -> tuple[Submission, list[str]]:
    """What `unit` (the exam) may run of `sub`: the files of the labs it follows that the student
    wrote and that scored as their own (not zeroed as the reference, for similarity, or for not
    importing); every other lab is the published starter there. Returns the submission to run
    and the composition, one line per lab, for the report."""
    keep: dict[str, bytes] = {}
    notes = []
    for lab_id in unit.follows:
        r = results.get(lab_id)
        files = {rel: data for rel, data in sub.files.items()
                 if r is not None and rel.startswith(r.folder + "/")}
        if r is None or not files:
            notes.append(f"{lab_id}: the published starter (not written)")
        elif r.status in ("uses the reference", "similarity", "does not import"):
            notes.append(f"{lab_id}: the published starter ({r.status} in the lab)")
        else:
            keep.update(files)
            notes.append(f"{lab_id}: yours ({r.status} in the lab)")
    return replace(sub, files=keep), notes


def graded_units(instructor: Instructor) -> list:
    """Every graded unit, in course order: the labs, then the engine exam when every engine lab
    is graded (it composes all of the submission's engine pieces, `--labs all`, so a lab left
    unwritten fails its cases; the case list and the points are the instructor's)."""
    from course.engine.compose import GPU_ONLY_LABS, engine_labs
    from course.engine.exam import GRADED_SWEEP, cases
    from course.labs.catalog import exam_metadata

    units: list = [LabUnit(lab, instructor.manifest.get(lab.id, [])) for lab in instructor.labs]
    graded = {lab.id for lab in instructor.labs}
    needed = {lab.id for lab in engine_labs() if lab.id not in GPU_ONLY_LABS}
    exam = exam_metadata()
    if exam.get("command"):
        # A course of its own defines its exam in labs.toml (the grading fixture's does).
        follows = tuple(exam.get("follows", ()))
        if set(follows) <= graded:
            units.append(CommandUnit("exam", exam.get("title", "The exam"), exam["points"],
                                     list(exam["command"]), list(exam["cases"]),
                                     follows=follows))
    elif exam and needed <= graded:
        units.append(CommandUnit(
            "engine-exam", "The engine exam: your pieces together", exam["points"],
            # Bisecting only the first failing case: the results are written once the command
            # ends, so a bisection of every case that ran past the time limit would cost the
            # student the cases already passed.
            ["{python}", "-m", "course", "engine", "--exam", "--impl", "{impl}", "--labs", "all",
             "--bisect", "first", "--channel", "{channel}"],
            [c.name for c in cases(GRADED_SWEEP)],
            follows=tuple(lab.id for lab in instructor.labs if lab.id in needed),
        ))
    return units


# --- a whole grading run ------------------------------------------------------------------------


@dataclass
class Options:
    out: Path
    jobs: int = 2
    impl: str = "starter"
    test_timeout: float = 60.0
    lab_timeout: float = 900.0
    similarity: bool = True
    reference_zero: float = 0.9
    memory_limit: int = sandbox.Limits().memory_bytes  # bytes per grading session
    allow_weak_isolation: bool = False
    shard: tuple[int, int] | None = None  # (i, n), 1-based: grade only shard i of n
    regrade: bool = False  # grade again students whose complete grades.json is up to date
    only_tests: tuple[str, ...] = ()  # run only these tests (ids within test_lab.py)


def _gpu_ran(manifest: dict[str, list[dict]]) -> bool | None:
    """Whether this grader runs the GPU tier (None: the course has no GPU tests)."""
    gpu = [t for tests in manifest.values() for t in tests if t["tier"] == "gpu"]
    return any(t["skip"] is None for t in gpu) if gpu else None


def files_digest(sub: Submission) -> str:
    h = hashlib.sha256()
    for rel in sorted(sub.files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(sub.files[rel]).digest())
    return h.hexdigest()


def _up_to_date(folder: Path, sub: Submission, meta: dict) -> dict | None:
    """A complete grades.json of this submission (same files) by this course revision, or None."""
    import course.grading.reports as reports

    try:
        old = json.loads((folder / "grades.json").read_text())
    except (OSError, ValueError):
        return None
    same = (old.get("files_digest") == files_digest(sub) and not meta["course_dirty"]
            and old.get("course_revision") == meta["course_revision"]
            and old.get("impl") == meta["impl"] and old.get("not_submitted") == sub.missing)
    return old if same and reports.complete(old) else None


def grade(paths: list[tuple[str | None, Path]], labs: list[Lab], opts: Options,
          class_mode: bool, log=print, missing: dict[str, str] | None = None,
          logins: dict[str, str] | None = None) -> int:
    """Grade every submission in `paths` ((name or None, folder)) on every lab; `missing` adds a
    row for each student with nothing to grade ({name: why}). A student's reports are written as
    each unit finishes and the class files as each student finishes; a student whose complete
    grades.json is up to date is not graded again (unless opts.regrade). Returns 0, or 2 when
    grading itself broke somewhere."""
    import course.grading.reports as reports
    from course.grading.similarity import class_similarity

    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    # Below the full sandbox, students' processes run as this user: they must not open this
    # process's descriptors (the sessions' channels) through /proc, nor trace it.
    from course.labs.student_process import not_dumpable

    not_dumpable()
    iso = sandbox.probe(sandbox.Limits(memory_bytes=opts.memory_limit))
    try:
        sandbox.require(iso, opts.allow_weak_isolation)
    except sandbox.IsolationError as exc:
        raise GradingError(str(exc)) from None
    staging = Path(tempfile.mkdtemp(prefix="course-grade-"))
    os.chmod(staging, 0o711)
    work = staging / "work"
    work.mkdir(mode=0o711)
    started = time.monotonic()
    try:
        instructor = Instructor(labs, staging)
        units = graded_units(instructor)
        subs = [intake(p, labs, name) for name, p in paths]
        subs += [Submission(name, Path(), missing=why) for name, why in (missing or {}).items()]
        _dedupe_names(subs)
        for sub in subs:
            sub.login = (logins or {}).get(sub.name, "")
        if opts.shard:
            i, n = opts.shard
            subs = [s for s in subs if shard_of(s.name, n) == i - 1]
        meta = {
            "course": "mini_vllm",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "course_revision": instructor.revision,
            "course_dirty": instructor.dirty,
            "python": platform.python_version(),
            "impl": opts.impl,
            "gpu": _gpu_ran(instructor.manifest),
            "isolation": iso.as_dict(),
            "test_timeout_s": opts.test_timeout,
            "lab_timeout_s": opts.lab_timeout,
            "shard": f"{opts.shard[0]}/{opts.shard[1]}" if opts.shard else None,
            "class_mode": class_mode,
            "units": reports.unit_list(units),
        }
        if instructor.dirty:
            log(f"warning: the course checkout has uncommitted changes (revision "
                f"{instructor.revision[:12]}); grades depend on them")
        if iso.level != "namespaces+nobody":
            log(f"warning: isolation is {iso.level!r}: " + "; ".join(iso.notes))
        for sub in subs:
            _review(sub, labs, instructor.root)
            static_check(sub, labs)
            if opts.similarity and opts.impl == "starter" and sub.files:
                # Against the reference only: decided per student, before anything runs, so that
                # the live log never shows a score that a later step takes back.
                sim = class_similarity({sub.name: sub.files}, labs, instructor.root,
                                       zero=opts.reference_zero, peers=False)
                for lab_id, note in sim.flags.get(sub.name, []):
                    sub.flag(lab_id, note)
                for lab_id in sim.zero.get(sub.name, ()):
                    sub.zeroed[lab_id] = next(n for i, n in sim.flags[sub.name] if i == lab_id)
        # The sandbox hides these whole, or all but the paths it keeps (the workspaces, the
        # Python environment) where they hold one.
        hide = [out, instructor.root, *{p.resolve() for _, p in paths}, staging / "course"]
        if class_mode and paths:
            hide.append(Path(paths[0][1]).resolve().parent)
        in_place = any(p.resolve() == instructor.root for _, p in paths)
        ctx = RunContext(instructor, iso, work, hide, opts.impl, opts.test_timeout,
                         opts.lab_timeout, kill_grace=min(5.0, max(1.0, opts.test_timeout / 2)),
                         skip_untouched=opts.impl == "starter" and not in_place,
                         only_tests=opts.only_tests)

        def folder(sub: Submission) -> Path:
            return out / "students" / sub.name if class_mode else out

        finished: dict[str, dict] = {}  # student -> complete report
        todo = []
        for sub in subs:
            old = None if opts.regrade else _up_to_date(folder(sub), sub, meta)
            if old is not None:
                finished[sub.name] = old
                log(f"  {sub.name}: graded before (same files, same course revision); kept")
            else:
                todo.append(sub)
        results: dict[str, dict[str, UnitResult]] = {s.name: {} for s in todo}
        partial: dict[str, dict] = {}

        if class_mode:
            for sub in todo:
                _save_files(folder(sub), sub)

        def report_of(sub: Submission) -> dict:
            done = [results[sub.name][u.id] for u in units if u.id in results[sub.name]]
            report = reports.student_report(sub, done, units, meta)
            report["files_digest"] = files_digest(sub)
            return report

        def write_class() -> None:
            meta["seconds"] = round(time.monotonic() - started, 1)
            reports.write_class(out, [*finished.values(), *partial.values()], meta)

        labs_of = [u for u in units if u.kind == "lab"]
        after = [u for u in units if u.kind != "lab"]
        n_jobs = len(todo) * len(units)
        count = 0
        started_after: set[tuple[str, str]] = set()  # (student, unit) of the units that follow
        lock = threading.Lock()
        env_before = environment_files()
        with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
            pending = {pool.submit(u.run, ctx, s): (s, u) for s in todo for u in labs_of}
            while pending:
                done_now, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done_now:
                    sub, unit = pending.pop(fut)
                    try:
                        res = fut.result()
                    except Exception as exc:  # the grader's own fault: say so, keep going
                        res = UnitResult(unit.id, unit.title, unit.kind,
                                         max_points=unit.max_points, status="error",
                                         error=f"{type(exc).__name__}: {exc}")
                    with lock:
                        mine = results[sub.name]
                        mine[unit.id] = res
                        for path in sorted(environment_files() - env_before):
                            # Only possible below the full sandbox: undo it, and say who did it.
                            Path(path).unlink(missing_ok=True)
                            res.flags.append(f"wrote {path} into the grader's Python environment "
                                             "(removed)")
                            res.uses_reference.append("tampered with the grader's environment")
                            res.status = "uses the reference"
                        count += 1
                        caught = f": {res.reason}" if res.status == "tampered" else ""
                        log(f"  [{count}/{n_jobs}] {sub.name} {unit.id}: "
                            f"{res.points('cpu'):g}/{res.max_points.get('cpu', 0):g} "
                            f"{res.status} ({res.seconds:.0f} s){caught}")
                        # The units that follow labs start once those labs are scored.
                        for u in after:
                            if (sub.name, u.id) in started_after:
                                continue
                            if all(lab_id in mine for lab_id in u.follows):
                                started_after.add((sub.name, u.id))
                                if ctx.skip_untouched:
                                    run_sub, notes = own_work(u, sub, mine)
                                else:  # --impl solution, or a checkout graded in place
                                    run_sub, notes = sub, [f"every lab as graded ({ctx.impl})"]
                                if sub.missing or (ctx.skip_untouched and not run_sub.files):
                                    why = sub.missing or "no lab it composes is the student's " \
                                        "own work (see the notes)"
                                    skipped = u.skip(why)
                                    skipped.notes = notes
                                    pending[pool.submit(lambda r=skipped: r)] = (sub, u)
                                else:
                                    fut2 = pool.submit(_run_with_notes, u, ctx, run_sub, notes)
                                    pending[fut2] = (sub, u)
                        report = report_of(sub)
                        reports.write_student(folder(sub), report, [res])
                        if len(mine) == len(units):
                            finished[sub.name] = report
                            partial.pop(sub.name, None)
                        else:
                            partial[sub.name] = report
                        if class_mode:
                            write_class()
        similarity_csv = None
        if class_mode and opts.similarity and opts.impl == "starter":
            # A shard compares its own students; `--merge` compares the whole class again.
            similarity_csv = peer_review(out, finished, labs, instructor.root,
                                         opts.reference_zero)
        meta["seconds"] = round(time.monotonic() - started, 1)
        reports.write_class(out, list(finished.values()), meta, similarity_csv)
        broken = [(s.name, lab["id"], lab["error"]) for s in subs
                  for lab in finished[s.name]["labs"] if lab["error"]]
        for name, unit_id, error in broken:
            log(f"GRADING ERROR for {name}, {unit_id}: {error}")
        return 2 if broken else 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_files(folder: Path, sub: Submission) -> None:
    """The graded files, kept with the report: `--merge` compares the whole class from them."""
    shutil.rmtree(folder / "files", ignore_errors=True)
    for rel, data in sub.files.items():
        dest = folder / "files" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)


def peer_review(out: Path, finished: dict[str, dict], labs: list[Lab], root: Path,
                zero: float) -> str:
    """Compare the class with itself from the files kept under out/students/*/files: flags only,
    never a score (each report's "peer_flags"; grades.json and grades.txt rewritten). Returns
    similarity.csv's text."""
    import course.grading.reports as reports
    from course.grading.similarity import class_similarity

    files: dict[str, dict[str, bytes]] = {}
    for name in finished:
        base = out / "students" / name / "files"
        files[name] = {p.relative_to(base).as_posix(): p.read_bytes()
                       for p in sorted(base.rglob("*")) if p.is_file()} if base.is_dir() else {}
    sim = class_similarity(files, labs, root, zero=zero, peers=True)
    for name, report in finished.items():
        flags = [f"{lab_id}: {note}" for lab_id, note in sim.peer_flags.get(name, [])]
        if flags != report.get("peer_flags", []):
            report["peer_flags"] = flags
            reports.write_student(out / "students" / name, report)
    return sim.to_csv()


def _run_with_notes(unit, ctx: RunContext, sub: Submission, notes: list[str]) -> UnitResult:
    result = unit.run(ctx, sub)
    result.notes = notes
    return result


def _review(sub: Submission, labs: list[Lab], root: Path) -> None:
    """Flag what in a submitted file reaches for the grader (beyond what the published file
    already does)."""
    for rel, data in sub.files.items():
        found = suspicious(data, rel) - suspicious((root / rel).read_bytes(), rel)
        if found:
            lab_id = next(lab.id for lab in labs if rel.startswith(lab.rel + "/"))
            sub.flag(lab_id, f"review {Path(rel).name}: " + ", ".join(sorted(found)))


def merge(shard_outs: list[Path], out: Path, labs: list[Lab], log=print,
          similarity: bool = True, zero: float = 0.9) -> int:
    """The class files of a run graded in shards (or of a killed run), rebuilt from each
    student's grades.json: the shards' student folders are copied under out/students and
    grades.csv, gradebook.csv, summary.md and class.json written as one run writes them."""
    import course.grading.reports as reports

    found: dict[str, tuple[Path, dict]] = {}
    metas = []
    for d in shard_outs:
        if not (d / "class.json").is_file() and not (d / "students").is_dir():
            raise GradingError(f"{d} is not a grading output (no class.json, no students/): "
                               "pass the folders that `course grade --class ... --out` wrote")
        if (d / "class.json").is_file():
            metas.append(json.loads((d / "class.json").read_text()))
        for f in sorted((d / "students").glob("*/grades.json")):
            report = json.loads(f.read_text())
            name = report["student"]
            if name in found:
                raise GradingError(f"{name} was graded in two shards ({found[name][0].parent} "
                                   f"and {f.parent}): grade each shard with the same --shard N")
            found[name] = (f.parent, report)
    revisions = {m["course_revision"] for m in metas} | {r["course_revision"]
                                                          for _, r in found.values()}
    if len(revisions) > 1:
        raise GradingError(f"the shards were graded by different course revisions "
                           f"({', '.join(sorted(revisions))}): grade them again with one")
    if not found:
        raise GradingError("no student was graded in the given folders")
    meta = dict(metas[0]) if metas else {}
    for key in ("students", "complete", "shard"):
        meta.pop(key, None)
    meta["shard"] = None
    meta["merged_from"] = [str(d) for d in shard_outs]
    meta["seconds"] = round(sum(m.get("seconds", 0) for m in metas), 1)
    if "units" not in meta:
        meta["units"] = next(iter(found.values()))[1]["unit_list"]
    for name, (src, _) in found.items():
        dest = out / "students" / name
        if src.resolve() != dest.resolve():
            shutil.copytree(src, dest, dirs_exist_ok=True)
    finished = {name: report for name, (_, report) in found.items()}
    similarity_csv = None
    if similarity and meta.get("impl", "starter") == "starter":
        similarity_csv = peer_review(out, finished, labs, REPO_ROOT, zero)
    reports.write_class(out, list(finished.values()), meta, similarity_csv)
    missing = [name for name, r in finished.items() if not reports.complete(r)]
    if missing:
        log(f"warning: {len(missing)} student(s) not completely graded: {', '.join(missing)}")
    return 0


def environment_files() -> set[str]:
    """Files that Python runs at start-up from its site folders (.pth, sitecustomize)."""
    import site

    found = set()
    for d in {*site.getsitepackages(), site.getusersitepackages()}:
        for pattern in ("*.pth", "sitecustomize.py", "usercustomize.py"):
            found |= {str(p) for p in Path(d).glob(pattern)}
    return found


def _dedupe_names(subs: list[Submission]) -> None:
    seen: dict[str, int] = {}
    for s in subs:
        if s.name in seen:
            seen[s.name] += 1
            s.name = f"{s.name}-{seen[s.name]}"
        else:
            seen[s.name] = 1


def class_folders(class_dir: Path) -> list[tuple[str, Path]]:
    """One submission per sub-folder of `class_dir` (named after it), links not followed."""
    if not class_dir.is_dir():
        raise SystemExit(f"error: --class {class_dir} is not a folder")
    found = [
        (safe_name(p.name), p)
        for p in sorted(class_dir.iterdir())
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
    ]
    if not found and not (class_dir / ".roster.json").is_file():  # (course clone's record)
        raise SystemExit(f"error: --class {class_dir} holds no submission folders")
    return found
