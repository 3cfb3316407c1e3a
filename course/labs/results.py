"""Which labs a student has finished, remembered between runs.

The dashboard records each starter run's outcome here, keyed by the lab's files; ``course
engine`` and the notebooks' ``YOURS`` switch read it, so that an unchanged lab is not run again.
The cache lives outside the repository (``$XDG_CACHE_HOME/mini_vllm-course``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from course.labs.catalog import Lab
from course.labs.runner import run_labs
from course.labs.tasks import unfinished_tasks


def cache_dir() -> Path:
    """Where the course keeps what it may recompute (outside the repository)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mini_vllm-course"


def lab_key(lab: Lab) -> str:
    """The key a lab's remembered result is valid for: its starter and its tests."""
    digest = hashlib.sha256()
    for name in ("starter.py", "starter.cu", "test_lab.py"):
        path = lab.path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _load_status_cache() -> dict:
    try:
        return json.loads((cache_dir() / "lab-status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def record_lab_status(runs) -> None:
    """Remember which starters passed every graded test (the dashboard and this command)."""
    cache = _load_status_cache()
    for run in runs:
        if run.impl != "starter" or run.broken:
            continue
        cache[run.lab.id] = {"key": lab_key(run.lab), "done": run.status == "done",
                             "passed": run.passed, "total": run.total}
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        tmp = cache_dir() / "lab-status.json.tmp"
        tmp.write_text(json.dumps(cache, indent=1), encoding="utf-8")
        tmp.replace(cache_dir() / "lab-status.json")
    except OSError:
        pass  # a cache that cannot be written only costs time


def finished_labs(labs: list[Lab], jobs: int | None = None) -> dict[str, str]:
    """``{lab id: why it is not yours}`` for unfinished labs, ``""`` for finished ones."""
    status: dict[str, str] = {}
    cache = _load_status_cache()
    to_run = []
    for lab in labs:
        todo = unfinished_tasks(lab)
        if todo:
            task = todo[0].split(":")[0].split(", ", 1)[1]
            status[lab.id] = f"not finished: {task} unwritten"
            continue
        entry = cache.get(lab.id)
        if entry and entry.get("key") == lab_key(lab):
            status[lab.id] = "" if entry["done"] else (
                f"not finished: {entry['passed']}/{entry['total']} tests pass")
        else:
            to_run.append(lab)
    if to_run:
        print(f"Running the tests of {len(to_run)} lab(s) against your starter to see which are "
              "finished (cached afterwards) ...", file=sys.stderr)
        runs = run_labs(to_run, "starter", jobs)
        record_lab_status(runs)
        for run in runs:
            status[run.lab.id] = "" if run.status == "done" else (
                f"not finished: {run.passed}/{run.total} tests pass")
    return status
