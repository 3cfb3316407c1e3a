"""Every public class and function of mini_vllm names its upstream counterpart in its docstring.

The line reads `upstream: <file>:<line> @ vX.Y.Z` (checked against the map by the refs test), or
`upstream: none (<why>)` for course-only code such as the byte tokenizer. A module whose own
docstring says `upstream: none (<why>)` is course-only as a whole.
"""

from __future__ import annotations

import ast

import pytest

from course.labs.catalog import REPO_ROOT

MODULES = sorted((REPO_ROOT / "mini_vllm").rglob("*.py"))


def public_definitions(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
            yield node


@pytest.mark.parametrize(
    "path", MODULES, ids=[str(p.relative_to(REPO_ROOT / "mini_vllm")) for p in MODULES]
)
def test_public_definitions_cite_upstream(path):
    module_doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    if "upstream: none" in module_doc:
        return
    missing = [
        f"{node.name} (line {node.lineno})"
        for node in public_definitions(path)
        if "upstream:" not in (ast.get_docstring(node) or "")
    ]
    assert not missing, (
        f"{path.relative_to(REPO_ROOT)}: add an `upstream: <file>:<line> @ v0.11.0` line (or "
        f"`upstream: none (<why>)`) to the docstring of: {', '.join(missing)}"
    )
