"""The starter files as the course publishes them, by content: is a student's lab untouched, and
is the code it gives still the published code?

``published_starters.json`` (beside this file) holds the SHA-256 of every lab's student files as
published. A lab whose student files all still have those digests has not been started, and
nothing needs to run to say so (its untouched starter fails every graded test: `course check`
proves that for every lab).

``published_given.json`` holds, for every lab's ``starter.py``, a digest of each *given*
definition (every function, method, class body and named module-level value that is not a task)
taken from its syntax tree without line numbers or docstrings, so formatting, comments and
docstrings never count. Its ``earlier`` digests are those of earlier published versions (kept
when the file is written anew), which is how ``course upgrade`` tells the course's old code
from a student's edit. The dashboard, ``course engine`` and the grader name the given
definitions a student's starter changed (:func:`given_code_note`).

``tests/test_lab_results.py`` fails when either file no longer matches the starters; after
changing a starter, write both anew with

    python -m course.labs.published
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from course.labs.catalog import REPO_ROOT, Lab, discover
from course.labs.tasks import TASK_MESSAGE_RE, _message, _own_raises

PUBLISHED_PATH = Path(__file__).resolve().parent / "published_starters.json"
GIVEN_PATH = PUBLISHED_PATH.with_name("published_given.json")
# The files of a lab that are the student's: what grading takes from a submission.
STUDENT_FILES = ("starter.py", "starter.cu")


def student_digests(lab: Lab, root: Path | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of the lab's student files that exist (under ``root`` if given)."""
    folder = root / lab.rel if root else lab.path
    digests = {}
    for name in STUDENT_FILES:
        path = folder / name
        if path.is_file():
            digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def load_published(path: Path = PUBLISHED_PATH) -> dict[str, dict[str, str]]:
    """``{lab id: {file name: sha256}}``; empty when the file is missing or unreadable (then no
    lab counts as untouched, and every lab runs: slower, never wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_untouched(lab: Lab, published: dict[str, dict[str, str]] | None = None) -> bool:
    """True when every student file of ``lab`` is byte for byte the published one."""
    published = load_published() if published is None else published
    expected = published.get(lab.id)
    return bool(expected) and student_digests(lab) == expected


def stale_labs(labs: list[Lab], path: Path = PUBLISHED_PATH) -> list[str]:
    """Lab ids whose published digests (file or given code) differ from the starters in this
    checkout."""
    published = load_published(path)
    given = load_given(path.with_name(GIVEN_PATH.name))
    ids = {lab.id for lab in labs}
    stale = [lab.id for lab in labs
             if published.get(lab.id) != student_digests(lab) or not _given_is_current(lab, given)]
    return stale + sorted((set(published) | set(given)) - ids)


def write_published(labs: list[Lab], path: Path = PUBLISHED_PATH,
                    history: dict[str, list[str]] | None = None) -> None:
    """Write both files (``published_given.json`` beside ``path``), keeping the earlier given
    digests of the file written before, plus those of ``history`` (``{lab id: [old sources]}``)."""
    data = {lab.id: student_digests(lab) for lab in labs}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    given_path = path.with_name(GIVEN_PATH.name)
    previous = load_given(given_path)
    given = {}
    for lab in labs:
        starter = lab.path / "starter.py"
        if starter.is_file():
            given[lab.id] = given_record(starter.read_text(encoding="utf-8"), lab.id,
                                         (history or {}).get(lab.id, ()), previous.get(lab.id))
    given_path.write_text(json.dumps(given, indent=1) + "\n", encoding="utf-8")


# --- given code, compared through the syntax tree -----------------------------------------------

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_docstring(node: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def code_digest(node: ast.AST) -> str:
    """A digest of ``node``'s syntax tree without positions and docstrings: two definitions
    have the same digest exactly when they differ at most in layout, comments and docstrings."""
    return hashlib.sha256(_dump(node).encode()).hexdigest()[:16]


def _dump(value) -> str:
    """``ast.dump`` without positions, leaving out every docstring (no copy of the tree) and
    every empty field (None or []) and f-string part (''). Fields a newer Python adds are empty
    in code that does not use them (3.12's ``type_params``), and 3.12 ends some format specs with
    an empty part: so the same code has the same dump on 3.11 to 3.13."""
    if isinstance(value, list):
        return "[" + ", ".join(map(_dump, value)) + "]"
    if not isinstance(value, ast.AST):
        return repr(value)
    fields = []
    for name, field in ast.iter_fields(value):
        if (name == "body" and isinstance(value, (ast.Module, ast.ClassDef, *_DEFS)) and field
                and _is_docstring(field[0])):
            field = field[1:]
        if isinstance(value, ast.JoinedStr):  # 3.12 can end a format spec with Constant('')
            field = [v for v in field if not (isinstance(v, ast.Constant) and v.value == "")]
        if field is None or (isinstance(field, list) and not field):
            continue
        fields.append(f"{name}={_dump(field)}")
    return f"{type(value).__name__}({', '.join(fields)})"


def class_shell(node: ast.ClassDef) -> ast.ClassDef:
    """The class without what is compared one by one (methods, nested classes, named class
    attributes): its decorators, bases and any other class-level statement."""
    shell = copy.copy(node)
    shell.body = [s for s in node.body if statement_key(s) is None] or [ast.Pass()]
    return shell


def statement_key(node: ast.stmt) -> str | None:
    """The name a statement of a module or class body defines: a function's or class's name, or
    the names a plain assignment binds (``__all__``, a constant, a class attribute); None for
    any other statement (imports, the docstring, ``if`` blocks), compared as a whole."""
    if isinstance(node, (*_DEFS, ast.ClassDef)):
        return node.name
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AnnAssign) else [])
    if targets and all(isinstance(t, ast.Name) for t in targets):
        return ",".join(t.id for t in targets)
    return None


def keyed_statements(body: list[ast.stmt]) -> list[tuple[str | None, ast.stmt]]:
    """``(name, statement)`` for each statement of a module or class body; the name is None for
    statements compared as a whole (in a class, those are the class shell's). Named statements
    (definitions, plain assignments) are compared one by one, so a student's added class
    attribute is an addition, not a change. Names are unique: a property's setter is
    ``block_hash.setter``, any other repeat ``name#2``."""
    seen: set[str] = set()
    out = []
    for node in body:
        key = statement_key(node)
        if key in seen:
            accessor = [d.attr for d in getattr(node, "decorator_list", [])
                        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Name)
                        and d.value.id == key]
            base = key = f"{key}.{accessor[0]}" if accessor else key
            n = 2
            while key in seen:
                key, n = f"{base}#{n}", n + 1
        if key is not None:
            seen.add(key)
        out.append((key, node))
    return out


def named_definitions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.stmt]]:
    """``(qualified name, statement)`` for every named statement of a module body, then, for a
    class, every method, class attribute and nested class (``Scheduler.schedule``), in source
    order."""
    for key, node in keyed_statements(body):
        if key is None:
            continue
        yield prefix + key, node
        if isinstance(node, ast.ClassDef):
            yield from named_definitions(node.body, f"{prefix}{key}.")


def definition_digest(node: ast.stmt) -> str:
    """What is compared for one named definition (a class by its shell)."""
    return code_digest(class_shell(node) if isinstance(node, ast.ClassDef) else node)


def task_names(source: str, lab_id: str | None = None) -> set[str]:
    """Names (as :func:`named_definitions` gives them) of the functions and methods that still
    raise a task's NotImplementedError (course.labs.tasks reads the same raises)."""
    names = set()
    for key, node in named_definitions(ast.parse(source).body):
        if isinstance(node, _DEFS) and any(_is_task_raise(r, lab_id) for r in _own_raises(node)):
            names.add(key)
    return names


def _is_task_raise(node: ast.Raise, lab_id: str | None) -> bool:
    m = TASK_MESSAGE_RE.match(_message(node) or "")
    return bool(m) and lab_id in (None, m["lab"])


def given_record(source: str, lab_id: str, earlier_sources=(), previous: dict | None = None
                 ) -> dict:
    """The published record of one starter: ``given`` ({name: digest} of every named definition
    that is not a task, in source order), ``tasks`` (every name that was a task in any published
    version), ``earlier`` ({name: [digests]} of earlier versions' given code that differs from
    today's), ``statements`` (digests of unnamed module statements, today's and earlier) and
    ``task_docs`` ({task name: [digests]} of its docstring in every version: a carried task whose
    docstring is one of them takes today's)."""
    tree = ast.parse(source)
    tasks = task_names(source, lab_id)
    docs = {key: [docstring_digest(node)] for key, node in named_definitions(tree.body)
            if key in tasks and docstring_digest(node)}
    given = {key: definition_digest(node) for key, node in named_definitions(tree.body)
             if key not in tasks}
    statements = [code_digest(n) for n in tree.body
                  if statement_key(n) is None and not _is_docstring(n)]
    earlier: dict[str, list[str]] = {}

    def remember(key: str, digest: str) -> None:
        if given.get(key) != digest and digest not in earlier.setdefault(key, []):
            earlier[key].append(digest)

    previous = previous or {}
    for key, digest in previous.get("given", {}).items():
        remember(key, digest)
    for key, digests in previous.get("earlier", {}).items():
        for digest in digests:
            remember(key, digest)
    all_tasks = tasks | set(previous.get("tasks", ()))
    statements += previous.get("statements", [])

    def remember_docs(more: dict[str, list[str]]) -> None:
        for key, digests in more.items():
            docs[key] = list(dict.fromkeys([*docs.get(key, []), *digests]))

    remember_docs(previous.get("task_docs", {}))
    for old in earlier_sources:
        try:
            old_record = given_record(old, lab_id)
        except (SyntaxError, ValueError):
            continue
        for key, digest in old_record["given"].items():
            remember(key, digest)
        all_tasks |= set(old_record["tasks"])
        statements += old_record["statements"]
        remember_docs(old_record["task_docs"])
    return {
        "given": given,
        "tasks": sorted(all_tasks),
        "earlier": {k: v for k, v in sorted(earlier.items()) if v},
        "statements": list(dict.fromkeys(statements)),
        "task_docs": dict(sorted(docs.items())),
    }


def docstring_digest(node: ast.AST) -> str | None:
    """A digest of a definition's docstring (indentation normalised); None without one."""
    doc = ast.get_docstring(node, clean=True) if isinstance(node, (*_DEFS, ast.ClassDef)) else None
    return hashlib.sha256(doc.encode()).hexdigest()[:16] if doc is not None else None


def load_given(path: Path = GIVEN_PATH) -> dict[str, dict]:
    """``{lab id: record}`` (:func:`given_record`); empty when missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _given_is_current(lab: Lab, given: dict[str, dict]) -> bool:
    starter = lab.path / "starter.py"
    if not starter.is_file():
        return lab.id not in given
    record = given.get(lab.id)
    if not record:
        return False
    current = given_record(starter.read_text(encoding="utf-8"), lab.id)
    return (record.get("given") == current["given"]
            and set(current["tasks"]) <= set(record.get("tasks", ()))
            and set(current["statements"]) <= set(record.get("statements", ()))
            and all(set(v) <= set(record.get("task_docs", {}).get(k, ()))
                    for k, v in current["task_docs"].items()))


def changed_given(lab_id: str, source: str, record: dict | None = None) -> list[str]:
    """The given definitions of the published starter that ``source`` (a student's starter.py)
    changes or lacks, in the published order; [] when the lab has no record or the source does
    not parse (its tests say so)."""
    record = load_given().get(lab_id) if record is None else record
    if not record:
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    mine = dict(named_definitions(tree.body))
    changed = []
    for key, digest in record.get("given", {}).items():
        if key not in mine:
            changed.append(f"{key} (missing)")
        elif definition_digest(mine[key]) != digest:
            changed.append(key)
    return changed


def given_code_note(lab_id: str, source: str, record: dict | None = None) -> str | None:
    """One line naming the given code a student's starter changed, and the imports of
    mini_vllm's old layout it still makes (:mod:`course.labs.moves`), and what to do; None when
    there are neither."""
    from course.labs.moves import old_imports

    changed = changed_given(lab_id, source, record)
    moved = old_imports(source)
    if not changed and not moved:
        return None
    said = []
    if changed:
        said.append(f"given code changed: {', '.join(changed)}")
    if moved:
        said.append("starter.py imports mini_vllm's old layout: " + ", ".join(
            f"{old} (now {new})" for old, new in dict(moved).items()))
    return f"lab {lab_id}: {'; '.join(said)} -- run `python -m course upgrade {lab_id}`"


def lab_given_note(lab: Lab) -> str | None:
    """:func:`given_code_note` for the lab's starter.py in this checkout."""
    starter = lab.path / "starter.py"
    if not starter.is_file():
        return None
    return given_code_note(lab.id, starter.read_text(encoding="utf-8", errors="replace"))


def _git_history(lab: Lab) -> list[str]:
    """Every committed version of the lab's starter.py in this checkout's history, newest
    first (the course's own repository: each of them was published)."""
    rel = f"{lab.rel}/starter.py"
    log = subprocess.run(["git", "log", "--format=%H", "--", rel], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    sources = []
    for commit in log.stdout.split():
        show = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=REPO_ROOT,
                              capture_output=True, text=True)
        if show.returncode == 0:
            sources.append(show.stdout)
    return sources


if __name__ == "__main__":
    labs = discover(REPO_ROOT)
    # --from-git: also take earlier given code from every committed version of each starter.
    history = {lab.id: _git_history(lab) for lab in labs} if "--from-git" in sys.argv else None
    write_published(labs, history=history)
    print(f"wrote {PUBLISHED_PATH.relative_to(REPO_ROOT)} and {GIVEN_PATH.name}: the student "
          f"files of {len(labs)} labs")
