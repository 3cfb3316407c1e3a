"""The tasks of a lab, read from its starter's source (nothing is imported or run).

A task is every function of `starter.py` whose body still raises the course's
`NotImplementedError("lab PP-LL, task N: ...")`; a CUDA starter (`starter.cu`) marks a task as
open with `#define LAB_TASK_N_DONE 0`. Reading the source, rather than collecting the errors that
tests happened to raise, lists every task, also those that no test reached yet.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from course.labs.catalog import Lab

# The prefix that tooling parses: "lab 02-01, task 3: implement BlockPool.touch (...)".
TASK_MESSAGE_RE = re.compile(r"lab (?P<lab>\d\d-\d\d), task (?P<task>\d+): (?P<what>.*)", re.S)
# What a converted starter's message ends with; the task list gives the command on its own.
_HINT_SUFFIX_RE = re.compile(r"\s*\(hint: python -m course hint [^)]*\)\s*$")
_CU_OPEN_RE = re.compile(r"^#define\s+LAB_TASK_(\d+)_DONE\s+0\b(?:\s*//\s*(.*))?$", re.M)
_CU_TODO_RE = re.compile(r"TODO\(lab (\d\d-\d\d), task (\d+)\):\s*(.*)")


@dataclass
class Task:
    """One numbered task of a lab that the starter still leaves to the student."""

    lab_id: str
    number: int
    what: str  # the message of the first function's error, without the "lab, task" prefix
    functions: list[tuple[str, int]] = field(default_factory=list)  # (qualified name, line)
    file: str = "starter.py"

    @property
    def names(self) -> str:
        return ", ".join(name for name, _ in self.functions)

    @property
    def line(self) -> int:
        return self.functions[0][1] if self.functions else 0


def _message(node: ast.Raise) -> str | None:
    """The string passed to `raise NotImplementedError("...")`, or None for any other raise."""
    exc = node.exc
    if not isinstance(exc, ast.Call) or not exc.args:
        return None
    func = exc.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name != "NotImplementedError":
        return None
    arg = exc.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):  # an f-string: keep its literal parts
        return "".join(v.value for v in arg.values if isinstance(v, ast.Constant))
    return None


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, function node) for every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = f"{prefix}{node.name}"
            yield qual, node
            yield from _functions(node, f"{qual}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _own_raises(func: ast.AST):
    """The raise statements of `func` itself, not of functions or classes nested in it."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Raise):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def tasks_in_source(source: str, lab_id: str | None = None) -> list[Task]:
    """The open tasks in a starter's Python source, in task order (then source order)."""
    tree = ast.parse(source)
    tasks: dict[int, Task] = {}
    for qual, func in _functions(tree):
        for node in sorted(_own_raises(func), key=lambda n: n.lineno):
            message = _message(node)
            m = TASK_MESSAGE_RE.match(message or "")
            if not m or (lab_id is not None and m["lab"] != lab_id):
                continue
            number = int(m["task"])
            what = _HINT_SUFFIX_RE.sub("", " ".join(m["what"].split()))
            task = tasks.setdefault(number, Task(m["lab"], number, what))
            task.functions.append((qual, node.lineno))
            break
    return [tasks[n] for n in sorted(tasks)]


def tasks_in_cuda_source(source: str, lab_id: str) -> list[Task]:
    """The open tasks of a CUDA starter: each `#define LAB_TASK_N_DONE 0`, described by its
    `TODO(lab PP-LL, task N): ...` comment."""
    todos = {}
    for i, line in enumerate(source.splitlines(), 1):
        m = _CU_TODO_RE.search(line)
        if m and m[1] == lab_id:
            todos.setdefault(int(m[2]), (m[3].strip(), i))
    tasks = []
    for m in _CU_OPEN_RE.finditer(source):
        number = int(m[1])
        what, line = todos.get(number, (m[2] or "", source.count("\n", 0, m.start()) + 1))
        name = (m[2] or "").strip() or f"task {number}"
        tasks.append(Task(lab_id, number, what, [(name, line)], file="starter.cu"))
    return sorted(tasks, key=lambda t: t.number)


def open_tasks(lab: Lab) -> list[Task]:
    """Every task the lab's starter files still leave open, in task order."""
    tasks: dict[int, Task] = {}
    starter = lab.path / "starter.py"
    if starter.is_file():
        try:
            for t in tasks_in_source(starter.read_text(encoding="utf-8"), lab.id):
                tasks[t.number] = t
        except SyntaxError:
            pass  # the test run reports the starter that does not parse
    cuda = lab.path / "starter.cu"
    if cuda.is_file():
        for t in tasks_in_cuda_source(cuda.read_text(encoding="utf-8"), lab.id):
            tasks.setdefault(t.number, t)
    return [tasks[n] for n in sorted(tasks)]


def readme_section(lab: Lab, number: int) -> tuple[int, str] | None:
    """(line, heading) of the README passage that explains task `number`: a heading that names
    the task ("### Task 3: ..."), else item `number.` of the list under the first heading that
    starts with "Task"."""
    readme = lab.path / "README.md"
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8").splitlines()
    heading_re = re.compile(r"^#+\s+(.*)$")
    for i, line in enumerate(lines, 1):
        m = heading_re.match(line)
        if m and re.match(rf"Task\s+{number}\b", m[1]):
            return i, m[1].strip()
    in_tasks, heading = False, ""
    for i, line in enumerate(lines, 1):
        m = heading_re.match(line)
        if m:
            in_tasks = m[1].strip().lower().startswith("task")
            heading = m[1].strip()
            continue
        if in_tasks and re.match(rf"{number}\.\s", line):
            return i, heading
    return None


def unfinished_tasks(lab: Lab, root: Path | None = None) -> list[str]:
    """The task messages still raised by the lab's starter ("lab 02-01, task 5: ..."), read from
    its source without importing it."""
    import ast

    path = (root / lab.rel if root else lab.path) / "starter.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name) and func.id == "NotImplementedError" and node.exc.args:
                arg = node.exc.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value.startswith(f"lab {lab.id}, task "):
                        found.append(arg.value)

    def task_number(message: str) -> int:
        digits = message.split(", task ", 1)[1].split(":", 1)[0]
        return int(digits) if digits.isdigit() else 1 << 30

    return sorted(dict.fromkeys(found), key=task_number)
