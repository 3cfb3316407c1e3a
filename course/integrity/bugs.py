"""Planted bugs: known-wrong edits to the reference that a lab's tests must reject.

Each lab lists its bugs in `planted_bugs/PP-LL.py` (at the top of the repository, named by the
lab's id) as `BUGS = [PlantedBug(...)]`. They live there, not in the lab folder: they are the
instructors' and the tooling's, and they quote lines of the reference, which a student's folder
should not hand out. A bug is a textual edit (find exactly once, replace) to a file of the
repository, so it works the same for `mini_vllm` modules, a lab's own `solution.py` and CUDA
sources.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from course.labs.catalog import REPO_ROOT, Lab

# The tiers a bug can require: each is a pytest marker of the lab's tests. A bug that names one
# is checked by running only the tests with that marker, so "rejected" says which kind of test
# sees the mistake; where the machine cannot run that tier (its tests are all skipped), the bug
# is reported as not checked. No tier: any of the lab's tests.
TIERS = {
    "oracle": "kernels run and compared with a PyTorch oracle (on a GPU, else emulated on the CPU)",
    "asan": "kernels emulated on the CPU under AddressSanitizer and UBSan",
    "race": "kernels emulated on the CPU under ThreadSanitizer",
    "nvcc": "CUDA sources compiled by nvcc",
    "cuda": "a run on a CUDA GPU (what only a GPU shows)",
}


@dataclass(frozen=True)
class PlantedBug:
    name: str
    description: str
    file: str
    find: str
    replace: str
    requires: str | None = None  # a key of TIERS: the tests that must reject it
    # The edit is in code the lab gives (a reference-only kernel, a given launcher), not in a
    # task: no graded test can see it, since graded tests are those the untouched starter fails.
    # Such a bug counts as rejected by the lab's tests of its given code (marked starter_ok).
    given: bool = False

    def problems(self, root: Path = REPO_ROOT) -> list[str]:
        """Why this bug cannot be applied as written (empty when it can)."""
        path = root / self.file
        if not path.is_file():
            return [f"{self.name}: file {self.file} does not exist"]
        count = path.read_text(encoding="utf-8").count(self.find)
        if count != 1:
            return [f"{self.name}: `find` occurs {count} times in {self.file}; it must occur once"]
        if self.find == self.replace:
            return [f"{self.name}: `replace` equals `find`; the edit changes nothing"]
        if self.requires is not None and self.requires not in TIERS:
            return [f"{self.name}: requires={self.requires!r} is not a tier ({', '.join(TIERS)})"]
        return []

    def apply(self, root: Path) -> None:
        """Apply the edit to the copy of the repository at `root`."""
        path = root / self.file
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(self.find, self.replace, 1), encoding="utf-8")


BUGS_DIR = "planted_bugs"
# For each lab's planted bugs, the test that rejected it when `course check` last recorded them
# (`--write-seen-by`). `course check` runs that test first: a bug it rejects needs no other run.
# A stale entry costs time, never a verdict: the lab's tests then run as they would without it.
SEEN_BY = "seen_by.json"


def load_seen_by(root: Path = REPO_ROOT) -> dict[str, dict[str, str]]:
    """``{lab id: {bug name: test id in test_lab.py}}``; empty when there is no record."""
    try:
        data = json.loads((root / BUGS_DIR / SEEN_BY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_seen_by(seen: dict[str, dict[str, str]], root: Path = REPO_ROOT) -> Path:
    path = root / BUGS_DIR / SEEN_BY
    ordered = {lab: dict(sorted(bugs.items())) for lab, bugs in sorted(seen.items()) if bugs}
    path.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")
    return path


def bugs_path(lab: Lab) -> Path:
    """Where the lab's planted bugs live: planted_bugs/PP-LL.py in the lab's repository."""
    return lab.phase_dir.parent / BUGS_DIR / f"{lab.id}.py"


def load_bugs(lab: Lab) -> list[PlantedBug]:
    """The planted bugs of a lab (an empty list when it has no planted_bugs/PP-LL.py)."""
    path = bugs_path(lab)
    if not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location(f"course_bugs_{lab.id.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bugs = getattr(module, "BUGS", None)
    if not isinstance(bugs, list) or not all(isinstance(b, PlantedBug) for b in bugs):
        raise ValueError(f"{path}: BUGS must be a list of PlantedBug")
    return bugs
