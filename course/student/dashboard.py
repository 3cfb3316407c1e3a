"""The student's dashboard, ``python -m course``: every lab's tests against your starter files, and
the engine exam as it will be graded and on your finished engine labs (course.engine.command).

A lab runs only when something it depends on changed (course.labs.results): an untouched lab is
"not started" at once, and an unchanged one shows its recorded result, marked "cached".
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections import Counter
from pathlib import Path

from course.engine.command import exam_rows
from course.labs.catalog import REPO_ROOT, Lab
from course.labs.console import table
from course.labs.published import lab_given_note
from course.labs.results import lab_runs

NEXT_STEP_WIDTH = 60  # the "Next step" column wraps at words beyond this


def _python(root: Path = REPO_ROOT, executable: str | None = None) -> str:
    """How to name this Python in a command a student copies: a bare ``pytest`` or ``python``
    may not be on PATH (a venv that is not activated). Relative to the checkout when it lives
    there (the README's ``.venv/bin/python``), else its full path."""
    exe = Path(executable or sys.executable)
    try:
        return exe.relative_to(root).as_posix()
    except ValueError:
        pass
    venv = root / ".venv" / "bin" / "python"
    try:
        if venv.exists() and os.path.samefile(venv, exe):
            return ".venv/bin/python"
    except OSError:
        pass
    return str(exe)


def _not_run(run) -> dict[str, int]:
    """{why: how many} of the lab's tests skipped because the machine lacks something (a GPU,
    nvcc): a lab can be done on the CPU while those never ran."""
    reasons = (t["message"].removeprefix("Skipped: ") for t in run.tests
               if t["outcome"] == "skipped")
    return dict(Counter(why for why in reasons if why.startswith("needs ")))


def _status(run) -> str:
    gpu = any("GPU" in why for why in _not_run(run))
    return f"{run.status} (CPU)" if gpu and run.status == "done" else run.status


def _rows(run) -> list[list[str]]:
    """The lab's row, then one row per further line of its wrapped next step."""
    tests = "-" if run.origin == "untouched" else f"{run.passed}/{run.total}"
    step = textwrap.wrap(run.next_step, NEXT_STEP_WIDTH, break_long_words=False) or [""]
    rows = [[run.lab.phase, run.lab.id, run.lab.title, tests, _status(run), step[0], _ran(run)]]
    rows += [["", "", "", "", "", more, ""] for more in step[1:]]
    return rows


def _ran(run) -> str:
    if run.origin == "untouched":
        return "-"
    return "cached" if run.origin == "cached" else f"now, {run.seconds:.0f} s"


def show_status(labs: list[Lab], impl: str, jobs: int | None, no_exam: bool = False,
                use_cache: bool = True) -> int:
    """Print the dashboard of ``labs`` run against ``impl``; 1 when a test run itself broke."""
    runs = lab_runs(labs, impl, jobs, use_cache=use_cache,
                    log=lambda m: print(m, file=sys.stderr))
    rows = [row for r in runs for row in _rows(r)]
    if impl == "starter" and not no_exam:
        rows += exam_rows(runs, jobs)
    print(table(["Phase", "Lab", "Title", "Tests", "Status", "Next step", "Ran"], rows))
    for r in (r for r in runs if r.status == "done"):
        for why, count in _not_run(r).items():
            print(f"lab {r.lab.id}: {r.passed}/{r.total} done on this machine; {count} test(s) "
                  f"not run: {why}")
    if impl == "starter":
        notes = [lab_given_note(r.lab) for r in runs if r.origin != "untouched"]
        for note in filter(None, notes):
            print(note)
    done = sum(r.status == "done" for r in runs)
    print(f"\n{done} of {len(runs)} labs done ({impl}).", end=" ")
    first = next((r.lab for r in runs if r.status != "done"), None)
    if impl == "starter" and first is not None:
        print(f"Next: lab {first.id}. Read {first.rel}/README.md, then run\n\n"
              f"    LAB_IMPL=starter {_python()} -m pytest {first.rel} -q\n")
    else:
        print()
    untouched = sum(r.origin == "untouched" for r in runs)
    cached = sum(r.origin == "cached" for r in runs)
    if untouched or cached:
        print(f"({untouched} untouched lab(s) not run: your starter is the published one; "
              f"{cached} lab(s) cached: nothing they depend on changed since their last run. "
              "--no-cache runs them again.)")
    broken = [r for r in runs if r.broken]
    for r in broken:
        print(
            f"\nlab {r.lab.id}: the test run itself broke (exit {r.exit_code}):\n{r.output[-2000:]}"
        )
    return 1 if broken else 0
