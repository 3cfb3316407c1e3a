"""Fill a lab's starter task by task from the reference and count the passing tests after each.

Issue 12's rule: implementing the tasks one at a time makes the number of passing tests grow
after every task (a student sees progress before writing the next one). This script checks it
in a scratch copy of the repository (the checkout is never touched):

    python scripts/task_by_task.py 02-01

For k = 0, 1, ..., N it replaces the bodies of tasks 1..k in starter.py by the reference's
functions (looked up by qualified name in solution.py's objects; a private method the reference
class has and the starter's lacks is added with the first task of that class), runs the lab's
tests against that starter and prints the passing count. In a CUDA lab (starter.cu) it takes the
body of each task's function from the reference kernels in mini_vllm/csrc and marks the task
done (`#define LAB_TASK_N_DONE 1`). Exit status 1 when some task adds no
passing test, or when a filled-in starter fails to import.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import inspect
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from course.labs.catalog import (  # noqa: E402
    Lab,
    copy_ignore,  # noqa: E402
    discover,
    select,
)
from course.labs.loader import load_module  # noqa: E402
from course.labs.runner import run_lab  # noqa: E402
from course.labs.tasks import Task, open_tasks  # noqa: E402

CSRC_DIR = REPO_ROOT / "mini_vllm" / "csrc"


def _reference_function(solution, qualname: str):
    obj = solution
    for part in qualname.split("."):
        holder = obj
        obj = vars(obj).get(part) if inspect.isclass(obj) else getattr(obj, part)
        if obj is None:
            raise LookupError(f"the reference has no {qualname}")
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return holder, inspect.unwrap(obj)


def _nodes(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
        elif isinstance(node, ast.ClassDef):
            yield f"{prefix}{node.name}", node
            yield from _nodes(node, f"{prefix}{node.name}.")


def fill(source: str, solution, qualnames: list[str], starter=None) -> str:
    """`source` with the functions `qualnames` replaced by the reference's (bottom-up, so that
    line numbers stay valid), plus the reference's private helpers their classes lack (a
    helper the class of the loaded `starter` module already has, e.g. from a base class it
    takes from mini_vllm, is not added)."""
    tree = ast.parse(source)
    nodes = dict(_nodes(tree))
    lines = source.splitlines(keepends=True)
    edits = []  # (first line index, last line index exclusive, new text)
    helpers_added = set()
    for qualname in qualnames:
        node = nodes[qualname]
        holder, ref = _reference_function(solution, qualname)
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        indent = lines[node.lineno - 1][: node.col_offset]
        text = textwrap.indent(textwrap.dedent(inspect.getsource(ref)), indent)
        edits.append((first, node.end_lineno, text))
        cls_name = qualname.rsplit(".", 1)[0] if "." in qualname else None
        if cls_name and cls_name not in helpers_added and inspect.isclass(holder):
            helpers_added.add(cls_name)
            cls_node = nodes[cls_name]
            have = {n.name for n in cls_node.body if isinstance(n, ast.FunctionDef)}
            starter_cls = getattr(starter, cls_name, None) if starter is not None else None
            if inspect.isclass(starter_cls):
                have |= set(dir(starter_cls))
            extra = [
                textwrap.indent(textwrap.dedent(inspect.getsource(f)), indent)
                for name, f in vars(holder).items()
                if name.startswith("_")
                and not name.startswith("__")
                and inspect.isfunction(f)
                and name not in have
            ]
            if extra:
                edits.append((cls_node.end_lineno, cls_node.end_lineno, "\n" + "\n".join(extra)))
    for first, last, text in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first:last] = [text if text.endswith("\n") else text + "\n"]
    # Module-level helpers a reference function calls that the starter does not define (e.g.
    # upstream's generate_block_hash_extra_keys): import them from the reference's module.
    defined = _top_level_names(tree)
    missing = {}
    for qualname in qualnames:
        _, ref = _reference_function(solution, qualname)
        for name in sorted(_global_names(ref.__code__)):
            if name in ref.__globals__ and name not in defined and name not in vars(builtins):
                missing.setdefault(name, (ref.__globals__[name], ref.__globals__["__name__"]))
    for name, (value, home) in missing.items():
        if inspect.ismodule(value):
            lines.append(f"import {value.__name__} as {name}  # noqa: E402\n")
        elif not hasattr(value, "__module__"):  # a constant (an int, a tuple of dtypes...)
            if home.startswith("course_labs."):
                lines.append(f"{name} = {value!r}\n")
            else:
                lines.append(f"from {home} import {name}  # noqa: E402\n")
        elif getattr(value, "__module__", "").startswith("course_labs."):
            lines.append("\n" + textwrap.dedent(inspect.getsource(value)))  # lab-only helper
        else:
            # A constant (an int, a tuple, a dtype) has no __module__ of its own: take it from
            # the module of the reference function that reads it.
            source = value.__module__ if isinstance(getattr(value, "__module__", None),
                                                    str) else home
            lines.append(f"from {source} import {name}  # noqa: E402\n")
    return "".join(lines)


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _cuda_body(source: str, name: str) -> tuple[int, int] | None:
    """(start, end) of the braces of function `name`'s definition in CUDA `source`: the first
    `name(` not preceded by template arguments (a call reads `name<...>(`), then its body."""
    m = re.search(rf"\b{re.escape(name)}\(", source)
    if m is None:
        return None
    depth, i = 0, m.end() - 1
    while True:  # past the parameter list
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
        if depth == 0:
            break
    start = source.index("{", i)
    depth, i = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        i += 1
        if depth == 0:
            return start, i


def fill_cuda(source: str, tasks: list[Task]) -> str:
    """starter.cu with each of `tasks` written (its function's body from the reference kernels
    in mini_vllm/csrc) and marked done."""
    references = [p.read_text(encoding="utf-8") for p in sorted(CSRC_DIR.glob("*.cu*"))]
    for task in tasks:
        name = task.functions[0][0]
        body = next((ref[slice(*span)] for ref in references
                     if (span := _cuda_body(ref, name)) is not None), None)
        if body is None:
            raise LookupError(f"no reference definition of {name} in {CSRC_DIR}")
        start, end = _cuda_body(source, name)
        source = source[:start] + body + source[end:]
        source = re.sub(rf"^(#define LAB_TASK_{task.number}_DONE\s+)0\b", r"\g<1>1", source,
                        flags=re.M)
    return source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lab", help="lab id, e.g. 02-01")
    args = parser.parse_args(argv)
    (lab,) = select(discover(), [args.lab])
    tasks = open_tasks(lab)
    solution = load_module(lab.path, "solution", lab.id)
    starter = load_module(lab.path, "starter", lab.id)
    cuda = (lab.path / "starter.cu").is_file()
    student_file = "starter.cu" if cuda else "starter.py"
    original = (lab.path / student_file).read_text(encoding="utf-8")
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="task-by-task-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO_ROOT, copy, ignore=copy_ignore)
        lab_copy = Lab(copy / lab.path.relative_to(REPO_ROOT))
        previous = -1
        for k in range(len(tasks) + 1):
            if cuda:
                text = fill_cuda(original, tasks[:k])
            else:
                names = [name for t in tasks[:k] for name, _ in t.functions]
                text = fill(original, solution, names, starter)
            (lab_copy.path / student_file).write_text(text)
            run = run_lab(lab_copy, "starter", root=copy)
            label = "untouched" if k == 0 else f"task {tasks[k - 1].number}"
            broken = run.broken or any("CANNOT LOAD" in t["message"] for t in run.tests)
            rows.append((label, run.passed, run.total, broken))
            if broken or (k > 0 and run.passed <= previous):
                ok = False
            previous = run.passed
            print(
                f"{label:<10} {run.passed:>4}/{run.total} graded tests pass"
                + ("  <- the run broke" if broken else "")
                + (
                    "  <- no new test passes"
                    if k > 0 and not broken and run.passed <= rows[-2][1]
                    else ""
                ),
                flush=True,
            )
    print("ok: every task adds passing tests" if ok else "FAILED: see the marked rows")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
