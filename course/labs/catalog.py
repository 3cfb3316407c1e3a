"""Lab discovery: a lab is a folder `phase-PP-*/labs/lab-LL-*/` holding the four contract files."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
METADATA_PATH = Path(__file__).resolve().parent / "labs.toml"
LAB_FILES = ("README.md", "starter.py", "solution.py", "test_lab.py")
# What a copy of the course leaves out (grading snapshots, planted-bug copies, stand-ins).
copy_ignore = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "*.egg-info",
    "grades",
    ".ipynb_checkpoints",
    "results",
    ".whl",
    ".gl",
)
_PHASE_RE = re.compile(r"^phase-(\d\d)-[\w-]+$")
_LAB_RE = re.compile(r"^lab-(\d\d)-[\w-]+$")


@dataclass(frozen=True)
class Lab:
    """One lab folder. `id` is "PP-LL" (phase and lab numbers), e.g. "02-01"."""

    path: Path

    @property
    def phase_dir(self) -> Path:
        return self.path.parent.parent

    @property
    def phase(self) -> str:
        return _PHASE_RE.match(self.phase_dir.name).group(1)

    @property
    def number(self) -> str:
        return _LAB_RE.match(self.path.name).group(1)

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.number}"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def rel(self) -> str:
        return self.path.relative_to(REPO_ROOT).as_posix()

    @cached_property
    def title(self) -> str:
        """The README's first `# ` heading, without a leading "Lab PP-LL:" label."""
        readme = self.path / "README.md"
        if not readme.is_file():
            return self.name
        for line in readme.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                return re.sub(r"^Lab\s+\d\d-\d\d\s*[:—-]\s*", "", line[2:].strip())
        return self.name

    @property
    def test_file(self) -> Path:
        return self.path / "test_lab.py"

    def missing_files(self) -> list[str]:
        return [f for f in LAB_FILES if not (self.path / f).is_file()]

    @property
    def meta(self) -> dict:
        """This lab's table in course/labs/labs.toml (empty when it has none)."""
        return lab_metadata().get(self.id, {})

    @property
    def points(self) -> float:
        """The lab's weight in a grade (course/labs/labs.toml)."""
        return float(self.meta.get("points", 0))

    @property
    def engine_parts(self) -> tuple[str, ...]:
        """Names of the starter that the composed engine takes from the student."""
        return tuple(self.meta.get("engine", ()))


@cache
def _metadata(path: Path = METADATA_PATH) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the lab metadata: {exc}") from exc


def exam_metadata(path: Path = METADATA_PATH) -> dict:
    """The `[exam]` table of course/labs/labs.toml (the engine exam's grade weight), or {}."""
    exam = _metadata(path).get("exam", {})
    points = exam.get("points")
    if exam and (not isinstance(points, (int, float)) or isinstance(points, bool) or points <= 0):
        raise ValueError(f"{path}: [exam] points must be a positive number")
    return exam


@cache
def lab_metadata(path: Path = METADATA_PATH) -> dict[str, dict]:
    """course/labs/labs.toml as {lab id: table}; a malformed file is an error naming it."""
    data = _metadata(path)
    labs = data.get("lab", {})
    for lab_id, table in labs.items():
        points = table.get("points")
        if not isinstance(points, (int, float)) or isinstance(points, bool) or points <= 0:
            raise ValueError(f"{path}: lab {lab_id}: points must be a positive number")
        for key in ("engine", "notebook"):
            names = table.get(key, [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{path}: lab {lab_id}: {key} must be a list of names")
        if not isinstance(table.get("student_process", False), bool):
            raise ValueError(f"{path}: lab {lab_id}: student_process must be true or false")
    return labs


def discover(root: Path = REPO_ROOT) -> list[Lab]:
    """Every lab under `root`, ordered by phase then lab number."""
    labs = []
    for phase_dir in sorted(root.glob("phase-*")):
        if not (phase_dir.is_dir() and _PHASE_RE.match(phase_dir.name)):
            continue
        for lab_dir in sorted((phase_dir / "labs").glob("lab-*")):
            if lab_dir.is_dir() and _LAB_RE.match(lab_dir.name):
                labs.append(Lab(lab_dir))
    return labs


def lab_for_path(path: str | Path) -> Lab:
    """The lab that contains `path` (a file or folder inside a lab folder)."""
    p = Path(path).resolve()
    for candidate in (p, *p.parents):
        if _LAB_RE.match(candidate.name) and candidate.parent.name == "labs":
            return Lab(candidate)
    raise ValueError(f"{path} is not inside a lab folder (phase-PP-*/labs/lab-LL-*/)")


def select(labs: list[Lab], wanted: list[str] | None) -> list[Lab]:
    """Filter labs by id ("02-01"), folder name or path; an unknown name is an error."""
    if not wanted:
        return labs
    chosen = []
    for w in wanted:
        matches = [
            lab
            for lab in labs
            if w in (lab.id, lab.name, lab.rel, lab.rel + "/") or lab.path == Path(w).resolve()
        ]
        if not matches:
            known = ", ".join(lab.id for lab in labs)
            raise SystemExit(f"error: no lab named {w!r}; known labs: {known}")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen
