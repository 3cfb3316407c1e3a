"""Upstream references: every `path:line @ vX.Y.Z` in the course is in the map, and is true.

The map lives in `upstream_refs/map/*.toml`, one `[[ref]]` table per reference:
symbol, file, line, version, text (a substring expected on that line of the pinned source) and
qualname (the upstream piece that holds the line, which `today.py` follows to today's release).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tomllib

from course.labs.catalog import REPO_ROOT

REF_RE = re.compile(
    r"(?P<file>(?:vllm|csrc|tests|benchmarks)/[\w./-]+\.\w+):(?P<line>\d+)\s+@\s+v(?P<version>\d+\.\d+\.\d+)"
)
SCANNED = (
    "mini_vllm/**/*.py",
    "mini_vllm/**/*.cu",
    "mini_vllm/**/*.cuh",
    "mini_vllm/**/*.cpp",
    "mini_vllm/**/*.c",
    "phase-*/**/README.md",
    "phase-*/README.md",
    "phase-*/labs/*/hints.toml",
)


@dataclass(frozen=True)
class Ref:
    symbol: str
    file: str
    line: int
    version: str
    text: str
    source: str  # the map file it came from
    qualname: str | None = None  # the upstream class/function holding the line ("" at module level)

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.file, self.line, self.version)


def toml_files(folder: Path, problems: list[str], label: str = "") -> Iterator[tuple[Path, dict]]:
    """Each ``*.toml`` file of ``folder``, parsed, in name order. A file that is not valid TOML is
    added to ``problems`` (named ``label`` + its name), never raised."""
    for path in sorted(folder.glob("*.toml")):
        try:
            yield path, tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"{label}{path.name}: not valid TOML ({exc})")


def load_map(root: Path = REPO_ROOT) -> tuple[list[Ref], list[str]]:
    """All map entries, and the problems found while reading them."""
    refs, problems = [], []
    for path, data in toml_files(root / "upstream_refs" / "map", problems):
        for i, entry in enumerate(data.get("ref", [])):
            missing = {"symbol", "file", "line", "version", "text"} - set(entry)
            if missing:
                problems.append(f"{path.name}: entry {i} lacks {', '.join(sorted(missing))}")
                continue
            refs.append(
                Ref(
                    entry["symbol"],
                    entry["file"],
                    int(entry["line"]),
                    str(entry["version"]),
                    entry["text"],
                    path.name,
                    entry.get("qualname"),
                )
            )
    return refs, problems


def find_uses(root: Path = REPO_ROOT) -> dict[tuple[str, int, str], list[str]]:
    """Every reference written in the scanned files, with where it was written."""
    uses: dict[tuple[str, int, str], list[str]] = {}
    seen: set[Path] = set()
    for pattern in SCANNED:
        for path in sorted(root.glob(pattern)):
            if path in seen or not path.is_file() or ".ipynb_checkpoints" in path.parts:
                continue
            seen.add(path)
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in REF_RE.finditer(text):
                lineno = text.count("\n", 0, m.start()) + 1
                key = (m["file"], int(m["line"]), m["version"])
                uses.setdefault(key, []).append(f"{path.relative_to(root)}:{lineno}")
    return uses


def check_consistency(root: Path = REPO_ROOT) -> list[str]:
    """Map and repository agree: each reference is mapped, each entry used, no duplicates."""
    refs, problems = load_map(root)
    uses = find_uses(root)
    keys: dict[tuple[str, int, str], Ref] = {}
    for ref in refs:
        if ref.key in keys and keys[ref.key].text != ref.text:
            problems.append(
                f"{ref.source}: {ref.file}:{ref.line} @ v{ref.version} is mapped twice "
                f"with different texts"
            )
        keys.setdefault(ref.key, ref)
    for key, where in sorted(uses.items()):
        if key not in keys:
            problems.append(f"{key[0]}:{key[1]} @ v{key[2]} (used at {where[0]}) is not in the map")
    for key, ref in sorted(keys.items()):
        if key not in uses:
            problems.append(
                f"{ref.source}: {key[0]}:{key[1]} @ v{key[2]} ({ref.symbol}) is never used"
            )
    return problems


def source_version(src: Path) -> str | None:
    """The release a source tree holds, from its PKG-INFO (sdist) or the folder name (vX.Y.Z)."""
    pkg_info = src / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    m = re.fullmatch(r"v?(\d+\.\d+\.\d+)", src.name)
    return m.group(1) if m else None


def check_against_source(
    srcs: list[Path], root: Path = REPO_ROOT
) -> tuple[list[str], list[str], int]:
    """(mismatches, notes, number checked): each entry's line holds its expected text."""
    refs, problems = load_map(root)
    trees: dict[str, Path] = {}
    for src in srcs:
        version = source_version(src)
        if version is None:
            problems.append(
                f"{src}: cannot tell which release this is (no PKG-INFO, no vX.Y.Z name)"
            )
        else:
            trees[version] = src
    notes, checked = [], 0
    for ref in refs:
        tree = trees.get(ref.version)
        if tree is None:
            continue
        path = tree / ref.file
        where = f"{ref.file}:{ref.line} @ v{ref.version} ({ref.symbol}, {ref.source})"
        if not path.is_file():
            problems.append(f"{where}: no such file in the source")
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        checked += 1
        if not 1 <= ref.line <= len(lines):
            problems.append(f"{where}: the file has only {len(lines)} lines")
        elif ref.text.strip() not in lines[ref.line - 1]:
            hint = next(
                (
                    f"; found at line {i + 1}"
                    for i, text in enumerate(lines)
                    if ref.text.strip() in text
                ),
                "",
            )
            problems.append(
                f"{where}: expected {ref.text.strip()!r}, "
                f"line says {lines[ref.line - 1].strip()!r}{hint}"
            )
    unchecked = sorted({r.version for r in refs} - set(trees))
    for version in unchecked:
        n = sum(r.version == version for r in refs)
        notes.append(f"{n} entries for v{version} not checked: pass --vllm-src for that release")
    return problems, notes, checked
