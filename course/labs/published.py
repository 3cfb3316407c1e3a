"""The starter files as the course publishes them, by content: is a student's lab untouched?

``published_starters.json`` (beside this file) holds the SHA-256 of every lab's student files as
published. A lab whose student files all still have those digests has not been started, and
nothing needs to run to say so (its untouched starter fails every graded test: `course check`
proves that for every lab). ``tests/test_lab_results.py`` fails when the file no longer
matches the starters; after changing a starter, write it anew with

    python -m course.labs.published
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from course.labs.catalog import REPO_ROOT, Lab, discover

PUBLISHED_PATH = Path(__file__).resolve().parent / "published_starters.json"
# The files of a lab that are the student's: what grading takes from a submission.
STUDENT_FILES = ("starter.py", "starter.cu")


def student_digests(lab: Lab, root: Path | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of the lab's student files that exist (under ``root`` if given)."""
    folder = root / lab.rel if root else lab.path
    digests = {}
    for name in STUDENT_FILES:
        path = folder / name
        if path.is_file():
            digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def load_published(path: Path = PUBLISHED_PATH) -> dict[str, dict[str, str]]:
    """``{lab id: {file name: sha256}}``; empty when the file is missing or unreadable (then no
    lab counts as untouched, and every lab runs: slower, never wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_untouched(lab: Lab, published: dict[str, dict[str, str]] | None = None) -> bool:
    """True when every student file of ``lab`` is byte for byte the published one."""
    published = load_published() if published is None else published
    expected = published.get(lab.id)
    return bool(expected) and student_digests(lab) == expected


def stale_labs(labs: list[Lab], path: Path = PUBLISHED_PATH) -> list[str]:
    """Lab ids whose published digests differ from the starters in this checkout."""
    published = load_published(path)
    ids = {lab.id for lab in labs}
    stale = [lab.id for lab in labs if published.get(lab.id) != student_digests(lab)]
    return stale + sorted(set(published) - ids)


def write_published(labs: list[Lab], path: Path = PUBLISHED_PATH) -> None:
    data = {lab.id: student_digests(lab) for lab in labs}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    labs = discover(REPO_ROOT)
    write_published(labs)
    print(f"wrote {PUBLISHED_PATH.relative_to(REPO_ROOT)}: the student files of {len(labs)} labs")
