"""The shape of the course's tooling (course/__init__.py): subpackages in layers, no import
circle, nothing imports `cli`, and `mini_vllm` imports nothing of the course.

Imports are read with `ast` from the source, every one of them: at module level and inside
functions (a lazy import is still a dependency, and a circle through one is still a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module of one layer imports only from its own layer and the ones before it.
# `course` itself (course/__init__.py) is below them all and imports nothing of the course.
LAYERS = ("labs", "upstream", "figures", "engine", "student", "grading", "integrity", "site",
          "cli")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_imports(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: {imported course modules}}`` for every module of ``package`` under ``root``;
    ``from a.b import c`` counts as an import of ``a.b`` (its ``__init__`` runs first) and also
    of ``a.b.c`` when that is a module.
    Only absolute imports of names starting with ``course`` are counted (relative ones are
    refused by :func:`test_course_uses_absolute_imports_only`)."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in files:
                        targets.add(full)
        graph[name] = {t for t in targets if t == "course" or t.startswith("course.")}
    return graph


def layer_of(module: str) -> int:
    """The layer index of a course module; -1 for the ``course`` package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module}: course/{parts[1]} is in no layer; add it to LAYERS in "
                             "tests/test_course_layout.py and to course/__init__.py's list")
    return LAYERS.index(parts[1])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        if module in ("course.__main__",):
            continue  # `python -m course`: the entry point runs cli
        for target in sorted(targets):
            if target == "course.cli" or target.startswith("course.cli."):
                problems.append(f"{module} imports {target}: nothing imports cli (it is on top)")
            elif layer_of(target) > layer_of(module):
                problems.append(
                    f"{module} imports {target}: {target.split('.')[1]} is a layer above "
                    f"{module.split('.')[1] if '.' in module else 'course'}")
    return problems


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt in graph and not state.get(nxt):
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start):
            found = visit(start)
            if found:
                return found
    return None


def test_course_has_no_import_circle():
    cycle = find_cycle(package_imports(ROOT, "course"))
    assert cycle is None, "import circle in course/: " + " -> ".join(cycle)


def test_course_modules_import_only_their_layer_and_below():
    problems = layer_violations(package_imports(ROOT, "course"))
    assert not problems, "\n".join(problems)


def test_every_subpackage_is_in_a_layer_and_says_what_it_owns():
    packages = {p.parent.name for p in (ROOT / "course").glob("*/__init__.py")}
    assert packages == set(LAYERS) - {"cli"}, (
        f"course/ subpackages {sorted(packages)} != LAYERS {sorted(set(LAYERS) - {'cli'})}")
    listed = ast.get_docstring(ast.parse((ROOT / "course" / "__init__.py").read_text()))
    for name in LAYERS:
        assert f"``{name}``" in listed, f"course/__init__.py does not describe {name}"
    for name in packages:
        doc = ast.get_docstring(ast.parse((ROOT / "course" / name / "__init__.py").read_text()))
        assert doc and len(doc) > 60, f"course/{name}/__init__.py: say what it owns and imports"


def test_course_uses_absolute_imports_only():
    """Relative imports would hide from the checks above."""
    for path in (ROOT / "course").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            assert not (isinstance(node, ast.ImportFrom) and node.level), (
                f"{path.relative_to(ROOT)}:{node.lineno}: use an absolute import")


def test_mini_vllm_imports_nothing_of_the_course():
    graph = package_imports(ROOT, "mini_vllm")
    offenders = {m: sorted(t) for m, t in graph.items() if t}
    assert not offenders, f"mini_vllm imports the course: {offenders}"
    for path in (ROOT / "mini_vllm").rglob("*.py"):  # and no import by name at run time
        text = path.read_text(encoding="utf-8")
        assert "import_module(\"course" not in text and "import_module('course" not in text, path


# The checks must see what they claim to: planted circles and planted layer breaks.


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "in-a-function"])
def test_a_planted_circle_is_found(tmp_path, lazy):
    inner = "    " if lazy else ""
    head = "def f():\n" if lazy else ""
    _write(tmp_path, {
        "course/__init__.py": "",
        "course/labs/__init__.py": "",
        "course/labs/a.py": "from course.labs.b import x\n",
        "course/labs/b.py": f"{head}{inner}from course.labs import a\n",
        "course/labs/c.py": "import course.labs.a\n",
    })
    cycle = find_cycle(package_imports(tmp_path, "course"))
    assert cycle is not None and set(cycle) == {"course.labs.a", "course.labs.b"}


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """``from course.grading import sandbox`` inside a module that the package's ``__init__``
    imports runs that ``__init__`` half done: a circle, even though ``sandbox`` itself is fine."""
    _write(tmp_path, {
        "course/__init__.py": "",
        "course/grading/__init__.py": "from course.grading.grader import grade\n",
        "course/grading/grader.py": "from course.grading import sandbox\n",
        "course/grading/sandbox.py": "",
    })
    cycle = find_cycle(package_imports(tmp_path, "course"))
    assert cycle is not None and set(cycle) == {"course.grading", "course.grading.grader"}


def test_a_planted_layer_break_and_cli_import_are_found(tmp_path):
    _write(tmp_path, {
        "course/__init__.py": "",
        "course/cli.py": "from course.labs.catalog import discover\n",
        "course/labs/__init__.py": "",
        "course/labs/catalog.py": "def discover():\n    from course.engine.compose import x\n",
        "course/engine/__init__.py": "",
        "course/engine/compose.py": "from course.cli import main\n",
    })
    problems = layer_violations(package_imports(tmp_path, "course"))
    assert any("course.labs.catalog imports course.engine.compose" in p for p in problems)
    assert any("course.engine.compose imports course.cli" in p for p in problems)


def test_a_planted_mini_vllm_import_of_the_course_is_found(tmp_path):
    lazy_import = "def f():\n    from course.labs.loader import load_module\n"
    _write(tmp_path, {"mini_vllm/__init__.py": "", "mini_vllm/x.py": lazy_import})
    assert package_imports(tmp_path, "mini_vllm")["mini_vllm.x"] == {"course.labs.loader"}
