"""Grading a submission against a pristine copy of the course.

A student's fork can change anything, tests included. `python -m course grade --submission DIR`
therefore grades in a temporary copy of *this* checkout (the instructor's: tests, tooling and
mini_vllm as published) with only the student's starter files laid over it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from course.integrity import copy_ignore
from course.labs import REPO_ROOT, Lab
from course.loader import load_module

STUDENT_FILES = ("starter.py", "starter.cu")


def overlay_submission(submission: Path, workdir: Path, labs: list[Lab]) -> tuple[Path, list[str]]:
    """Copy the course to `workdir` and lay the submission's starter files over it.

    Returns the graded tree and the files taken from the submission. A lab the submission lacks
    keeps the untouched starter (and so scores as not started).
    """
    if not submission.is_dir():
        raise SystemExit(f"error: --submission {submission} is not a folder")
    root = workdir / "graded"
    shutil.copytree(REPO_ROOT, root, ignore=copy_ignore)
    taken = []
    for lab in labs:
        for name in STUDENT_FILES:
            src = submission / lab.rel / name
            if src.is_file():
                shutil.copyfile(src, root / lab.rel / name)
                taken.append(f"{lab.rel}/{name}")
    return root, taken


def given_names(lab: Lab) -> list[str]:
    """Names the untouched starter takes from the reference on purpose (complete helpers).

    Read from this checkout's own starter.py, which must be the published one: pass the
    student's work with --submission.
    """
    starter = load_module(lab.path, "starter", lab.id)
    solution = load_module(lab.path, "solution", lab.id)
    return sorted(
        name
        for name in getattr(starter, "__all__", ())
        if getattr(starter, name, None) is getattr(solution, name, object())
    )
