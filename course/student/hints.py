"""The hint ladder: `python -m course hint 02-03 4 [--level 2|3|4]`.

Docstrings state contracts; the algorithm lives here, one rung at a time, and each rung leaves
the student more to do than the next: a question, then a small case to trace by hand, then the
steps, then upstream's lines. The steps are never the second rung: a student who climbs one rung
gets a case to work through, not a recipe to transcribe. Each lab keeps its hints in
`hints.toml` in its folder, one table per task of its starter:

    [task.4]
    question = "..."   # level 1: a question that points at the idea, not at the code
    example = "..."    # level 2: a worked example on a small case, its state before and after
                       #          (checked by running the reference on that case)
    steps = "..."      # level 3: the steps, in order, in words
    read = ["vllm/v1/core/kv_cache_manager.py:212 @ v0.11.0"]   # level 4: upstream lines
    look_for = "..."   # level 4, optional: what to notice in those lines

Every `read` reference must be an entry of upstream_refs/map (so `python -m course refs
--vllm-src ...` checks it against the release). `course check` requires all four levels for
every task of every lab, and an example that shows the state before and after.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import tomllib

from course.labs.catalog import Lab
from course.labs.tasks import open_tasks, readme_section
from course.upstream.refs import REF_RE, load_map

HINTS_FILE = "hints.toml"
LEVELS = {1: "a question", 2: "a worked example to trace by hand", 3: "the steps",
          4: "the upstream lines to read"}
TOP = max(LEVELS)
STATE = re.compile(r"^(Before|After|Then|Call|Why)\b[^:]{0,30}:\s")  # an example's own lines

@dataclass(frozen=True)
class Hint:
    task: int
    question: str
    example: str
    steps: str
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
        read = table.get("read", [])
        if isinstance(read, str):
            read = [read]
        hints[int(key)] = Hint(
            int(key),
            str(table.get("question", "")).strip(),
            str(table.get("example", "")).strip(),
            str(table.get("steps", "")).strip(),
            tuple(str(r).strip() for r in read),
            str(table.get("look_for", "")).strip(),
        )
    return hints


def check_hints(lab: Lab) -> list[str]:
    """Problems with the lab's hints: a task without all four levels, an example that does not
    show the state before and after, hints for a task that does not exist, references that are
    not mapped."""
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
        for level, value in ((1, hint.question), (2, hint.example), (3, hint.steps),
                             (4, hint.read)):
            if not value:
                problems.append(
                    f"{HINTS_FILE}: task {number} has no level {level} ({LEVELS[level]})"
                )
        words = set(re.findall(r"[a-z]+", hint.example.lower()))
        if hint.example and not {"before", "after"} <= words:
            problems.append(f"{HINTS_FILE}: task {number}: the example (level 2) must show the "
                            "state before and after (say both words)")
    for number, hint in sorted(hints.items()):
        if number not in tasks:
            problems.append(f"{HINTS_FILE}: [task.{number}] names no task of the starter")
        for ref in hint.read:
            m = REF_RE.fullmatch(ref)
            if m is None:
                problems.append(f"{HINTS_FILE}: task {number}: {ref!r} is not `path:line @ vX.Y.Z`")
            elif (m["file"], int(m["line"]), m["version"]) not in mapped:
                problems.append(f"{HINTS_FILE}: task {number}: {ref} is not in upstream_refs/map")
    return problems


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
        title += " (already written in your starter)"
    lines = [title, f"hint {level} of {TOP}: {LEVELS[level]}", ""]
    if level == 1:
        lines.append(_indent(hint.question))
    elif level == 2:
        lines += [_indent(hint.example), "",
                  "  Trace it on paper before you read further: your code must do the same."]
    elif level == 3:
        lines.append(_indent(hint.steps))
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
