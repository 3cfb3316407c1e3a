"""The student's dashboard, ``python -m course``: every lab's tests against your starter files, and
the engine exam on your finished engine labs."""

from __future__ import annotations

from course.engine.command import exam_row
from course.labs.catalog import Lab
from course.labs.console import table
from course.labs.results import record_lab_status
from course.labs.runner import run_labs


def show_status(labs: list[Lab], impl: str, jobs: int | None, no_exam: bool = False) -> int:
    """Print the dashboard of ``labs`` run against ``impl``; 1 when a test run itself broke."""
    runs = run_labs(labs, impl, jobs)
    if impl == "starter":
        record_lab_status(runs)
    rows = []
    for r in runs:
        rows.append(
            [
                r.lab.phase,
                r.lab.id,
                r.lab.title,
                f"{r.passed}/{r.total}",
                r.status,
                r.next_step[:70],
            ]
        )
    exam = exam_row(runs, jobs) if impl == "starter" and not no_exam else None
    if exam:
        rows.append(exam)
    print(table(["Phase", "Lab", "Title", "Tests", "Status", "Next step"], rows))
    done = sum(r.status == "done" for r in runs)
    print(f"\n{done} of {len(runs)} labs done ({impl}).", end=" ")
    if impl == "starter" and done < len(runs):
        print(
            "Open the first unfinished lab's README, then run "
            "`LAB_IMPL=starter pytest <lab folder> -q`."
        )
    else:
        print()
    broken = [r for r in runs if r.broken]
    for r in broken:
        print(
            f"\nlab {r.lab.id}: the test run itself broke (exit {r.exit_code}):\n{r.output[-2000:]}"
        )
    return 1 if broken else 0
