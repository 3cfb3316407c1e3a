"""A failed assertion in a lab's tests names the rule it checks and the student's code (a pytest
plugin; the root conftest.py loads it).

pytest explains a bare ``assert x == y`` by its values (``assert (2, 1) == (1, 1)``): what
differed, but not which rule that breaks nor which of the student's functions to open. For a
failure in a lab's test file this plugin puts one line above pytest's explanation:

    broken: <the invariant>; look at your <function> (starter.py:<line>), ...

- the invariant is the first sentence of the test's docstring, else the test's name read as a
  sentence (``test_fork_counts_every_holder`` -> "fork counts every holder"); when the failing
  line sits in a helper of the test file (a simulator's check, a state machine's rule), that
  helper is named too. The course's tests are named as sentences for this
  (``tests/test_lab_assertions.py`` keeps it so: a bare ``assert`` only directly in a test, every
  other assertion with a message of its own);
- the student's function is the deepest frame of the traceback in a task of the lab's
  ``starter.py`` when the failure came out of it; otherwise the tasks of ``starter.py`` that the
  failing test reaches (its calls, those of the test file's helpers it calls, and those that the
  reached starter functions call), the ones in the failing statement first, then the latest
  called before it. The tasks are the functions the published starter leaves to the student,
  recorded in ``task_functions.json`` beside this file (``python -m course.labs.assertions``
  writes it anew; ``tests/test_lab_assertions.py`` fails when it is stale).

The same goes for pytest's ``Failed`` (``pytest.raises``'s "DID NOT RAISE"). An assertion that
carries a message of its own keeps it as its first line, and gets
``(the test: <invariant>; look at your ...)`` on the line after it. Nothing runs for a passing
test: the work happens once per failure, and a file is parsed once per run.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT, Lab, discover, lab_for_path
from course.labs.tasks import tasks_in_source

MAX_FUNCTIONS = 3  # student functions named in the line; more reached ones are counted
Frames = list[tuple[str, int, str]]  # (file, line, function) of each traceback entry
# The task functions of every lab's starter as published ({lab id: [qualified names]}): a
# student's starter no longer marks the tasks it has done, and only those are "your" code.
TASKS_PATH = Path(__file__).resolve().parent / "task_functions.json"


def published_task_functions(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """``{lab id: [qualified names]}`` of the functions each starter leaves to the student."""
    found = {}
    for lab in discover(root):
        starter = lab.path / "starter.py"
        if starter.is_file():
            tasks = tasks_in_source(starter.read_text(encoding="utf-8"), lab.id)
            names = sorted({name for task in tasks for name, _ in task.functions})
            if names:
                found[lab.id] = names
    return found


@lru_cache(maxsize=1)
def _task_table() -> dict[str, frozenset[str]]:
    try:
        data = json.loads(TASKS_PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {lab_id: frozenset(names) for lab_id, names in data.items()}


# ---------------------------------------------------------------------------------------------
# What a source file defines and calls (parsed once per file and run)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Function:
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def lines(self) -> range:
        return range(self.node.lineno, (self.node.end_lineno or self.node.lineno) + 1)


@dataclass
class _Module:
    functions: list[_Function] = field(default_factory=list)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)

    def by_name(self, name: str) -> list[_Function]:
        """Functions and methods whose own name is `name` (any class)."""
        return [f for f in self.functions if f.qualname.rsplit(".", 1)[-1] == name]

    def innermost_at(self, lineno: int) -> _Function | None:
        """The innermost function whose body holds line `lineno`."""
        holding = [f for f in self.functions if lineno in f.lines]
        return max(holding, key=lambda f: f.node.lineno, default=None)


def _walk_defs(tree: ast.AST, prefix: str, module: _Module) -> None:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = f"{prefix}{node.name}"
            module.functions.append(_Function(qual, node))
            _walk_defs(node, f"{qual}.", module)
        elif isinstance(node, ast.ClassDef):
            module.classes.setdefault(node.name, node)
            _walk_defs(node, f"{prefix}{node.name}.", module)


@lru_cache(maxsize=64)
def _parse(path: str, mtime: float) -> _Module:
    module = _Module()
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return module
    _walk_defs(tree, "", module)
    return module


def _module(path: Path) -> _Module:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return _Module()
    return _parse(str(path), mtime)


_CONTAINERS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
_CONTAINER_CALLS = {"list", "dict", "set", "sorted", "tuple", "Counter", "defaultdict"}


def _plain_containers(node: ast.AST) -> set[str]:
    """Names assigned a list, dict or set in `node`: ``rows.append(x)`` on one of them is not a
    call into the lab's code, whatever the method's name."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub.value is not None:
            value = sub.value
            is_container = isinstance(value, _CONTAINERS) or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id in _CONTAINER_CALLS
            )
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            if is_container:
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _calls(node: ast.AST) -> list[tuple[int, str]]:
    """(line, called name) of every call under `node`, in source order: ``f(...)`` gives f,
    ``x.y.f(...)`` gives f, ``Cls(...)`` gives Cls, and so does ``lab.f`` uncalled (the lab
    module's name in every test file); a method of a plain list, dict or set that `node` builds
    is left out."""
    containers = _plain_containers(node)
    found = []
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "lab"
        ):  # `lab.fn` handed on uncalled (make = lab.get_hasher; make(...)) still reaches it
            found.append((sub.lineno, sub.attr))
        elif isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if func.value.id in containers:
                    continue
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name:
                found.append((sub.lineno, name))
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# The invariant and the student's functions of one failure
# ---------------------------------------------------------------------------------------------


def sentence(test_name: str) -> str:
    """``test_fork_counts_every_holder`` -> "fork counts every holder"."""
    return test_name.removeprefix("test_").replace("_", " ").strip()


def _test_function(item) -> tuple[str, str]:
    """(name, docstring first line) of the test an item runs; a Hypothesis state machine's
    ``TestCase`` (collected as ``runTest``) is named by the variable that holds it and
    described by the machine's docstring."""
    name = item.originalname if hasattr(item, "originalname") else item.name
    obj = getattr(item, "obj", None)
    doc = getattr(obj, "__doc__", None) or ""
    if name == "runTest" and item.parent is not None:
        name = item.parent.name
        cls = getattr(item, "cls", None)
        # Hypothesis's TestCase class is built per machine; the machine is its enclosing class.
        machine = getattr(cls, "__qualname__", "").split(".TestCase")[0].split(".")[-1]
        module = getattr(item, "module", None)
        doc = getattr(getattr(module, machine, None), "__doc__", None) or ""
    return name, first_sentence(doc)


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (of its first paragraph), on one line, without its stop."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    head, stop, _ = paragraph.partition(". ")
    return head if stop else paragraph.rstrip(".")


def invariant_of(item, tb_frames: Frames) -> str:
    """The rule a failing test checks, in words; with the helper of the test file that holds the
    failing line when it is not the test itself."""
    name, doc = _test_function(item)
    words = doc or sentence(name)
    test_file = str(item.path)
    in_file = [f for f in tb_frames if f[0] == test_file]
    if in_file:
        filename, lineno, func_name = in_file[-1]
        if func_name not in (name, getattr(item, "name", ""), "runTest"):
            helper = _module(Path(filename)).innermost_at(lineno)
            label = helper.qualname if helper else func_name
            words += f" (checked in {label})"
    return words


def _starter_path(lab: Lab) -> Path:
    return lab.path / "starter.py"


def student_functions(
    item, lab: Lab, tb_frames: Frames, cause_frames: Frames | None = None
) -> list[str]:
    """The functions of the lab's starter.py this failure points at, most likely first, each as
    ``Qual.name (starter.py:LINE)``. ``cause_frames``: the traceback of the error the test turned
    into this one (``raise AssertionError(...) from exc``), searched for the student's line too."""
    starter = _starter_path(lab)
    mod = _module(starter)
    if not mod.functions:
        return []
    tasks = _task_table().get(lab.id)
    if tasks is None:
        # Not in the table: a CUDA lab, whose tasks are kernels in starter.cu (its starter.py is
        # given code), or a lab the table does not know yet (every function of its starter).
        cuda = (lab.path / "starter.cu").is_file()
        tasks = frozenset() if cuda else frozenset(f.qualname for f in mod.functions)
    label = {f.qualname: f"{f.qualname} ({starter.name}:{f.node.lineno})" for f in mod.functions}
    ranked: list[str] = []
    # 1. The failure came out of the student's own code: the deepest frame in a task there
    # (else in the starter's given code).
    in_starter = [
        (func, lineno)
        for filename, lineno, _ in [*(cause_frames or []), *tb_frames]
        if _same_file(filename, starter) and (func := mod.innermost_at(lineno)) is not None
    ]
    if in_starter:
        func, lineno = ([f for f in in_starter if f[0].qualname in tasks] or in_starter)[-1]
        ranked.append(f"{func.qualname} ({starter.name}:{lineno})")
    # 2. What the test reaches, read from the test file and the starter.
    test_file = str(item.path)
    in_file = [f for f in tb_frames if f[0] == test_file]
    test_mod = _module(Path(test_file))
    test_name = _test_function(item)[0]
    roots = test_mod.by_name(test_name) or []
    if not roots and in_file:
        holder = test_mod.innermost_at(in_file[0][1])
        roots = [holder] if holder else []
    # The line of the test itself that failed (or called the helper that failed).
    in_root = [f for f in in_file if f[2] in {r.node.name for r in roots}]
    failing_line = in_root[-1][1] if in_root else 0
    for qual in _reached(roots, failing_line, test_mod, mod):
        if qual in tasks and not any(r.split(" (", 1)[0] == qual for r in ranked):
            ranked.append(label[qual])
    return ranked


def _same_file(filename: str, path: Path) -> bool:
    return filename == str(path) or Path(filename).resolve() == path.resolve()


def _reached(roots: list[_Function], failing_line: int, test_mod: _Module,
             starter_mod: _Module) -> list[str]:
    """Starter functions (qualified names) reached from the test functions `roots`: first those
    called on the failing line, then those called before it (latest first), then after it."""
    scored: dict[str, tuple[int, int]] = {}  # qualname -> (rank class, order)
    seen_helpers: set[str] = set()

    def visit(func: _Function, rank_of) -> None:
        for lineno, name in _calls(func.node):
            rank = rank_of(lineno)
            for target in starter_mod.by_name(name) or _constructors(name, starter_mod):
                _note(target.qualname, rank)
                if target.qualname not in seen_helpers:  # given code calling the tasks
                    seen_helpers.add(target.qualname)
                    visit(target, lambda _line, r=rank: r)
            for helper in test_mod.by_name(name):
                if helper.qualname not in seen_helpers:
                    seen_helpers.add(helper.qualname)
                    visit(helper, lambda _line, r=rank: r)

    def _note(qual: str, rank: tuple[int, int]) -> None:
        if qual not in scored or rank < scored[qual]:
            scored[qual] = rank

    def rank_in_test(lineno: int) -> tuple[int, int]:
        if lineno == failing_line:
            return (0, 0)
        if lineno < failing_line:
            return (1, failing_line - lineno)  # the latest call before the failure first
        return (2, lineno)

    for root in roots:
        seen_helpers.add(root.qualname)
        visit(root, rank_in_test)
    return sorted(scored, key=lambda q: scored[q])


def _constructors(name: str, mod: _Module) -> list[_Function]:
    """``Cls(...)`` runs ``Cls.__init__`` when the starter defines one."""
    if name not in mod.classes:
        return []
    return [f for f in mod.functions if f.qualname == f"{name}.__init__"]


def where_to_look(
    item, lab: Lab, tb_frames: Frames, cause_frames: Frames | None = None
) -> str:
    """"look at your F (starter.py:L), G (...)", or "" when the test reaches none."""
    functions = student_functions(item, lab, tb_frames, cause_frames)
    if not functions:
        return ""
    shown = ", ".join(functions[:MAX_FUNCTIONS])
    more = len(functions) - MAX_FUNCTIONS
    return f"look at your {shown}" + (f" (and {more} more the test calls)" if more > 0 else "")


# ---------------------------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------------------------


def _frames(tb) -> Frames:
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return frames


def _lab_of(item) -> Lab | None:
    path = Path(str(getattr(item, "path", "")))
    if not path.name.startswith("test_"):
        return None
    try:
        return lab_for_path(path)
    except ValueError:
        return None


def annotate(item, exc: BaseException) -> None:
    """Put the invariant and the student's functions into `exc`'s message (once): an
    AssertionError, or pytest's Failed (``pytest.raises``'s "DID NOT RAISE", ``pytest.fail``)."""
    if getattr(exc, "_course_explained", False) or len(exc.args) > 1:
        return
    lab = _lab_of(item)
    if lab is None:
        return
    frames = _frames(exc.__traceback__)
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    cause_frames = _frames(cause.__traceback__) if cause is not None else []
    invariant = invariant_of(item, frames)
    where = where_to_look(item, lab, frames, cause_frames)
    message = str(exc.args[0]) if exc.args and exc.args[0] is not None else ""
    if not message or message.startswith("assert "):  # a bare assert: pytest's values follow
        line = f"broken: {invariant}" + (f"; {where}" if where else "")
        text = f"{line}\n{message}" if message else line
    else:  # the test's own message stays first
        first, _, rest = message.partition("\n")
        line = f"(the test: {invariant}" + (f"; {where})" if where else ")")
        text = "\n".join(p for p in (first, line, rest) if p)
    exc.args = (text,)
    if isinstance(exc, pytest.fail.Exception):
        exc.msg = text  # what pytest prints for it
    exc._course_explained = True


def _excinfo(item, call):
    if call.excinfo is not None:
        return call.excinfo
    pending = getattr(item, "_excinfo", None)  # a unittest-style item (a state machine)
    return pending[0] if call.when == "call" and pending else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Before any report of a failed call is made (or rendered): explain its assertion."""
    if call.when == "call":
        excinfo = _excinfo(item, call)
        if (
            excinfo is not None
            and isinstance(excinfo.value, (AssertionError, pytest.fail.Exception))
            and not isinstance(excinfo.value, pytest.xfail.Exception)  # a Failed, not a failure
        ):
            try:
                annotate(item, excinfo.value)
            except Exception:  # a courtesy: never lose the failure over its explanation
                pass
    return (yield)


if __name__ == "__main__":
    TASKS_PATH.write_text(
        json.dumps(published_task_functions(), indent=1, sort_keys=True) + "\n", encoding="utf-8"
    )
    print(f"wrote {TASKS_PATH.relative_to(REPO_ROOT)}: the task functions of every lab's starter")
