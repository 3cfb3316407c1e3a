"""mini_vllm's layout beside vLLM's: ``upstream_refs/layout.toml`` maps every module and package of
``mini_vllm`` to the upstream file(s) or folder(s) it corresponds to.

:func:`check_layout` holds the table to the repository (every module and package is there once,
every package's docstring names its upstream); :func:`check_layout_tree` holds it to a release
(every upstream path the table gives at that release exists in its tree).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import tomllib

from course.labs.catalog import REPO_ROOT

LAYOUT = Path("upstream_refs/layout.toml")
PACKAGE = "mini_vllm"


@dataclass(frozen=True)
class Row:
    path: str  # "mini_vllm/core/block_pool.py", or "mini_vllm/core/" for a package
    upstream: tuple[str, ...]  # empty: course-only
    at: str  # the release the upstream paths hold at
    note: str


def load_layout(root: Path = REPO_ROOT, today: str | None = None) -> tuple[list[Row], list[str]]:
    """The table's rows and the problems reading it (a row without a path, a course-only row
    without a note saying why)."""
    path = root / LAYOUT
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [], [f"{LAYOUT}: cannot read it ({exc})"]
    rows, problems = [], []
    for i, entry in enumerate(data.get("module", []), 1):
        where = f"{LAYOUT} row {i}"
        if not isinstance(entry.get("path"), str) or not isinstance(entry.get("upstream"), list):
            problems.append(f"{where}: needs `path` (a string) and `upstream` (a list)")
            continue
        row = Row(entry["path"], tuple(entry["upstream"]), entry.get("at", today or ""),
                  entry.get("note", ""))
        if not row.upstream and not row.note:
            problems.append(f"{where} ({row.path}): course-only rows say why in `note`")
        rows.append(row)
    return rows, problems


def _modules(root: Path) -> list[str]:
    """Every module and package of mini_vllm, as the table names them."""
    base = root / PACKAGE
    found = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name == "__init__.py":
            found.append(rel.removesuffix("__init__.py"))
        else:
            found.append(rel)
    return found


def check_layout(root: Path = REPO_ROOT, today: str | None = None) -> list[str]:
    """Problems between the table and the repository: a module or package missing from the
    table or named twice, a row naming nothing that exists, a package whose docstring does not
    name (one of) its upstream folder(s), a course-only package without an ``upstream: none``
    line."""
    rows, problems = load_layout(root, today)
    named: dict[str, Row] = {}
    for row in rows:
        if row.path in named:
            problems.append(f"{LAYOUT}: {row.path} has two rows")
        named[row.path] = row
    present = _modules(root)
    for module in present:
        if module not in named:
            problems.append(f"{module} is not in {LAYOUT}: add a row naming its upstream "
                            "file(s), or `upstream = []` with a note for a course-only module")
    for path in sorted(set(named) - set(present)):
        problems.append(f"{LAYOUT} names {path}, which is not a module or package of mini_vllm")
    for path in present:
        row = named.get(path)
        if not path.endswith("/") or row is None:
            continue
        doc = ast.get_docstring(ast.parse((root / path / "__init__.py").read_text("utf-8"))) or ""
        upstream_lines = [line for line in doc.splitlines() if line.startswith("upstream:")]
        if row.upstream and not any(u.rstrip("/") in doc for u in row.upstream):
            problems.append(f"{path}__init__.py: its docstring does not name its upstream, "
                            f"{' or '.join(row.upstream)}")
        elif not row.upstream and not upstream_lines:
            problems.append(f"{path}__init__.py: its docstring has no `upstream:` line "
                            "(course-only packages say `upstream: none (...)`)")
    return problems


def check_layout_tree(tree: Path, version: str, root: Path = REPO_ROOT,
                      today: str | None = None) -> tuple[list[str], int]:
    """(problems, paths checked): every upstream path the table gives at ``version`` exists in
    ``tree`` (an unpacked release)."""
    rows, _ = load_layout(root, today)
    problems, checked = [], 0
    for row in rows:
        if row.at != version:
            continue
        for path in row.upstream:
            checked += 1
            if not (tree / path.rstrip("/")).exists():
                problems.append(f"{LAYOUT}: {row.path}'s upstream {path} is not in v{version} "
                                f"({tree})")
    return problems, checked
