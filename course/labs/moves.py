"""Where mini_vllm's modules went when it was laid out as vLLM v1 is (issue 44), and the rewrite
of a student's imports that follows them.

Until then ``mini_vllm`` was one flat folder (``mini_vllm/scheduler.py``, ``mini_vllm/llm.py``,
...). A starter begun before the move imports the old paths; ``python -m course upgrade PP-LL``
rewrites those imports (:func:`rewrite_imports`) and the dashboard, ``course engine`` and the
grader name them (:func:`old_imports`). A module that moved whole maps to its new module; a
module that was split (``llm``, ``scheduler_output``, ...) maps each name to the module that
defines it now, and any other name to where the rest of it went.

The tables below are the whole record of the move; ``tests/test_mini_vllm_layers.py`` checks
that every new module named here exists and defines the names it is said to.
"""

from __future__ import annotations

import ast
import re

__all__ = ["MOVED", "SPLIT", "new_module", "old_imports", "rewrite_imports"]

# Old module -> new module, for modules that moved whole.
MOVED: dict[str, str] = {
    "mini_vllm.block_pool": "mini_vllm.core.block_pool",
    "mini_vllm.kv_cache_utils": "mini_vllm.core.kv_cache_utils",
    "mini_vllm.kv_cache_manager": "mini_vllm.core.kv_cache_manager",
    "mini_vllm.block_sharing": "mini_vllm.core.block_sharing",
    "mini_vllm.swap": "mini_vllm.core.swap",
    "mini_vllm.scheduler": "mini_vllm.core.sched.scheduler",
    "mini_vllm.async_llm": "mini_vllm.engine.async_llm",
    "mini_vllm.detokenizer": "mini_vllm.engine.detokenizer",
    "mini_vllm.loggers": "mini_vllm.metrics.loggers",
    "mini_vllm.metrics": "mini_vllm.metrics.stats",
    "mini_vllm.sampler": "mini_vllm.sample.sampler",
    "mini_vllm.cpu_decode": "mini_vllm.worker.cpu_decode",
    "mini_vllm.toy_runner": "mini_vllm.worker.toy_runner",
    "mini_vllm.model": "mini_vllm.model_executor.models.llama",
    "mini_vllm.hf_loader": "mini_vllm.model_executor.model_loader.hf_loader",
    "mini_vllm.gguf_loader": "mini_vllm.model_executor.model_loader.gguf_loader",
    "mini_vllm.huge_pages": "mini_vllm.utils.huge_pages",
    "mini_vllm.tokenizer": "mini_vllm.tokenizers.tokenizer",
    "mini_vllm.beam_search": "mini_vllm.entrypoints.beam_search",
}

# Old module -> (where its other names went, {name: new module}), for modules that were split.
# A new module equal to the old one (logprobs) means the name stayed.
SPLIT: dict[str, tuple[str, dict[str, str]]] = {
    "mini_vllm.llm": ("mini_vllm.entrypoints.llm", {
        "EngineConfig": "mini_vllm.config",
        "EngineStats": "mini_vllm.metrics.stats",
        "EngineCoreBase": "mini_vllm.engine.core",
        "EngineCore": "mini_vllm.engine.core",
        "kv_block_bytes": "mini_vllm.config",
        "CompletionOutput": "mini_vllm.outputs",
        "RequestOutput": "mini_vllm.outputs",
        "DEFAULT_CHECKPOINT": "mini_vllm.model_executor.model_loader.loader",
        "load_default_model": "mini_vllm.model_executor.model_loader.loader",
        "_LoadedModel": "mini_vllm.model_executor.model_loader.loader",
        "_load_model": "mini_vllm.model_executor.model_loader.loader",
        "WEIGHT_DTYPES": "mini_vllm.model_executor.model_loader.loader",
        "SMALL_MODEL_PARAMS": "mini_vllm.platforms",
        "MAX_DEFAULT_THREADS": "mini_vllm.platforms",
        "default_num_threads": "mini_vllm.platforms",
        "check_device": "mini_vllm.platforms",
        "check_stop_strings": "mini_vllm.engine.detokenizer",
        "child_sampling_params": "mini_vllm.engine.parallel_sampling",
        "_Tracked": "mini_vllm.engine.output_processor",
    }),
    "mini_vllm.scheduler_output": ("mini_vllm.core.sched.output", {
        "LogprobsLists": "mini_vllm.outputs",
        "LogprobsTensors": "mini_vllm.outputs",
        "ModelRunnerOutput": "mini_vllm.outputs",
        "EngineCoreOutput": "mini_vllm.outputs",
    }),
    "mini_vllm.output_processor": ("mini_vllm.engine.output_processor", {
        "IterationStats": "mini_vllm.metrics.stats",
    }),
    "mini_vllm.logprobs": ("mini_vllm.logprobs", {
        "LogprobsProcessor": "mini_vllm.engine.logprobs",
    }),
    "mini_vllm.reservation": ("mini_vllm.core.sched.reservation", {
        "KV_RESERVATIONS": "mini_vllm.config",
        "RESERVATION_POLICIES": "mini_vllm.config",
    }),
    "mini_vllm.model_runner": ("mini_vllm.worker.model_runner", {
        "PagedAttentionBackend": "mini_vllm.attention.backend",
        "_KERNEL_REPLACES": "mini_vllm.attention.backend",
        "_is_reference": "mini_vllm.attention.backend",
        "_reference_pieces_in_place": "mini_vllm.attention.backend",
        "_prefill_part": "mini_vllm.attention.backend",
        "_dequantized_blocks": "mini_vllm.attention.backend",
        "_load_cuda_ops": "mini_vllm.attention.backend",
    }),
}


# Modules that exist since the move; ``mini_vllm.metrics`` was a module and is now a package, so
# ``from mini_vllm.metrics import stats`` is a new import, not an old one.
_NEW = set(MOVED.values()) | {m for rest, names in SPLIT.values() for m in (rest, *names.values())}


def new_module(old: str, name: str | None = None) -> str | None:
    """Where ``name`` of module ``old`` is defined now (``name`` None: the module as a whole,
    where most of it went); None when ``old`` did not move (or ``old.name`` is a new module)."""
    if name and f"{old}.{name}" in _NEW:
        return None
    if old in MOVED:
        return MOVED[old]
    if old in SPLIT:
        rest, names = SPLIT[old]
        new = names.get(name, rest) if name else rest
        return None if new == old else new
    return None


def _moved(module: str | None) -> bool:
    return module is not None and (module in MOVED or module in SPLIT)


def _moves_names(node: ast.stmt) -> bool:
    """``from mini_vllm.x import a, b`` where ``x`` moved, or where one of its names did."""
    return (isinstance(node, ast.ImportFrom) and node.level == 0 and _moved(node.module)
            and any(new_module(node.module, a.name) for a in node.names))


def _package_import(node: ast.stmt) -> bool:
    """``from mini_vllm import scheduler``: an old module taken as the package's attribute."""
    return (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "mini_vllm"
            and any(_moved(f"mini_vllm.{a.name}") for a in node.names))


def old_imports(source: str) -> list[tuple[str, str]]:
    """``(old import, where it is now)`` for every import of a moved module in ``source``, in
    order; empty when there is none or the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if _moves_names(node):
            targets = sorted({new_module(node.module, a.name) or node.module
                              for a in node.names})
            found.append((node.module, ", ".join(targets)))
        elif _package_import(node):
            found += [(f"mini_vllm.{a.name}", new_module(f"mini_vllm.{a.name}"))
                      for a in node.names if _moved(f"mini_vllm.{a.name}")]
        elif isinstance(node, ast.Import):
            found += [(a.name, new_module(a.name)) for a in node.names if _moved(a.name)
                      and new_module(a.name)]
    return found


def _package_lines(node: ast.ImportFrom, indent: str) -> list[str]:
    """``from mini_vllm import scheduler`` -> ``from mini_vllm.core.sched import scheduler``; the
    name the statement bound stays bound (``import llama as model``)."""
    out = []
    for alias in node.names:
        old = f"mini_vllm.{alias.name}"
        if not _moved(old):
            out.append(f"{indent}from mini_vllm import {alias.name}"
                       + (f" as {alias.asname}" if alias.asname else ""))
            continue
        parent, _, leaf = new_module(old).rpartition(".")
        bound = alias.asname or alias.name
        out.append(f"{indent}from {parent} import {leaf}" + (f" as {bound}" if bound != leaf
                                                              else ""))
    return out


def _from_lines(node: ast.ImportFrom, indent: str) -> list[str]:
    groups: dict[str, list[str]] = {}
    for alias in node.names:
        target = new_module(node.module, alias.name) or node.module
        text = alias.name + (f" as {alias.asname}" if alias.asname else "")
        groups.setdefault(target, []).append(text)
    return [f"{indent}from {module} import {', '.join(names)}"
            for module, names in sorted(groups.items())]


def rewrite_imports(source: str) -> tuple[str, list[str]]:
    """``source`` with every import of a moved module pointed at where its names are now (a
    split module's import becomes one line per new module), and a line per rewritten import
    saying what it became. Only whole import statements change; text that does not parse is
    returned as it is."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source, []
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    said: list[str] = []
    for node in ast.walk(tree):
        indent = re.match(r"\s*", lines[node.lineno - 1]).group() if hasattr(node, "lineno") \
            else ""
        if _moves_names(node):
            new = _from_lines(node, indent)
        elif _package_import(node):
            new = _package_lines(node, indent)
        elif isinstance(node, ast.Import) and any(_moved(a.name) for a in node.names):
            new = []
            for alias in node.names:
                target = new_module(alias.name) if _moved(alias.name) else alias.name
                # ``import mini_vllm.x`` binds ``mini_vllm``; ``import mini_vllm.x as y`` binds y.
                new.append(f"{indent}import {target}"
                           + (f" as {alias.asname}" if alias.asname else ""))
        else:
            continue
        comment = re.search(r"\s+#.*$", lines[node.end_lineno - 1].rstrip("\n"))
        if comment and new:
            new[-1] += comment.group()
        old_text = "".join(lines[node.lineno - 1:node.end_lineno]).strip()
        said.append(f"{' '.join(old_text.split())} -> {'; '.join(s.strip() for s in new)}")
        edits.append((node.lineno, node.end_lineno, [s + "\n" for s in new]))
    for start, end, new_lines in sorted(edits, reverse=True):
        lines[start - 1:end] = new_lines
    return "".join(lines), said
