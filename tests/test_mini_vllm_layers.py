"""mini_vllm's packages are layered as vLLM's are, and its modules stay small.

A package may import those below it, never those above: the KV-cache core decides and never
reaches for the engine that drives it or the worker that computes; sampling knows no scheduler;
the model knows nothing of requests. Only imports that run count (an ``if TYPE_CHECKING:`` import
is a type annotation's, as upstream writes them).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from course.labs.moves import MOVED, SPLIT

ROOT = Path(__file__).resolve().parents[1]

# importer package -> packages it must not import (prefixes of module names).
_ABOVE_THE_CORE = ("mini_vllm.engine", "mini_vllm.worker", "mini_vllm.sample",
                   "mini_vllm.spec_decode", "mini_vllm.distributed", "mini_vllm.executor",
                   "mini_vllm.model_executor", "mini_vllm.entrypoints", "mini_vllm.benchmarks",
                   "mini_vllm.tokenizers", "mini_vllm.attention", "mini_vllm.csrc")
_ROOT_MODULES = ("mini_vllm.request", "mini_vllm.sampling_params", "mini_vllm.logprobs",
                 "mini_vllm.outputs", "mini_vllm.config", "mini_vllm.platforms")
LAYERS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("mini_vllm.core",): _ABOVE_THE_CORE,
    ("mini_vllm.sample", "mini_vllm.spec_decode"): (
        "mini_vllm.core", "mini_vllm.engine", "mini_vllm.worker", "mini_vllm.model_executor",
        "mini_vllm.entrypoints", "mini_vllm.metrics", "mini_vllm.benchmarks"),
    ("mini_vllm.worker",): ("mini_vllm.engine", "mini_vllm.entrypoints", "mini_vllm.benchmarks",
                            "mini_vllm.core.block_pool", "mini_vllm.core.kv_cache_manager",
                            "mini_vllm.core.sched.scheduler", "mini_vllm.metrics"),
    ("mini_vllm.model_executor",): ("mini_vllm.core", "mini_vllm.engine", "mini_vllm.worker",
                                    "mini_vllm.sample", "mini_vllm.entrypoints",
                                    "mini_vllm.metrics", "mini_vllm.benchmarks"),
    ("mini_vllm.attention", "mini_vllm.csrc"): (
        "mini_vllm.core", "mini_vllm.engine", "mini_vllm.worker", "mini_vllm.sample",
        "mini_vllm.model_executor", "mini_vllm.entrypoints", "mini_vllm.metrics",
        "mini_vllm.benchmarks", "mini_vllm.tokenizers", "mini_vllm.config"),
    ("mini_vllm.metrics",): ("mini_vllm.core", "mini_vllm.engine", "mini_vllm.worker",
                             "mini_vllm.sample", "mini_vllm.model_executor",
                             "mini_vllm.entrypoints", "mini_vllm.benchmarks"),
    ("mini_vllm.engine",): ("mini_vllm.entrypoints", "mini_vllm.benchmarks"),
    # The group is the bottom of the split: it knows no model; the executor no engine.
    ("mini_vllm.distributed",): ("mini_vllm.",),
    ("mini_vllm.executor",): ("mini_vllm.engine", "mini_vllm.entrypoints",
                              "mini_vllm.benchmarks", "mini_vllm.core"),
    ("mini_vllm.entrypoints",): ("mini_vllm.benchmarks",),
    _ROOT_MODULES: ("mini_vllm.core", "mini_vllm.engine", "mini_vllm.worker", "mini_vllm.sample",
                    "mini_vllm.model_executor", "mini_vllm.entrypoints", "mini_vllm.metrics",
                    "mini_vllm.benchmarks", "mini_vllm.tokenizers"),
    ("mini_vllm.tokenizers", "mini_vllm.utils"): ("mini_vllm.",),
}
# The imports against the layers, and why (upstream_refs/layout.toml says it too).
ALLOWED = {
    # AsyncLLM is built from an LLM, which loaded the model and checked the knobs; upstream's
    # AsyncLLM builds its engine from a VllmConfig instead.
    ("mini_vllm.engine.async_llm", "mini_vllm.entrypoints.llm"),
    # The scheduler counts drafts and acceptances in spec_decode's stats dataclass, as upstream's
    # does; that module imports nothing of mini_vllm.
    ("mini_vllm.core.sched.scheduler", "mini_vllm.spec_decode.metrics"),
}
# The kernels' folders hold generated-looking long files by nature; everything else stays small.
MAX_LINES = 700
LONG_ALLOWED = ("mini_vllm/attention/", "mini_vllm/csrc/")


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every mini_vllm module that ``path`` imports when it runs
    (function-level imports included, ``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                    (root / Path(*sub.split(".")) / "__init__.py").is_file()
                found.append((node.lineno, sub if is_module else base))
    return [(line, m) for line, m in found if m == "mini_vllm" or m.startswith("mini_vllm.")]


def _under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix.rstrip(".") + ".")


def wrong_way_imports(root: Path) -> list[str]:
    """``path:line: importer imports imported (a layer above it)`` for every import against
    :data:`LAYERS` under ``root``'s mini_vllm."""
    problems = []
    for path in sorted((root / "mini_vllm").rglob("*.py")):
        importer = _module_name(path, root)
        for owners, forbidden in LAYERS.items():
            if not any(_under(importer, o) for o in owners):
                continue
            for line, imported in runtime_imports(path, root):
                if any(_under(imported, o) for o in owners):
                    continue  # within its own package
                if (importer, imported) in ALLOWED:
                    continue
                if any(_under(imported, f) if not f.endswith(".") else imported.startswith(f)
                       for f in forbidden):
                    problems.append(f"{path.relative_to(root)}:{line}: {importer} imports "
                                    f"{imported}, a layer above it")
    return problems


def _copy_mini_vllm(folder: Path) -> None:
    """mini_vllm's Python into ``folder`` (no checkpoint or kernel sources), to plant a fault in."""
    shutil.copytree(ROOT / "mini_vllm", folder / "mini_vllm",
                    ignore=shutil.ignore_patterns("checkpoints", "__pycache__", "*.cu*", "*.c"))


def test_mini_vllm_imports_only_downwards():
    assert wrong_way_imports(ROOT) == []


@pytest.mark.parametrize("where, line, culprit", [
    ("core/block_pool.py", "from mini_vllm.engine.core import EngineCore", "mini_vllm.engine.core"),
    ("sample/sampler.py", "def _later():\n    from mini_vllm.core.sched import scheduler\n",
     "mini_vllm.core.sched.scheduler"),
    ("core/kv_cache_utils.py", "import mini_vllm.worker.model_runner",
     "mini_vllm.worker.model_runner"),
    ("model_executor/models/llama.py", "from ...core.sched.output import SchedulerOutput",
     "mini_vllm.core.sched.output"),
])
def test_a_planted_wrong_way_import_is_named(tmp_path, where, line, culprit):
    _copy_mini_vllm(tmp_path)
    target = tmp_path / "mini_vllm" / where
    target.write_text(target.read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    problems = wrong_way_imports(tmp_path)
    assert len(problems) == 1 and culprit in problems[0] and where in problems[0], problems


def test_a_type_checking_import_is_not_a_layer_crossing(tmp_path):
    _copy_mini_vllm(tmp_path)
    target = tmp_path / "mini_vllm" / "core" / "block_pool.py"
    target.write_text(target.read_text(encoding="utf-8") + "\nif TYPE_CHECKING:\n"
                      "    from mini_vllm.engine.core import EngineCore\n", encoding="utf-8")
    assert wrong_way_imports(tmp_path) == []


def test_no_module_outside_the_kernels_is_over_700_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted((ROOT / "mini_vllm").rglob("*.py"))
            if not p.relative_to(ROOT).as_posix().startswith(LONG_ALLOWED)
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert long == [], f"split these along upstream's lines: {long}"


def test_every_moved_name_is_where_the_move_table_says():
    """course upgrade rewrites a student's imports by this table: each target must be real."""
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        assert importlib.util.find_spec(old) is None or old == "mini_vllm.metrics", \
            f"{old} still exists beside {new}: the move leaves no shim"
    for old, (rest, names) in SPLIT.items():
        importlib.import_module(rest)
        for name, new in names.items():
            assert hasattr(importlib.import_module(new), name), f"{old}.{name} -> {new}: missing"


def test_every_module_and_package_is_mapped_to_its_upstream():
    from course.upstream.layout import check_layout

    assert check_layout(ROOT, "0.33.0") == []


def test_a_module_missing_from_the_layout_table_is_named(tmp_path):
    from course.upstream.layout import check_layout

    _copy_mini_vllm(tmp_path)
    shutil.copytree(ROOT / "upstream_refs", tmp_path / "upstream_refs")
    (tmp_path / "mini_vllm" / "core" / "kv_cache_coordinator.py").write_text('"""New."""\n')
    init = tmp_path / "mini_vllm" / "sample" / "__init__.py"
    init.write_text('"""Sampling, with no word of where it comes from."""\n')
    problems = check_layout(tmp_path, "0.33.0")
    assert len(problems) == 2, problems
    assert problems[0].startswith("mini_vllm/core/kv_cache_coordinator.py is not in ")
    assert problems[1].startswith("mini_vllm/sample/__init__.py: its docstring does not name")
