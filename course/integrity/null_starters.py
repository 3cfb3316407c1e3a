"""Null starters: a lab's published starter with every task body emptied, in four ways.

A graded test must not pass when the student wrote nothing of substance. The untouched starter
raises `NotImplementedError` everywhere, which fails every test that calls a task; but a body of
`pass`, or one that hands its input back, can still pass a test that only checks that bad input
"changes nothing". So `course check` also runs each lab's tests on these variants of its starter,
each with every task body replaced by the same null body:

- ``pass``: the body does nothing;
- ``return-none``: it returns None;
- ``return-first``: it returns its first argument (the first parameter after self/cls, None when
  there is none; a constructor can only return None);
- ``raise``: it raises ``RuntimeError("null starter")`` (an error, but not the documented one).

A generator task (lab 03-05's async generators) stays a generator: "pass" yields nothing, the two
"return" variants yield their value once (what a generator gives back is what it yields), and
"raise" raises when it is first iterated.

Only the bodies change: the docstring, the signature and every other byte of the file stay as
published (the edit is spliced into the source text, not unparsed), so the variant imports as the
starter does. A task body is that of every function or method inside the published tasks
(:func:`course.grading.grader.published_tasks`) whose own statements raise NotImplementedError.

The digest of this file is part of the record `course check` keeps of the variants' results
(course/integrity/null_check.py): changing how variants are made reruns every lab.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from course.grading.grader import published_tasks

VARIANTS = {
    "pass": "every task body is `pass`",
    "return-none": "every task body returns None",
    "return-first": "every task body returns its first argument",
    "raise": 'every task body raises RuntimeError("null starter")',
}
NULL_MESSAGE = "null starter"


@dataclass(frozen=True)
class TaskBody:
    """One function or method whose body the student writes."""

    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    first_arg: str | None  # the first parameter after self/cls, or None
    generator: bool  # its own body yields (so the null body must yield too)


def task_bodies(source: str) -> list[TaskBody]:
    """The functions and methods of a starter whose published body raises NotImplementedError,
    inside the names :func:`published_tasks` lists, in source order."""
    tree = ast.parse(source)
    tasks = set(published_tasks(source))
    found: list[TaskBody] = []
    for node in tree.body:
        if getattr(node, "name", None) in tasks:
            found.extend(_bodies_in(node, "", in_class=False))
    return sorted(found, key=lambda t: t.node.lineno)


def _bodies_in(node: ast.AST, prefix: str, in_class: bool):
    if isinstance(node, ast.ClassDef):
        for child in node.body:
            yield from _bodies_in(child, f"{prefix}{node.name}.", in_class=True)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if _raises_not_implemented(node):
            yield TaskBody(f"{prefix}{node.name}", node, _first_arg(node, in_class),
                           _is_generator(node))


def _own_statements(func: ast.AST):
    """Every node of ``func``'s own body, not of functions, lambdas or classes nested in it."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _raises_not_implemented(func: ast.AST) -> bool:
    for node in _own_statements(func):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if name == "NotImplementedError":
                return True
    return False


def _is_generator(func: ast.AST) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_statements(func))


def _first_arg(func: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> str | None:
    if func.name == "__init__":
        return None  # a constructor returns None whatever it does
    args = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)
    if in_class and not static:
        args = args[1:]  # self or cls
    args += [a.arg for a in func.args.kwonlyargs]
    return args[0] if args else None


def null_body(task: TaskBody, variant: str) -> list[str]:
    """The statements (one per line, unindented) that replace ``task``'s body."""
    value = task.first_arg if variant == "return-first" and task.first_arg else "None"
    still = "yield  # a generator still"
    if variant == "raise":
        return [f"raise RuntimeError({NULL_MESSAGE!r})", *([still] if task.generator else [])]
    if task.generator:
        if variant == "pass":
            return ["return", f"{still}, one that yields nothing"]
        return [f"yield {value}"]
    if variant == "pass":
        return ["pass"]
    if variant in ("return-none", "return-first"):
        return [f"return {value}"]
    raise ValueError(f"unknown null variant {variant!r}; one of {', '.join(VARIANTS)}")


def null_variant(source: str, variant: str) -> str:
    """``source`` with every task body replaced by ``variant``'s null body; its docstring and
    every other line stay as they are."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown null variant {variant!r}; one of {', '.join(VARIANTS)}")
    data = source.encode("utf-8")  # ast's column offsets count UTF-8 bytes
    line_starts = [0]
    for line in data.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    edits = []
    for task in task_bodies(source):
        body = task.node.body
        if _is_docstring(body[0]):
            body = body[1:]
        if not body:
            continue  # nothing but a docstring: nothing to replace
        first, last = body[0], body[-1]
        if first.lineno == task.node.lineno:
            raise ValueError(f"{task.qualname}: its body must start on a line of its own")
        indent = " " * first.col_offset
        text = ("\n" + indent).join(null_body(task, variant))
        start = line_starts[first.lineno - 1] + first.col_offset
        # To the end of the body's last line: what follows its last statement there is a
        # comment about the code being replaced.
        end = line_starts[last.end_lineno] - len(_newline(data, line_starts[last.end_lineno]))
        edits.append((start, end, text.encode("utf-8")))
    for start, end, text in sorted(edits, reverse=True):  # from the end: offsets stay valid
        data = data[:start] + text + data[end:]
    result = data.decode("utf-8")
    compile(result, "<null starter>", "exec")  # a variant must still be valid Python
    return result


def null_variants(source: str) -> dict[str, str]:
    """``{variant: source}`` for every variant; empty when the starter has no task body."""
    if not task_bodies(source):
        return {}
    return {variant: null_variant(source, variant) for variant in VARIANTS}


def _newline(data: bytes, end: int) -> bytes:
    """The line ending just before offset ``end`` (empty at the end of a file without one)."""
    for ending in (b"\r\n", b"\n", b"\r"):
        if data[:end].endswith(ending):
            return ending
    return b""


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))
