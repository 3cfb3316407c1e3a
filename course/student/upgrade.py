"""``python -m course upgrade PP-LL``: carry your work onto the course's current starter.

When the course updates a starter during the term, the code it *gives* (complete functions and
methods, class bodies, ``__all__``) changes, and a starter you began earlier keeps the old given
code: its lab's tests may still pass while the composed engine never calls your newer pieces.
The dashboard, ``course engine`` and the grader name such changes
(:func:`course.labs.published.given_code_note`); this command mends them.

It works through the syntax tree, definition by definition, on the text of the current published
starter (found in the checkout's git history by its published SHA-256):

- a task you wrote (a definition that raises the course's ``NotImplementedError`` in the
  published starter) is carried over with its text, comments included; a task you have not
  written yet takes the new starter's stub;
- given code comes from the new starter when yours is the course's code (today's, or an earlier
  published version's: ``published_given.json`` keeps their digests);
- your own additions (helpers, imports, methods) are kept, after the statement they followed;
- never a guess, never a dropped line of yours: a given definition you changed, a task you wrote
  that the new starter no longer has (or now gives), is a *conflict*. Then starter.py is left as
  it is and ``starter.py.merge`` holds the merge with each conflict between ``<<<<<<<`` markers.

An upgrade keeps the file it replaces as ``starter.py.before-upgrade`` (numbered when it exists).

A starter begun before mini_vllm was laid out in packages (``mini_vllm.scheduler`` became
``mini_vllm.core.sched.scheduler``) imports the old paths: the course's own imports come from the
new starter like any given code, and an import the student added is rewritten to where its names
are now (:mod:`course.labs.moves`).
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from course.labs.catalog import REPO_ROOT, Lab
from course.labs.moves import old_imports, rewrite_imports
from course.labs.published import (
    code_digest,
    definition_digest,
    docstring_digest,
    keyed_statements,
    load_given,
    load_published,
    task_names,
)


class UpgradeError(Exception):
    """Bad input (no published starter to upgrade to, a starter that does not parse): one line,
    and nothing was written."""


@dataclass
class Merge:
    """The result of carrying a student's starter onto a new one."""

    text: str  # the merged starter (conflicts between markers when there are any)
    carried: list[str] = field(default_factory=list)  # tasks written by the student
    updated: list[str] = field(default_factory=list)  # given code the new starter replaced
    kept: list[str] = field(default_factory=list)  # the student's own additions
    added: list[str] = field(default_factory=list)  # definitions only the new starter has
    conflicts: list[str] = field(default_factory=list)  # "name: why"
    # A carried task whose docstring now names calls its body never makes: (task, names).
    uncalled: list[tuple[str, list[str]]] = field(default_factory=list)


# --- the merge, on text, guided by the two syntax trees ----------------------------------------


def _span(node: ast.stmt, lines: list[str], with_comments: bool = True) -> tuple[int, int]:
    """1-based inclusive lines of ``node``: decorators included and, with ``with_comments``,
    the comment lines directly above it (they belong to it)."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    if with_comments:
        while start > 1 and lines[start - 2].lstrip().startswith("#"):
            start -= 1
    return start, node.end_lineno


def _reindent(block: list[str], delta: int) -> list[str]:
    if delta > 0:
        return [(" " * delta + line) if line.strip() else line for line in block]
    if delta < 0:
        cut = -delta
        return [line[cut:] if line[:cut].strip() == "" else line.lstrip() for line in block]
    return block


def _signature(node: ast.stmt) -> str:
    """A function's kind, decorators, parameters and return annotation, without positions."""
    parts = [type(node).__name__, *getattr(node, "decorator_list", []),
             getattr(node, "args", None), getattr(node, "returns", None)]
    return "|".join(ast.dump(p) if isinstance(p, ast.AST) else str(p) for p in parts)


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


# A call a docstring names as code: ``self._with_logprobs(output, hidden, meta)``, ``helper(x)``.
_CALLS_IN_DOC = re.compile(r"``(?:self\.)?(\w+)\(")


class _Merger:
    def __init__(self, student: str, new: str, lab_id: str, record: dict):
        self.s_lines, self.n_lines = student.splitlines(), new.splitlines()
        try:
            self.s_tree = ast.parse(student)
        except (SyntaxError, ValueError) as exc:
            line = getattr(exc, "lineno", None)
            where = f" (line {line})" if line else ""
            hint = (" It holds git's conflict markers: take your side with `git checkout --ours "
                    "<starter.py>`, then run the upgrade again."
                    if "<<<<<<<" in student else "")
            raise UpgradeError(f"your starter.py does not parse{where}: {exc}; fix it first, "
                               f"nothing changed.{hint}") from None
        self.n_tree = ast.parse(new)
        self.s_tasks = task_names(student, lab_id)
        self.n_tasks = task_names(new, lab_id)
        self.record = record
        self.earlier = record.get("earlier", {})
        self.ever_tasks = set(record.get("tasks", ())) | self.n_tasks
        self.statements = set(record.get("statements", ()))
        # N line -> blocks to insert after it; (start, end) of N -> replacement lines.
        self.inserts: dict[int, list[list[str]]] = {}
        self.replaces: dict[tuple[int, int], list[str]] = {}
        self.carried_nodes: list[tuple[str, ast.stmt, ast.stmt]] = []
        self.result = Merge("")

    # what to write ------------------------------------------------------------------------

    def _text(self, node: ast.stmt, indent: int, skip_comments: set[str] = frozenset()):
        start, end = _span(node, self.s_lines)
        block = self.s_lines[start - 1:end]
        lead = 0
        while lead < len(block) and block[lead].lstrip().startswith("#") and (
                block[lead].strip() in skip_comments):
            lead += 1
        return _reindent(block[lead:], indent - node.col_offset)

    def _with_new_docstring(self, name: str, s: ast.stmt, n: ast.stmt, yours: list[str]
                            ) -> list[str]:
        """``yours`` (the student's task, re-indented) with today's docstring when theirs is a
        published one (the contract may have changed); a docstring they edited stays."""
        s_doc, n_doc = s.body[0], n.body[0]
        if not (_is_docstring(s_doc) and _is_docstring(n_doc)):
            return yours
        if docstring_digest(s) not in self.record.get("task_docs", {}).get(name, ()):
            return yours
        # Where the docstring is in ``yours``: counted back from the end, since comment lines
        # above the definition may have been left out of it.
        header = len(yours) - (s.end_lineno - _span(s, self.s_lines, False)[0] + 1)
        start = header + s_doc.lineno - _span(s, self.s_lines, False)[0]
        end = start + s_doc.end_lineno - s_doc.lineno + 1
        new_doc = self.n_lines[n_doc.lineno - 1:n_doc.end_lineno]
        return yours[:start] + new_doc + yours[end:]

    def _conflict(self, name: str, why: str, yours: list[str], theirs: list[str]) -> list[str]:
        self.result.conflicts.append(f"{name}: {why}")
        return (["<<<<<<< yours (starter.py before the upgrade): " + why, *yours, "=======",
                 *theirs, ">>>>>>> the published starter"])

    def _insert(self, after: int, block: list[str], in_class: bool, blank: bool = True) -> None:
        """Add ``block`` after line ``after`` of the new starter (after what is there already),
        set off by blank lines when ``blank`` (a definition)."""
        gap = (1 if in_class else 2) if blank else 0
        self.inserts.setdefault(after, []).append([""] * gap + block)

    # the walk ------------------------------------------------------------------------------

    def merge(self) -> Merge:
        self._body(self.s_tree.body, self.n_tree.body, "", in_class=False, n_indent=0,
                   start_after=self._module_head())
        self._trailing_comments()
        out = list(self.n_lines)
        edits = [(s, e, lines) for (s, e), lines in self.replaces.items()]
        edits += [(after + 1, after, [ln for b in blocks for ln in b])
                  for after, blocks in self.inserts.items()]
        for start, end, lines in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
            out[start - 1:end] = lines
        self.result.text = "\n".join(out) + "\n"
        self._check_comments()
        self._uncalled_helpers()
        return self.result

    def _uncalled_helpers(self) -> None:
        """A task carried over from before its contract named a call it relies on (lab 03-04's
        docstrings added the given ``self._with_logprobs(...)``): the old body cannot know to
        make it, and the upgrade cannot write it, so it says which calls are missing."""
        for name, s, n in self.carried_nodes:
            named = set(_CALLS_IN_DOC.findall(ast.get_docstring(n) or ""))
            named -= set(_CALLS_IN_DOC.findall(ast.get_docstring(s) or ""))
            used = {node.attr for node in ast.walk(s) if isinstance(node, ast.Attribute)}
            used |= {node.id for node in ast.walk(s) if isinstance(node, ast.Name)}
            if named - used:
                self.result.uncalled.append((name, sorted(named - used)))

    def _module_head(self) -> int:
        """The last line of the new starter's docstring and ``__future__`` imports: where an
        addition of the student's with nothing of the course's before it goes."""
        last = 0
        for node in self.n_tree.body:
            if _is_docstring(node) or (isinstance(node, ast.ImportFrom)
                                       and node.module == "__future__"):
                last = node.end_lineno
            else:
                break
        return last

    def _body(self, s_body, n_body, prefix: str, in_class: bool, n_indent: int,
              start_after: int) -> None:
        n_named = {}
        n_digests = {}
        for key, node in keyed_statements(n_body):
            if key is not None:
                n_named[key] = node
            elif not in_class:
                n_digests[code_digest(node)] = node
        anchor = start_after  # the N line after which the next addition of the student's goes
        s_keyed = keyed_statements(s_body)
        s_keys = {key for key, _ in s_keyed}
        self.result.added += [prefix + k for k in n_named if k not in s_keys]
        for key, s in s_keyed:
            if key is None:
                if in_class or _is_docstring(s):
                    continue  # class-level statements are the class shell's; docstrings N's
                digest = code_digest(s)
                if digest in n_digests:
                    anchor = _span(n_digests[digest], self.n_lines, False)[1]
                elif digest not in self.statements:
                    self._insert(anchor, self._text(s, n_indent), in_class, blank=False)
                    self.result.kept.append(ast.get_source_segment(
                        "\n".join(self.s_lines), s).splitlines()[0][:60])
                continue
            name = prefix + key
            n = n_named.get(key)
            if n is not None:
                self._same_name(name, s, n, in_class)
                anchor = _span(n, self.n_lines, False)[1]
            else:
                self._only_yours(name, s, anchor, in_class, n_indent)

    def _same_name(self, name: str, s: ast.stmt, n: ast.stmt, in_class: bool) -> None:
        n_span = _span(n, self.n_lines, False)
        theirs = self.n_lines[n_span[0] - 1:n_span[1]]
        if isinstance(s, ast.ClassDef) != isinstance(n, ast.ClassDef):
            yours = self._text(s, n.col_offset)
            self.replaces[n_span] = self._conflict(
                name, "a class in one starter and not in the other", yours, theirs)
            return
        if isinstance(s, ast.ClassDef):
            digest = definition_digest(s)
            if digest != definition_digest(n):
                if digest in self.earlier.get(name, ()):
                    self.result.updated.append(name)
                else:
                    self.result.conflicts.append(
                        f"{name}: you changed the class's own given code (bases, decorators or "
                        "class attributes); copy your change into the merge by hand")
            indent = next((c.col_offset for c in n.body), n.col_offset + 4)
            first = n.body[0]
            body_start = (first.end_lineno if _is_docstring(first)
                          else _span(first, self.n_lines)[0] - 1)
            self._body(s.body, n.body, name + ".", in_class=True, n_indent=indent,
                       start_after=body_start)
            return
        comments = {line.strip()
                    for line in self.n_lines[_span(n, self.n_lines)[0] - 1:n_span[0] - 1]}
        if name in self.n_tasks:
            if name in self.s_tasks:
                return  # not written yet: the new stub stays
            yours = self._text(s, n.col_offset, comments)
            if _signature(s) != _signature(n):
                self.replaces[n_span] = self._conflict(
                    name, "the new starter changed this task's signature; adapt your code to it",
                    yours, theirs)
            else:  # the student's text replaces the stub, their comments too
                self.replaces[n_span] = self._with_new_docstring(name, s, n, yours)
                self.result.carried.append(name)
                self.carried_nodes.append((name, s, n))
            return
        digest = definition_digest(s)
        if digest == definition_digest(n) or name in self.s_tasks:
            if name in self.s_tasks:
                self.result.updated.append(name)  # an unwritten task the course now gives
            return
        if digest in self.earlier.get(name, ()):
            self.result.updated.append(name)
            return
        why = ("the new starter gives this code; you wrote it when it was a task"
               if name in self.ever_tasks else "you changed this given code")
        self.replaces[n_span] = self._conflict(name, why, self._text(s, n.col_offset, comments),
                                               theirs)

    def _only_yours(self, name: str, s: ast.stmt, anchor: int, in_class: bool,
                    n_indent: int) -> None:
        """A definition of the student's starter that the new one lacks."""
        if name in self.s_tasks:
            return  # an unwritten task of the old starter: nothing of the student's in it
        if definition_digest(s) in self.earlier.get(name, ()) and not self._written_inside(
                s, name):
            self.result.updated.append(name + " (removed)")
            return
        text = self._text(s, n_indent)
        if name in self.ever_tasks or self._written_inside(s, name):
            self._insert(anchor, self._conflict(
                name, "the new starter has no such task; your code for it is here", text, []),
                in_class)
        else:
            self._insert(anchor, text, in_class, blank=isinstance(s, (ast.FunctionDef,
                                                                        ast.AsyncFunctionDef,
                                                                        ast.ClassDef)))
            self.result.kept.append(name)

    def _written_inside(self, s: ast.stmt, name: str) -> bool:
        """A class holding a method the student wrote for a task."""
        if not isinstance(s, ast.ClassDef):
            return False
        return any(f"{name}.{c.name}" in self.ever_tasks and f"{name}.{c.name}" not in
                   self.s_tasks for c in s.body if isinstance(c, (ast.FunctionDef,
                                                                  ast.AsyncFunctionDef)))

    def _trailing_comments(self) -> None:
        """The student's comment lines after their last statement go to the end of the file."""
        last = self.s_tree.body[-1].end_lineno if self.s_tree.body else 0
        theirs = {line.strip() for line in self.n_lines}
        tail = [line for line in self.s_lines[last:] if line.strip()]
        if tail and any(line.strip() not in theirs for line in tail):
            self._insert(len(self.n_lines), [""] + tail, in_class=False, blank=False)

    def _check_comments(self) -> None:
        """Never drop a line of the student's: a comment of theirs outside every definition
        that is in neither the merge nor the new starter is a conflict."""
        covered = set()
        for node in ast.walk(self.s_tree):
            if isinstance(node, ast.stmt):
                start, end = _span(node, self.s_lines)
                # A class covers its header; the lines between its methods are checked.
                end = node.lineno if isinstance(node, ast.ClassDef) else end
                covered.update(range(start, end + 1))
        merged = {line.strip() for line in self.result.text.splitlines()}
        for i, line in enumerate(self.s_lines, 1):
            if line.lstrip().startswith("#") and i not in covered and line.strip() not in merged:
                self.result.conflicts.append(
                    f"line {i}: your comment {line.strip()[:50]!r} has no place in the new "
                    "starter; copy it over by hand")


def merge_starters(student: str, new: str, lab_id: str, record: dict) -> Merge:
    """Carry ``student`` (a starter.py) onto ``new`` (the current published starter) by
    definition. ``record`` is the lab's entry of published_given.json (earlier given code,
    every task ever published). Raises UpgradeError when ``student`` does not parse."""
    return _Merger(student, new, lab_id, record).merge()


# --- the command --------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True)


def published_source(lab: Lab, root: Path = REPO_ROOT, digest: str | None = None) -> str:
    """The text of the lab's starter.py as published today: the version in this checkout's git
    history (any branch, a fetched or merged head) whose SHA-256 is the published one."""
    digest = digest or load_published(root / "course/labs/published_starters.json").get(
        lab.id, {}).get("starter.py")
    if not digest:
        raise UpgradeError(f"lab {lab.id} has no published starter.py to upgrade to; nothing "
                           "changed")
    rel = Path(lab.path).resolve().relative_to(root.resolve()).as_posix() + "/starter.py"
    try:
        log = _git(root, "log", "--all", "--format=%H", "--", rel)
    except OSError as exc:  # no git on this machine
        raise UpgradeError(f"git cannot run here ({exc}): the published starter is read from "
                           "the checkout's history; nothing changed") from None
    heads = [h for h in ("MERGE_HEAD", "FETCH_HEAD") if _git(root, "rev-parse", "-q", "--verify",
                                                             h).returncode == 0]
    for commit in [*heads, *log.stdout.decode().split()]:
        show = _git(root, "show", f"{commit}:{rel}")
        if show.returncode == 0 and hashlib.sha256(show.stdout).hexdigest() == digest:
            return show.stdout.decode("utf-8")
    raise UpgradeError(
        f"lab {lab.id}: the published starter (sha256 {digest[:12]}) is not in this checkout's "
        "git history: fetch the course's latest version (git fetch, or git pull), then run "
        "again; nothing changed")


def _free_name(path: Path) -> Path:
    if not path.exists():
        return path
    n = 2
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def upgrade_lab(lab: Lab, root: Path = REPO_ROOT) -> tuple[int, list[str]]:
    """Upgrade the lab's starter.py in place (module doc). Returns the exit status (0 upgraded
    or nothing to do, 1 conflicts, 2 bad input) and the lines to print, the summary first."""
    starter = lab.path / "starter.py"
    if not starter.is_file():
        return 2, [f"error: lab {lab.id} has no starter.py; nothing changed"]
    try:
        student = starter.read_text(encoding="utf-8")
        record = load_given(root / "course/labs/published_given.json").get(lab.id)
        if not record:
            raise UpgradeError(f"lab {lab.id} has no published given code to compare with; "
                               "nothing changed")
        if hashlib.sha256(student.encode()).hexdigest() == load_published(
                root / "course/labs/published_starters.json").get(lab.id, {}).get("starter.py"):
            return 0, [f"lab {lab.id}: nothing to upgrade: starter.py is the published one"]
        new = published_source(lab, root)
        merge = merge_starters(student, new, lab.id, record)
        # mini_vllm's old layout: the course's own imports were replaced with the new starter's
        # above; imports the student added are pointed at where their names are now.
        merge.text, rewritten = rewrite_imports(merge.text)
        merge.kept = [rewrite_imports(kept)[0].strip() for kept in merge.kept]
        moved = old_imports(student)
    except UnicodeDecodeError:
        return 2, [f"error: lab {lab.id}: starter.py is not UTF-8 text; nothing changed"]
    except UpgradeError as exc:
        return 2, [f"error: lab {lab.id}: {exc}" if not str(exc).startswith("lab ")
                   else f"error: {exc}"]
    rel = starter.relative_to(root) if starter.is_relative_to(root) else starter
    if merge.conflicts:
        target = starter.with_name("starter.py.merge")
        target.write_text(merge.text, encoding="utf-8")
        lines = [f"lab {lab.id}: not upgraded: {len(merge.conflicts)} conflict(s) need you; "
                 f"{rel} is unchanged, the merge with each conflict marked (<<<<<<<) is in "
                 f"{rel}.merge"]
        lines += [f"  conflict: {c}" for c in merge.conflicts]
        if merge.added:  # where a task's work moved, often
            lines.append(f"  new in the starter: {', '.join(merge.added)}")
        lines.append(f"Resolve each conflict in {rel}.merge (keep what you mean, delete the "
                     f"markers), then move it over {rel} and run the lab's tests.")
        return 1, lines
    if not merge.updated and not merge.added and not moved:
        return 0, [f"lab {lab.id}: nothing to upgrade: the given code of {rel} is the published "
                   "one"]
    backup = _free_name(starter.with_name("starter.py.before-upgrade"))
    backup.write_bytes(starter.read_bytes())
    starter.write_text(merge.text, encoding="utf-8")
    lines = [f"lab {lab.id}: upgraded {rel} to the published starter: {len(merge.carried)} "
             f"task(s) of yours carried over, {len(merge.updated) + len(merge.added)} given "
             "definition(s) updated or added; "
             f"your old file is {backup.name}"]
    if moved:
        lines.append("  imports moved with mini_vllm's layout: " + ", ".join(
            f"{old} -> {new}" for old, new in dict(moved).items()))
    for line in rewritten:
        lines.append(f"  your import rewritten: {line}")
    if merge.updated:
        lines.append(f"  given code updated: {', '.join(merge.updated)}")
    if merge.added:
        lines.append(f"  new in the starter: {', '.join(merge.added)}")
    if merge.carried:
        lines.append(f"  your tasks carried: {', '.join(merge.carried)}")
    for task, helpers in merge.uncalled:
        names = ", ".join(f"`{h}`" for h in helpers)
        lines.append(f"  {task}: your body never calls {names}, which its docstring now asks "
                     "it to; the upgrade cannot write that call: add it as the docstring says, "
                     "or the tests that rely on it fail")
    if merge.kept:
        lines.append(f"  your additions kept: {', '.join(merge.kept)}")
    return 0, lines
