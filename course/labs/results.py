"""Lab results, remembered: a lab's tests run again only when something they depend on changed.

The dashboard and ``course engine`` (which labs are finished) ask for a lab's result through
:func:`lab_runs`. A lab is answered, cheapest first:

1. **untouched**: its student files are the published ones (:mod:`course.labs.published`), so it
   is "not started" and nothing runs;
2. **cached**: a run of the same lab, implementation and key was recorded here;
3. **ran**: its tests run now (:func:`course.labs.runner.run_labs`), and the result is recorded.

The key (:func:`result_key`) covers everything a result depends on: every file of the lab's folder
(the student's files, the tests, given files and data), the course's code (``mini_vllm/``,
``course/``, ``conftest.py``, ``pyproject.toml``, by content, so a student's own commits do not
invalidate it), and the environment (Python, torch and pytest versions, the kernel backend, a
visible GPU, the Hypothesis profile). A change to any of them runs the lab again
(``tests/test_lab_results.py`` proves it for each). Results live outside the repository, in
``$XDG_CACHE_HOME/mini_vllm-course/lab-results/``, one file per lab, implementation and checkout.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Collection
from functools import cache
from pathlib import Path

from course.labs.catalog import Lab
from course.labs.published import is_untouched, load_published
from course.labs.runner import LabRun, run_labs
from course.labs.tasks import open_tasks, unfinished_tasks

# The course's code a lab's tests run, besides the lab's own folder.
COURSE_PARTS = ("mini_vllm", "course", "conftest.py", "pyproject.toml")
# Environment variables that change what a lab's tests do or which of them run.
ENV_VARS = ("MINI_VLLM_KERNEL_BACKEND", "HYPOTHESIS_PROFILE", "CUDA_VISIBLE_DEVICES")
_SKIP = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis"}


def cache_dir() -> Path:
    """Where the course keeps what it may recompute (outside the repository)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mini_vllm-course"


def tree_digest(digest, base: Path, rel: str, read: Callable[[Path], bytes] = Path.read_bytes,
                skip: Collection[str] = ()) -> None:
    """Feed every file under ``base / rel`` (a file or a folder) to ``digest``, by name and
    content (``read(path)``: its bytes unless told), in a fixed order; files named in ``skip``,
    compiled files and caches are left out."""
    path = base / rel
    if path.is_file():
        digest.update(rel.encode() + b"\0" + read(path) + b"\0")
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        for name in sorted(files):
            if name.endswith((".pyc", ".pyo", ".so", ".o")) or name in skip:
                continue
            file = Path(root) / name
            digest.update(file.relative_to(base).as_posix().encode() + b"\0"
                          + read(file) + b"\0")


@cache
def course_digest(root: Path) -> str:
    """The course's code in the checkout at ``root``, by content."""
    digest = hashlib.sha256()
    for part in COURSE_PARTS:
        if (root / part).exists():
            tree_digest(digest, root, part)
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment() -> dict[str, str]:
    """What of the machine and the process a lab's results depend on (read without importing
    torch: a GPU counts as visible when its device nodes exist)."""
    env = {"python": sys.version.split()[0], "machine": platform.machine(),
           "torch": _version("torch"), "pytest": _version("pytest"),
           "hypothesis": _version("hypothesis"),
           "gpu": str(any(Path("/dev").glob("nvidia[0-9]*")))}
    env.update({name: os.environ.get(name, "") for name in ENV_VARS})
    return env


def result_key(lab: Lab, impl: str) -> str:
    """The key a recorded result of ``lab`` run against ``impl`` is valid for (module doc)."""
    root = lab.phase_dir.parent
    digest = hashlib.sha256(f"{lab.id}\0{impl}\0".encode())
    tree_digest(digest, lab.path, ".")
    digest.update(course_digest(root).encode())
    digest.update(json.dumps(environment(), sort_keys=True).encode())
    return digest.hexdigest()


def _record_path(lab: Lab, impl: str) -> Path:
    checkout = hashlib.sha256(str(lab.path.resolve()).encode()).hexdigest()[:10]
    return cache_dir() / "lab-results" / f"{lab.id}-{impl}-{checkout}.json"


def cached_run(lab: Lab, impl: str, key: str | None = None) -> LabRun | None:
    """The recorded run of ``lab`` against ``impl`` when its key still holds, else None."""
    try:
        data = json.loads(_record_path(lab, impl).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("key") != (key or result_key(lab, impl)):
        return None
    return LabRun(lab, impl, data["exit_code"], data["tests"], data.get("output", ""),
                  data.get("seconds", 0.0), origin="cached")


def record(run: LabRun, key: str | None = None) -> None:
    """Remember ``run`` (a broken run is not remembered: it says nothing about the code)."""
    if run.broken:
        return
    path = _record_path(run.lab, run.impl)
    data = {"key": key or result_key(run.lab, run.impl), "lab": run.lab.id, "impl": run.impl,
            "exit_code": run.exit_code, "tests": run.tests, "seconds": run.seconds,
            "output": run.output[-4000:]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written only costs time


def untouched_run(lab: Lab, impl: str) -> LabRun:
    """The result of a lab whose student files are the published ones, without running it."""
    tasks = open_tasks(lab)
    first = ""
    if tasks:
        t = tasks[0]
        what = f"write {t.names} in {t.file}" if t.file != "starter.py" else t.what
        first = f"task {t.number}: {what}"
    return LabRun(lab, impl, 0, [], "", 0.0, origin="untouched", first_task=first)


def lab_runs(labs: list[Lab], impl: str, jobs: int | None, *, use_cache: bool = True,
             log=None) -> list[LabRun]:
    """A result for every lab of ``labs``, in order: untouched, cached or run now (module doc).
    ``use_cache=False`` runs every lab that is not untouched, and records the new results."""
    published = load_published() if impl == "starter" else {}
    results: dict[str, LabRun] = {}
    keys: dict[str, str] = {}
    to_run = []
    for lab in labs:
        if impl == "starter" and is_untouched(lab, published):
            results[lab.id] = untouched_run(lab, impl)
            continue
        keys[lab.id] = result_key(lab, impl)
        cached = cached_run(lab, impl, keys[lab.id]) if use_cache else None
        if cached is not None:
            results[lab.id] = cached
        else:
            to_run.append(lab)
    if to_run:
        if log:
            log(f"Running the tests of {len(to_run)} lab(s) whose files, tests, course or "
                "environment changed since their last run ...")
        for run in run_labs(to_run, impl, jobs):
            record(run, keys[run.lab.id])
            results[run.lab.id] = run
    return [results[lab.id] for lab in labs]


def finished_labs(labs: list[Lab], jobs: int | None = None) -> dict[str, str]:
    """``{lab id: why it is not yours}`` for unfinished labs, ``""`` for finished ones: every
    task written and every graded test passing (a lab with a task unwritten is not run)."""
    status: dict[str, str] = {}
    complete = []
    for lab in labs:
        todo = unfinished_tasks(lab)
        if todo:
            task = todo[0].split(":")[0].split(", ", 1)[1]
            status[lab.id] = f"not finished: {task} unwritten"
        else:
            complete.append(lab)

    def log(message: str) -> None:
        print(message + " (to see which are finished)", file=sys.stderr)

    for run in lab_runs(complete, "starter", jobs, log=log):
        status[run.lab.id] = "" if run.status == "done" else (
            f"not finished: {run.passed}/{run.total} tests pass")
    return status
