"""The hint ladder: `python -m course hint 02-03 4 [--level 2|3|4]`.

Docstrings state contracts; the algorithm lives here, one rung at a time, and each rung leaves
the student more to do than the next: a question, then a small case to trace by hand, then the
idea with the tests that check it, then upstream's lines. No rung is the answer: a ladder that
ends in the body written out in prose is copied, not learnt, so the last rung of our own words
names the idea (and the mistake the tests catch) and a command that runs only the tests of that
idea. Each lab keeps its hints in `hints.toml` in its folder, one table per task of its starter:

    [task.4]
    question = "..."   # level 1: a question that points at the idea, not at the code
    example = "..."    # level 2: a worked example on a small case, its state before and after
                       #          (checked by running the reference on that case)
    idea = "..."       # level 3: the idea the body rests on, and what goes wrong without it
    tests = ["test_touch_takes_a_free_block_off_the_queue"]     # level 3: the tests to run
    read = ["vllm/v1/core/kv_cache_manager.py:212 @ v0.11.0"]   # level 4: upstream lines
    look_for = "..."   # level 4, optional: what to notice in those lines

Every `read` reference must be an entry of upstream_refs/map (so `python -m course refs
--vllm-src ...` checks it against the release); every name in `tests` a test (function or
class) of the lab's test_lab.py. `course check` requires all four levels for every task of every
lab, an example that shows the state before and after, and no rung that restates the
reference's body: one whose text holds, in order, RESTATES or more of the body's code tokens
(counted in runs of three or more) is flagged, as is an idea written as numbered steps.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

import tomllib

from course.labs.catalog import REPO_ROOT, Lab
from course.labs.tasks import Task, open_tasks, readme_section
from course.upstream.refs import REF_RE, load_map

HINTS_FILE = "hints.toml"
LEVELS = {1: "a question", 2: "a worked example to trace by hand",
          3: "the idea, and the tests that check it", 4: "the upstream lines to read"}
RESTATES = 0.5  # the share of the reference body's tokens a rung may not repeat in order
RUN = 3  # the shortest run of tokens that counts as repeated
KEYS = {"question", "example", "idea", "tests", "read", "look_for"}
TOP = max(LEVELS)
STATE = re.compile(r"^(Before|After|Then|Call|Why)\b[^:]{0,30}:\s")  # an example's own lines

@dataclass(frozen=True)
class Hint:
    task: int
    question: str
    example: str
    idea: str
    tests: tuple[str, ...]
    read: tuple[str, ...]
    look_for: str = ""


def hints_path(lab: Lab) -> Path:
    return lab.path / HINTS_FILE


def load_hints(lab: Lab) -> dict[int, Hint]:
    """{task number: Hint} from the lab's hints.toml ({} when it has none).

    A malformed file raises ValueError naming the file and the problem."""
    path = hints_path(lab)
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path.name}: not valid TOML ({exc})") from None
    hints = {}
    for key, table in data.get("task", {}).items():
        if not key.isdigit() or not isinstance(table, dict):
            raise ValueError(f"{path.name}: [task.{key}] must be [task.N] with N a task number")
        unknown = sorted(set(table) - KEYS)
        if unknown:
            raise ValueError(f"{path.name}: [task.{key}] has {', '.join(unknown)}; a task's "
                             f"hints are {', '.join(sorted(KEYS))}")
        read, tests = table.get("read", []), table.get("tests", [])
        hints[int(key)] = Hint(
            int(key),
            str(table.get("question", "")).strip(),
            str(table.get("example", "")).strip(),
            str(table.get("idea", "")).strip(),
            tuple(str(t).strip() for t in ([tests] if isinstance(tests, str) else tests)),
            tuple(str(r).strip() for r in ([read] if isinstance(read, str) else read)),
            str(table.get("look_for", "")).strip(),
        )
    return hints


def check_hints(lab: Lab) -> list[str]:
    """Problems with the lab's hints: a task without all four levels, an example that does not
    show the state before and after, an idea written as steps, a rung that restates the
    reference's body, hints for a task that does not exist, tests the lab does not have,
    references that are not mapped."""
    try:
        hints = load_hints(lab)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    tasks = {t.number: t for t in open_tasks(lab)}
    if not hints_path(lab).is_file():
        return [f"no {HINTS_FILE}: every task needs hints (levels 1-{TOP})"]
    mapped = {(r.file, r.line, r.version) for r in load_map(lab.phase_dir.parent)[0]}
    for number in sorted(tasks):
        hint = hints.get(number)
        if hint is None:
            problems.append(f"{HINTS_FILE}: task {number} has no hints")
            continue
        for level, value in ((1, hint.question), (2, hint.example), (3, hint.idea),
                             (3, hint.tests), (4, hint.read)):
            if not value:
                problems.append(
                    f"{HINTS_FILE}: task {number} has no level {level} ({LEVELS[level]})"
                )
        words = set(re.findall(r"[a-z]+", hint.example.lower()))
        if hint.example and not {"before", "after"} <= words:
            problems.append(f"{HINTS_FILE}: task {number}: the example (level 2) must show the "
                            "state before and after (say both words)")
        if len(re.findall(r"(?m)^\s*\d+\.\s", hint.idea)) >= 3:
            problems.append(f"{HINTS_FILE}: task {number}: the idea (level 3) is numbered steps; "
                            "say the idea and let the tests show the way")
        body = reference_body(lab, tasks[number])
        for name, text in (("question", hint.question), ("example", hint.example),
                           ("idea", hint.idea), ("look_for", hint.look_for)):
            share = restated_share(text, body)
            if share >= RESTATES:
                problems.append(f"{HINTS_FILE}: task {number}: its {name} restates "
                                f"{share:.0%} of the reference's body; give the idea, not the "
                                "code")
    defined = test_names(lab)
    for number, hint in sorted(hints.items()):
        if number not in tasks:
            problems.append(f"{HINTS_FILE}: [task.{number}] names no task of the starter")
        for name in hint.tests:
            if name not in defined:
                problems.append(f"{HINTS_FILE}: task {number}: test_lab.py has no test {name}")
        for ref in hint.read:
            m = REF_RE.fullmatch(ref)
            if m is None:
                problems.append(f"{HINTS_FILE}: task {number}: {ref!r} is not `path:line @ vX.Y.Z`")
            elif (m["file"], int(m["line"]), m["version"]) not in mapped:
                problems.append(f"{HINTS_FILE}: task {number}: {ref} is not in upstream_refs/map")
    return problems


def test_names(lab: Lab) -> set[str]:
    """The tests a hint may name: test functions and test classes of the lab's test_lab.py."""
    path = lab.path / "test_lab.py"
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")
            or isinstance(node, ast.ClassDef) and node.name.startswith("Test")}


def reference_body(lab: Lab, task: Task) -> list[str]:
    """The code tokens (names, numbers, operators) of the reference's bodies of a task's
    functions, docstrings left out; [] where the reference is not Python (the CUDA lab)."""
    if task.file != "starter.py":
        return []
    from course.labs.loader import load_module

    module = load_module(lab.path, "solution", lab.id)
    tokens: list[str] = []
    for name, _ in task.functions:
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part)
        obj = getattr(obj, "fn", obj)  # a Triton kernel: the Python function it was made from
        source = textwrap.dedent(inspect.getsource(obj))
        node = ast.parse(source).body[0]
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if body:
            code = "\n".join(source.splitlines()[body[0].lineno - 1:node.end_lineno])
            tokens += [t.string for t in tokenize.generate_tokens(
                io.StringIO(textwrap.dedent(code)).readline)
                if t.type in (tokenize.NAME, tokenize.NUMBER, tokenize.OP)]
    return tokens


_TEXT_TOKEN = re.compile(r"[A-Za-z_]\w*|\d+|==|!=|<=|>=|//|\*\*|->|[-+*/%<>=\[\]().:,]")


def restated_share(text: str, body: list[str]) -> float:
    """How much of the reference body `text` repeats: the share of the body's tokens found in
    the text in the same order, in runs of RUN tokens or more (prose around them is skipped)."""
    if not body or not text:
        return 0.0
    matcher = difflib.SequenceMatcher(None, body, _TEXT_TOKEN.findall(text), autojunk=False)
    return sum(b.size for b in matcher.get_matching_blocks() if b.size >= RUN) / len(body)


def render_hint(lab: Lab, number: int, level: int) -> str:
    """The text `python -m course hint` prints; ValueError with what to do when there is none."""
    tasks = {t.number: t for t in open_tasks(lab)}
    hints = load_hints(lab)
    if not hints:
        section = readme_section(lab, number)
        where = f"README.md:{section[0]}" if section else "its README"
        raise ValueError(f"lab {lab.id} has no hints yet; task {number} is explained in {where}")
    if number not in hints:
        known = ", ".join(str(n) for n in sorted(hints))
        raise ValueError(f"lab {lab.id} has no task {number}; its tasks with hints: {known}")
    if level not in LEVELS:
        raise ValueError(f"--level must be 1 to {TOP}, not {level}")
    hint = hints[number]
    task = tasks.get(number)
    title = f"lab {lab.id}, task {number}"
    if task is not None:
        title += f": {task.names} ({task.file}:{task.line})"
    else:
        title += " (your starter no longer leaves it open)"
    lines = [title, f"hint {level} of {TOP}: {LEVELS[level]}", ""]
    if level == 1:
        lines.append(_indent(hint.question))
    elif level == 2:
        lines += [_indent(hint.example), "",
                  "  Trace it on paper before you read further: your code must do the same."]
    elif level == 3:
        lines += [_indent(hint.idea), "", "  Run the tests of this idea on your code:",
                  f"    LAB_IMPL=starter python -m pytest {lab.path.relative_to(REPO_ROOT)} -q "
                  f"-k '{' or '.join(hint.tests)}'"]
    else:
        texts = {(r.file, r.line, r.version): r for r in load_map(lab.phase_dir.parent)[0]}
        for ref in hint.read:
            m = REF_RE.fullmatch(ref)
            entry = texts.get((m["file"], int(m["line"]), m["version"])) if m else None
            lines.append(f"  {ref}")
            if entry is not None:
                lines.append(f"      {entry.text.strip()}")
        if hint.look_for:
            lines += ["", _indent(hint.look_for)]
        lines += [
            "",
            "  (paths are relative to a checkout of vLLM at that release's tag, e.g. v0.11.0)",
        ]
    if level < TOP:
        lines += [
            "",
            f"More: python -m course hint {lab.id} {number} --level {level + 1} "
            f"({LEVELS[level + 1]})",
        ]
    return "\n".join(lines)


def _indent(text: str) -> str:
    """Wrap hint text to the terminal: paragraphs are filled, numbered or dashed items keep
    their own lines (a line that continues an item joins it), `name:` lines stay headings, and
    lines indented by four spaces (a trace table, a state) are kept exactly as written."""
    marker = re.compile(r"^(\d+\.|[-*])\s")
    out = []
    for para in text.strip("\n").rstrip().split("\n\n"):
        items: list[tuple[bool, str]] = []  # (kept as written, text)
        for raw in para.strip("\n").splitlines():
            if raw.startswith("    "):
                items.append((True, raw.rstrip()))
                continue
            line = raw.strip()
            starts = (marker.match(line) or STATE.match(line) or line.endswith(":")
                      or not items or items[-1][0])
            if starts or items[-1][1].endswith(":"):
                items.append((False, line))
            else:
                items[-1] = (False, items[-1][1] + " " + line)
        for verbatim, item in items:
            if verbatim:
                out.append("  " + item)
                continue
            m = marker.match(item)
            hang = " " * (len(m.group(0)) if m else 0)
            out.append(textwrap.fill(item, 96, initial_indent="  ", subsequent_indent="  " + hang))
        out.append("")
    return "\n".join(out).rstrip()
