"""The student's dashboard, ``python -m course``: every lab's tests against your starter files, and
the engine exam on your finished engine labs.

A lab runs only when something it depends on changed (course.labs.results): an untouched lab is
"not started" at once, and an unchanged one shows its recorded result, marked "cached".
"""

from __future__ import annotations

import sys
from pathlib import Path

from course.engine.command import exam_row
from course.labs.catalog import REPO_ROOT, Lab
from course.labs.console import table
from course.labs.results import lab_runs


def _python() -> str:
    """How to name this Python in a command: relative when it is the checkout's own venv."""
    exe = Path(sys.executable)
    try:
        return exe.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return "python"


def _ran(run) -> str:
    if run.origin == "untouched":
        return "-"
    return "cached" if run.origin == "cached" else f"now, {run.seconds:.0f} s"


def show_status(labs: list[Lab], impl: str, jobs: int | None, no_exam: bool = False,
                use_cache: bool = True) -> int:
    """Print the dashboard of ``labs`` run against ``impl``; 1 when a test run itself broke."""
    runs = lab_runs(labs, impl, jobs, use_cache=use_cache,
                    log=lambda m: print(m, file=sys.stderr))
    rows = []
    for r in runs:
        tests = "-" if r.origin == "untouched" else f"{r.passed}/{r.total}"
        rows.append([r.lab.phase, r.lab.id, r.lab.title, tests, r.status, r.next_step[:70],
                     _ran(r)])
    exam = exam_row(runs, jobs) if impl == "starter" and not no_exam else None
    if exam:
        rows.append(exam)
    print(table(["Phase", "Lab", "Title", "Tests", "Status", "Next step", "Ran"], rows))
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
