"""Every command a lab README gives a student works, as the notebooks and figures are checked.

A command is a line of a fenced block (or an inline code span without placeholders) whose first
word, after `VAR=value` assignments, is `python`, `pytest`, `nvcc`, `ncu` or `cd`. Running them
all would take minutes, so each kind is checked as cheaply as what it can get wrong allows:

* `pytest ...` / `python -m pytest ...`: every path exists and lies in the README's own lab
  folder (or outside the phases), and the selection (`-k`, `-m`) picks at least one test. The
  selection is evaluated with pytest's own expression matcher against the tests under the path:
  the ones this session already collected, when it collected the whole path (the suite's run,
  xdist workers included, collects every lab, so this costs nothing in CI), else one
  `--collect-only` per path, and only for commands that select
  (a whole lab folder holds its tests by the lab contract).
* `python -m course ...`: parsed by the course's own argument parser (an unknown subcommand or
  option fails), a lab id must be the README's own lab, and `hint` really renders its hint.
* `python SCRIPT ...`: the script exists, and each `--option` appears in its source.
* `nvcc`, `ncu`: every path in the arguments exists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT, discover

LAB_READMES = sorted(REPO_ROOT.glob("phase-*/labs/lab-*/README.md"))
COMMAND_WORDS = {"python", "pytest", ".venv/bin/python", "nvcc", "ncu", "cd"}
PLACEHOLDER = re.compile(r"<[^>]+>|\bN\b|\.\.\.")


@dataclass
class Command:
    readme: Path
    line: int
    argv: list[str]
    cwd: Path  # where a relative path resolves (the repository root, or after a `cd`)
    env: dict[str, str] = field(default_factory=dict)
    inline: bool = False  # named in a sentence: its required options may be left out

    def where(self) -> str:
        return f"{self.readme.relative_to(REPO_ROOT)}:{self.line}: {shlex.join(self.argv)}"


def readme_commands(readme: Path, text: str | None = None) -> list[Command]:
    """The commands of a README (its text, or `text` in its place), in order."""
    text = readme.read_text(encoding="utf-8") if text is None else text
    out: list[Command] = []
    cwd, fence, pending, start = REPO_ROOT, False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```"):
            fence, cwd = not fence, REPO_ROOT  # a `cd` holds for the rest of its block only
            continue
        if fence:
            pending, start = (pending + " " + raw.rstrip("\\").strip(), start or number)
            if raw.rstrip().endswith("\\"):
                continue
            line, pending, at = pending.strip(), "", start
            start = 0
            cmd = _command(readme, at, line, cwd)
            if cmd is not None and cmd.argv[0] == "cd":
                cwd = (cwd / cmd.argv[1]).resolve()
            elif cmd is not None:
                out.append(cmd)
        else:
            for span in re.findall(r"`([^`]+)`", raw):
                if not PLACEHOLDER.search(span):
                    cmd = _command(readme, number, span, REPO_ROOT)
                    if cmd is not None and cmd.argv[0] != "cd":
                        cmd.inline = True
                        out.append(cmd)
    return out


def _command(readme: Path, line: int, text: str, cwd: Path) -> Command | None:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or words[0] not in COMMAND_WORDS:
        return None
    if words[0] == ".venv/bin/python":
        words[0] = "python"
    return Command(readme, line, words, cwd, env)


def lab_of(readme: Path):
    return next(lab for lab in discover() if lab.path == readme.parent)


def problems(cmd: Command, session=None) -> list[str]:
    """What is wrong with one command (empty when it would run); `session`: this pytest
    session, whose collected tests are used when it holds the path's."""
    argv = cmd.argv
    if argv[0] == "pytest" or argv[:3] == ["python", "-m", "pytest"]:
        return _pytest_problems(cmd, argv[1 if argv[0] == "pytest" else 3:], session)
    if argv[:3] == ["python", "-m", "course"]:
        return _course_problems(cmd, argv[3:])
    if argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py"):
        return _script_problems(cmd, argv[1], argv[2:])
    if argv[0] in ("nvcc", "ncu"):
        paths = [a.removeprefix("-I") for a in argv[1:] if "/" in a and not a.startswith("/")
                 and not a.startswith("regex:")]
        return [f"{p}: no such file or folder" for p in paths if not _exists(cmd, p)]
    return []


def _exists(cmd: Command, path: str) -> bool:
    return (cmd.cwd / path).exists()


def _pytest_problems(cmd: Command, args: list[str], session) -> list[str]:
    own = cmd.readme.parent
    paths, keyword, marks, it = [], None, None, iter(args)
    for arg in it:
        if arg == "-k":
            keyword = next(it, "")
        elif arg == "-m":
            marks = next(it, "")
        elif not arg.startswith("-"):
            paths.append(arg)
    found = []
    for p in paths:
        full = (cmd.cwd / p).resolve()
        if not full.exists():
            found.append(f"{p}: no such file or folder")
        elif "labs" in full.relative_to(REPO_ROOT).parts and not full.is_relative_to(own):
            found.append(f"{p} is another lab's folder, not this README's ({own.name})")
    if found or not paths:
        return found
    if keyword is None and marks is None:
        return []
    items = [i for p in paths for i in selectable_tests((cmd.cwd / p).resolve(), session)]
    from _pytest.mark.expression import Expression

    def keep(item) -> bool:
        names = [n.lower() for n in item["names"]]
        ok = keyword is None or Expression.compile(keyword).evaluate(
            lambda sub, **_: any(sub.lower() in n for n in names))
        return ok and (marks is None or Expression.compile(marks).evaluate(
            lambda name, **_: name in item["marks"]))

    if not any(keep(i) for i in items):
        return [f"selects none of the {len(items)} tests collected from {', '.join(paths)}"]
    return []


PLUGIN = textwrap.dedent(
    """
    import json, os
    from _pytest.mark import KeywordMatcher

    def pytest_collection_finish(session):
        with open(os.environ["README_COMMANDS_OUT"], "w") as f:
            json.dump([{"names": sorted(KeywordMatcher.from_item(i)._names),
                        "marks": sorted({m.name for m in i.iter_markers()})}
                       for i in session.items], f)
    """
)


def selectable_tests(path: Path, session) -> tuple[dict, ...]:
    """Each test under `path`: its keyword names (what -k matches) and its markers; from this
    session's items when it collected that path unfiltered, else from a collection of its own."""
    from _pytest.mark import KeywordMatcher

    if session is not None and _collected_whole(session, path):
        return tuple({"names": sorted(KeywordMatcher.from_item(i)._names),
                      "marks": sorted({m.name for m in i.iter_markers()})}
                     for i in session.items if Path(str(i.path)).is_relative_to(path))
    return collected(str(path))


def _collected_whole(session, path: Path) -> bool:
    """Whether this session holds every test under `path`: no -k, -m or node id narrowed it,
    and each test file under `path` was collected."""
    opts, args = session.config.option, session.config.args
    if getattr(opts, "keyword", "") or getattr(opts, "markexpr", "") or any(
            "::" in a for a in args):
        return False
    files = {p.resolve() for p in ([path] if path.is_file() else path.rglob("test_*.py"))}
    seen = {Path(str(i.path)).resolve() for i in session.items}
    return bool(files) and files <= seen


@cache
def collected(path: str) -> tuple[dict, ...]:
    """Each test under `path`: its keyword names (what -k matches) and its markers."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="readme-commands-") as tmp:
        (Path(tmp) / "readme_collect.py").write_text(PLUGIN, encoding="utf-8")
        out = Path(tmp) / "items.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, str(REPO_ROOT)]),
                   README_COMMANDS_OUT=str(out), OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", path, "--collect-only", "-q", "-p",
             "readme_collect", "-p", "no:cacheprovider"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
        )
        assert out.is_file(), f"collecting {path} failed:\n{proc.stdout[-2000:]}{proc.stderr}"
        return tuple(json.loads(out.read_text()))


def _course_problems(cmd: Command, args: list[str]) -> list[str]:
    import argparse
    import contextlib
    import io

    from course.cli import build_parser

    parser = build_parser()
    subcommands = next(a.choices for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction))
    if args and not args[0].startswith("-") and args[0] not in subcommands:
        return [f"python -m course has no subcommand {args[0]!r} ({', '.join(subcommands)})"]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = parser.parse_args(args)
    except SystemExit:
        if cmd.inline:
            return []  # a sentence that names `python -m course grade` leaves out --out
        return ["python -m course does not accept these arguments (see its --help)"]
    own = lab_of(cmd.readme)
    labs = getattr(parsed, "labs", None)  # a list of ids (check, grade), or engine's "all"
    named = [getattr(parsed, "lab", None), *(labs if isinstance(labs, list) else [])]
    for lab in filter(None, named):
        if lab != own.id:
            return [f"names lab {lab}, but this is lab {own.id}'s README"]
    if args and args[0] == "hint":
        from course.student.hints import render_hint

        try:
            render_hint(own, parsed.task, parsed.level)
        except ValueError as exc:
            return [str(exc)]
    if args and args[0] == "measure" and not (own.path / "measure.py").is_file():
        return [f"lab {own.id} has no measure.py"]
    return []


def _script_problems(cmd: Command, script: str, args: list[str]) -> list[str]:
    path = next((base / script for base in (cmd.cwd, cmd.readme.parent)
                 if (base / script).is_file()), None)
    if path is None:
        return [f"{script}: no such script"]
    source = path.read_text(encoding="utf-8")
    return [f"{script} defines no option {a}" for a in args
            if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]


@pytest.mark.parametrize("readme", LAB_READMES, ids=[p.parent.name for p in LAB_READMES])
def test_every_command_in_a_lab_readme_runs(readme, request):
    commands = readme_commands(readme)
    assert commands, f"{readme}: no commands found (the README must say how to run the lab)"
    found = [f"{c.where()}\n    {p}" for c in commands for p in problems(c, request.session)]
    assert not found, (
        f"{len(found)} command(s) of {readme.relative_to(REPO_ROOT)} would fail for a student; "
        "fix the README:\n" + "\n".join(found)
    )


def test_the_check_rejects_a_wrong_lab_an_empty_selection_and_an_unknown_subcommand():
    readme = REPO_ROOT / "phase-02-paged-attention/labs/lab-06-cuda-kernel/README.md"
    bad = textwrap.dedent(
        """
        ```bash
        python -m course measure 02-05 --plot x.png
        LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-06-cuda-kernel -q -k taskzero
        LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-05-sharing -q
        python -m course measurr 02-06
        python -m course hint 02-06 9
        python no_such_script.py
        python -m course measure 02-06 --arch T5
        ```
        Inline: `python -m course grade` is fine, `python -m course grades` is not.
        """
    )
    found = {c.line: problems(c) for c in readme_commands(readme, bad)}
    assert found[3] == ["names lab 02-05, but this is lab 02-06's README"]
    assert found[4][0].startswith("selects none of the") and "tests collected" in found[4][0]
    assert "another lab's folder" in found[5][0]
    assert "has no subcommand 'measurr'" in found[6][0]
    assert "no task 9" in found[7][0]
    assert found[8] == ["no_such_script.py: no such script"]
    assert found[9] and "does not accept" in found[9][0]  # --arch T5
    inline = [problems(c) for c in readme_commands(readme, bad) if c.inline]
    assert inline[0] == [] and "no subcommand 'grades'" in inline[1][0]
    good = ("```\nLAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-06-cuda-kernel "
            "-k naive\n```")
    assert [problems(c) for c in readme_commands(readme, good)] == [[]]
