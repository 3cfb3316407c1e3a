"""Mutation testing of a lab's graded tests with mutmut (issue 12): how many realistic edits of
the reference code its tests catch.

    pip install -r requirements-dev.txt          # mutmut, pinned; no other torch
    nice -n 10 python scripts/mutation_test.py 02-01 [--out mutation/results.json]

For each lab it reads `mutation/PP-LL.toml`:

    paths = ["mini_vllm/core/kv_cache_utils.py", "mini_vllm/core/block_pool.py"]   # files to mutate
    also = ["BlockPool._undo_free"]   # functions in scope besides the starter's task functions
    [[set_aside]]                     # a surviving mutant that no test should kill, and why
    function = "BlockPool.free_blocks"
    before = "elif ref_cnt < 0 and not block.is_null:"   # the line as written
    after = "elif ref_cnt <= 0 and not block.is_null:"   # the line as mutated
    kind = "equivalent"               # or "wording": only the text of a message changes
    reason = "..."

In scope are the functions the lab's starter leaves to the student (its tasks, read from the
starter) and `also`: the score says how well the tests catch mistakes in code a student writes.
mutmut runs in a scratch copy of the repository against the lab's own test file with
LAB_IMPL=solution and the `ci` Hypothesis profile. Score = killed / (in scope - set aside);
a timeout counts as killed, "no tests" as a survivor. The results (and the command that made
them) go to --out, merged with the other labs already there. Too slow for .ci/run.

    mode = "source"                   # in the toml: the functions are Triton kernels, which
                                      # mutmut's trampolines break; each mutant is the whole
                                      # file rewritten (run_lab_by_source)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from course.labs.catalog import (  # noqa: E402
    copy_ignore,  # noqa: E402
    discover,
    select,
)
from course.labs.tasks import open_tasks  # noqa: E402

CONFIG_DIR = REPO_ROOT / "mutation"
DEFAULT_OUT = CONFIG_DIR / "results.json"
_NAME_RE = re.compile(r"^(?P<module>[\w.-]+)\.x(?:ǁ(?P<cls>\w+)ǁ|_)(?P<func>\w+?)__mutmut_\d+$")


def function_of(mutant: str) -> str:
    """`mini_vllm.core.block_pool.xǁBlockPoolǁfree_blocks__mutmut_3` -> `BlockPool.free_blocks`."""
    m = _NAME_RE.match(mutant)
    if not m:
        return mutant
    return f"{m['cls']}.{m['func']}" if m["cls"] else m["func"]


def scope_patterns(paths: list[str], scope: list[str]) -> list[str]:
    """mutmut name patterns for the in-scope functions of `paths`, so that mutmut runs only
    those mutants (the others stay "not checked" and are not counted): `Cls.meth` in
    `mini_vllm/x.py` -> `mini_vllm.x.xǁClsǁmeth*`, `func` -> `mini_vllm.x.x_func*`. The pattern
    has no `__mutmut_` so that it also matches the function's own name, which is how mutmut picks
    the tests of the clean run."""
    patterns = []
    for path in paths:
        module = path.removesuffix(".py").replace("/", ".")
        for name in scope:
            cls, _, func = name.rpartition(".")
            patterns.append(f"{module}.xǁ{cls}ǁ{func}*" if cls else f"{module}.x_{func}*")
    return patterns


def _norm(line: str) -> str:
    return " ".join(line.split())


def _mutmut(copy: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
    )


def run_lab(lab_id: str, max_children: int) -> dict:
    (lab,) = select(discover(), [lab_id])
    config_path = CONFIG_DIR / f"{lab.id}.toml"
    config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    if config.get("mode") == "source":
        return run_lab_by_source(lab, config, max_children)
    scope = [name for t in open_tasks(lab) for name, _ in t.functions] + config.get("also", [])
    set_aside = config.get("set_aside", [])
    test_file = (lab.path / "test_lab.py").relative_to(REPO_ROOT).as_posix()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO_ROOT, copy, ignore=copy_ignore)
        also_copy = [
            "course",
            "conftest.py",
            "mini_vllm",
            lab.path.relative_to(REPO_ROOT).as_posix(),
        ]
        with (copy / "pyproject.toml").open("a", encoding="utf-8") as f:
            f.write(
                "\n[tool.mutmut]\n"
                f"source_paths = {json.dumps(config['paths'])}\n"
                f"also_copy = {json.dumps(also_copy)}\n"
                f"pytest_add_cli_args_test_selection = {json.dumps([test_file])}\n"
            )
        env = dict(os.environ, LAB_IMPL="solution", HYPOTHESIS_PROFILE="ci", OMP_NUM_THREADS="1")
        env["COURSE_MODULE_NAMES_FROM_PATHS"] = "1"  # lab-only code: see course/labs/loader.py
        proc = _mutmut(
            copy,
            "run",
            "--max-children",
            str(max_children),
            *scope_patterns(config["paths"], scope),
            env=env,
        )
        if "failed to collect stats" in proc.stdout + proc.stderr:
            raise SystemExit(
                f"mutmut could not run the tests:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        listing = _mutmut(copy, "results", "--all", "true", env=env).stdout
        statuses = {}
        for line in listing.splitlines():
            name, sep, status = line.strip().rpartition(": ")
            if sep and "__mutmut_" in name:
                statuses[name] = status
        in_scope = {
            n: s
            for n, s in statuses.items()
            if any(fnmatch.fnmatch(function_of(n), p) for p in scope)
        }
        survivors, aside = [], []
        for name, status in sorted(in_scope.items()):
            if status in ("killed", "timeout", "not checked"):
                continue
            diff = _mutmut(copy, "show", name, env=env).stdout
            before = [_norm(x[1:]) for x in diff.splitlines() if x.startswith("- ")]
            after = [_norm(x[1:]) for x in diff.splitlines() if x.startswith("+ ")]
            entry = {
                "mutant": name,
                "function": function_of(name),
                "status": status,
                "before": "\n".join(before),
                "after": "\n".join(after),
            }
            match = next(
                (
                    a
                    for a in set_aside
                    if a["function"] == entry["function"]
                    and _norm(a["before"]) in map(_norm, before or [""])
                    and _norm(a["after"]) in map(_norm, after or [""])
                ),
                None,
            )
            if match is not None:
                aside.append({**entry, "kind": match["kind"], "reason": match["reason"]})
            else:
                survivors.append(entry)
    seconds = time.perf_counter() - start
    counts = {}
    for status in in_scope.values():
        counts[status] = counts.get(status, 0) + 1
    checked = len(in_scope) - counts.get("not checked", 0)
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    denominator = checked - len(aside)
    return {
        "lab": lab.id,
        "paths": config["paths"],
        "scope": scope,
        "mutants_in_files": len(statuses),
        "mutants_in_scope": len(in_scope),
        "statuses": counts,
        "killed": killed,
        "set_aside": len(aside),
        "survived": len(survivors),
        "score": round(killed / denominator, 4) if denominator else None,
        "seconds": round(seconds, 1),
        "survivors": survivors,
        "set_aside_mutants": aside,
    }


def _mutations_by_source(copy: Path, path: str, scope: list[str]) -> list[tuple[str, str, str]]:
    """(function, the whole file mutated, the mutated line) for every mutmut mutation inside
    the in-scope top-level functions of `path`. mutmut reads its settings from `copy`."""
    import libcst as cst
    from mutmut.mutation.file_mutation import create_mutations

    # mutmut leaves decorated functions alone (a decorator runs at definition): mutate the
    # functions without their `@triton.jit`, and put it back on each mutant.
    decorators: dict[str, tuple] = {}

    class Undecorate(cst.CSTTransformer):
        def leave_FunctionDef(self, node, updated):  # noqa: N802 (libcst's name)
            if updated.decorators and updated.name.value in scope:
                decorators[updated.name.value] = updated.decorators
                return updated.with_changes(decorators=())
            return updated

    class Redecorate(cst.CSTTransformer):
        def leave_FunctionDef(self, node, updated):  # noqa: N802
            if updated.name.value in decorators and not updated.decorators:
                return updated.with_changes(decorators=decorators[updated.name.value])
            return updated

    code = cst.parse_module((copy / path).read_text(encoding="utf-8")).visit(Undecorate()).code
    here = os.getcwd()
    os.chdir(copy)  # mutmut's configuration is the copy's pyproject.toml
    try:
        module, mutations, _, _ = create_mutations(path, code)
    finally:
        os.chdir(here)
    out = []
    for mutation in mutations:
        func = mutation.contained_by_top_level_function
        if func is None or func.name.value not in scope:
            continue
        mutated = module.deep_replace(mutation.original_node, mutation.mutated_node)
        mutated = mutated.visit(Redecorate())
        before = cst.Module([]).code_for_node(mutation.original_node)
        after = cst.Module([]).code_for_node(mutation.mutated_node)
        out.append((func.name.value, mutated.code, f"{before} -> {after}"))
    return out


def run_lab_by_source(lab, config: dict, max_children: int) -> dict:
    """The same score for a lab whose in-scope functions are Triton kernels (``mode =
    "source"``): mutmut's trampolines replace a function's body, and Triton compiles or
    interprets a kernel from its source, so each mutant is the whole file rewritten instead,
    in its own copy, with the lab's tests run until one fails."""
    from concurrent.futures import ThreadPoolExecutor

    scope = [name for t in open_tasks(lab) for name, _ in t.functions] + config.get("also", [])
    set_aside = config.get("set_aside", [])
    test_file = (lab.path / "test_lab.py").relative_to(REPO_ROOT).as_posix()
    env = dict(os.environ, LAB_IMPL="solution", HYPOTHESIS_PROFILE="ci", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copies = []
        for i in range(max_children):
            copy = Path(tmp) / f"repo{i}"
            shutil.copytree(REPO_ROOT, copy, ignore=copy_ignore)
            copies.append(copy)
        with (copies[0] / "pyproject.toml").open("a", encoding="utf-8") as f:
            f.write(f"\n[tool.mutmut]\nsource_paths = {json.dumps(config['paths'])}\n")
        mutants = [(path, *m) for path in config["paths"]
                   for m in _mutations_by_source(copies[0], path, scope)]
        free = list(copies)

        def run(mutant) -> str:
            path, _, code, _ = mutant
            copy = free.pop()
            original = (copy / path).read_text(encoding="utf-8")
            try:
                (copy / path).write_text(code, encoding="utf-8")
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                     test_file], cwd=copy, env=env, capture_output=True, timeout=600)
                return "survived" if proc.returncode == 0 else "killed"
            except subprocess.TimeoutExpired:
                return "timeout"
            finally:
                (copy / path).write_text(original, encoding="utf-8")
                free.append(copy)

        with ThreadPoolExecutor(max_children) as pool:
            statuses = list(pool.map(run, mutants))
    survivors, aside = [], []
    for (path, function, _, change), status in zip(mutants, statuses):
        if status != "survived":
            continue
        before, _, after = change.partition(" -> ")
        entry = {"mutant": f"{path}:{function}", "function": function, "status": status,
                 "before": _norm(before), "after": _norm(after)}
        match = next((a for a in set_aside if a["function"] == function
                      and _norm(a["before"]) == entry["before"]
                      and _norm(a["after"]) == entry["after"]), None)
        if match is not None:
            aside.append({**entry, "kind": match["kind"], "reason": match["reason"]})
        else:
            survivors.append(entry)
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    denominator = len(statuses) - len(aside)
    return {
        "lab": lab.id, "paths": config["paths"], "scope": scope, "mode": "source",
        "mutants_in_files": len(statuses), "mutants_in_scope": len(statuses),
        "statuses": counts, "killed": killed, "set_aside": len(aside),
        "survived": len(survivors),
        "score": round(killed / denominator, 4) if denominator else None,
        "seconds": round(time.perf_counter() - start, 1),
        "survivors": survivors, "set_aside_mutants": aside,
    }


def _revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("labs", nargs="+", help="lab ids with a mutation/PP-LL.toml")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON (merged per lab)")
    parser.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args(argv)
    try:
        import mutmut
    except ImportError:
        raise SystemExit("mutmut is not installed: pip install -r requirements-dev.txt") from None
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"labs": {}}
    for lab_id in args.labs:
        r = run_lab(lab_id, args.max_children)
        r.update(
            command=f"python scripts/mutation_test.py {lab_id}",
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            revision=_revision(),
            tool=f"mutmut {getattr(mutmut, '__version__', '?')}",
            python=platform.python_version(),
        )
        results["labs"][r["lab"]] = r
        score = "n/a (no mutant in scope)" if r["score"] is None else f"{r['score']:.1%}"
        print(
            f"lab {r['lab']}: score {score} ({r['killed']} killed of "
            f"{r['mutants_in_scope']} in scope, {r['set_aside']} set aside, {r['survived']} "
            f"survived; {r['mutants_in_files']} mutants in the files) in {r['seconds']:.0f} s"
        )
        for s in r["survivors"]:
            print(f"  survived  {s['function']}: {s['before']!r} -> {s['after']!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
