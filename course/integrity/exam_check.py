"""The engine exam in ``python -m course check``.

Three things are checked, each in its own worker process (:mod:`course.engine.worker`):

1. the reference engine passes every graded case (a violation otherwise; the run also writes the
   reference statistics and oracle completions that the other runs reuse);
2. stand-in students (:mod:`course.integrity.shadow`) whose every engine piece is a private copy
   of the reference pass it too: the composition works with objects that are not the reference's;
3. every planted bug of an engine lab, planted in that lab's private copy only, is run through
   the exam with one lab at a time on failure. The report says which bugs the exam rejects (many
   lab-level mistakes, a missing input check say, cannot change what an engine does: those are
   reported, not violations) and which lab the bisection blamed; blaming another lab than the
   bug's is a violation.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from course.engine.command import run_exam_job
from course.engine.compose import engine_labs
from course.engine.exam import GRADED_SWEEP, cases
from course.integrity.bugs import PlantedBug, load_bugs
from course.integrity.shadow import NotAnEnginePiece, shadow_tree
from course.labs.catalog import REPO_ROOT

CASE_TIMEOUT_S = 60.0
CPU_LABS_EXCLUDED = ("02-06",)  # its pieces serve decode only on a GPU
EXAM_REJECTED = REPO_ROOT / "planted_bugs" / "exam_rejected.txt"


@dataclass
class ExamBugResult:
    lab_id: str
    bug: PlantedBug
    status: str  # "rejected", "not rejected", "not an engine piece", "error"
    detail: str = ""
    blamed: tuple[str, ...] = ()


def _job(labs: list[str], reference: Path, *, fail_fast: bool, bisect: bool) -> dict:
    return {"mode": "exam", "labs": labs, "cases": [c.name for c in cases(GRADED_SWEEP)],
            "sweep": GRADED_SWEEP, "timeout": CASE_TIMEOUT_S, "gpu": False,
            "fail_fast": fail_fast, "bisect": bisect, "reference": str(reference)}


def _budget(job: dict) -> float:
    return 120 + 2 * CASE_TIMEOUT_S * (len(job["cases"]) + 8)


def check_reference(reference: Path) -> list[str]:
    """The reference engine passes the exam; writes the shared reference data."""
    job = _job([], reference, fail_fast=False, bisect=False)
    report = run_exam_job(job, _budget(job))
    problems = [f"engine exam: the reference engine fails {c['case']}: {c['message']}"
                for c in report["cases"] if c["outcome"] != "passed"]
    if not reference.is_file() and not problems:
        problems.append(f"engine exam: the reference run did not finish: {report['error']}")
    return problems


def check_stand_ins(reference: Path) -> list[str]:
    """Every engine lab yours, each piece a private copy of the reference: the exam passes."""
    labs = [lab.id for lab in engine_labs() if lab.id not in CPU_LABS_EXCLUDED]
    job = _job(labs, reference, fail_fast=False, bisect=False)
    with tempfile.TemporaryDirectory(prefix="course-exam-") as tmp:
        root = shadow_tree(Path(tmp) / "tree")
        report = run_exam_job(job, _budget(job), root)
    return [f"engine exam: stand-in students fail {c['case']}: {c['message']}"
            for c in report["cases"] if c["outcome"] != "passed"]


def check_exam_bug(lab_id: str, bug: PlantedBug, reference: Path) -> ExamBugResult:
    labs = [lab.id for lab in engine_labs() if lab.id not in CPU_LABS_EXCLUDED]
    with tempfile.TemporaryDirectory(prefix="course-exam-bug-") as tmp:
        try:
            root = shadow_tree(Path(tmp) / "tree", (lab_id, bug))
        except NotAnEnginePiece as exc:
            return ExamBugResult(lab_id, bug, "not an engine piece", str(exc))
        except ValueError as exc:
            return ExamBugResult(lab_id, bug, "error", str(exc))
        job = _job(labs, reference, fail_fast=True, bisect=True)
        report = run_exam_job(job, _budget(job), root)
    failing = [c for c in report["cases"] if c["outcome"] not in ("passed", "not run")]
    if not failing:
        if report["error"]:
            return ExamBugResult(lab_id, bug, "error", report["error"])
        return ExamBugResult(lab_id, bug, "not rejected", "every case passes")
    blamed = tuple((report.get("bisection") or {}).get("blamed", ()))
    return ExamBugResult(lab_id, bug, "rejected",
                         f"by {failing[0]['case']}: {failing[0]['message']}", blamed)


def engine_bugs(lab_ids: list[str] | None = None) -> list[tuple[str, PlantedBug]]:
    """The planted bugs of the engine labs (of ``lab_ids`` only, when given)."""
    return [(lab.id, bug) for lab in engine_labs() if lab.id not in CPU_LABS_EXCLUDED
            and (lab_ids is None or lab.id in lab_ids) for bug in load_bugs(lab)]


def run_exam_checks(jobs: int, lab_ids: list[str] | None = None,
                    progress=None) -> tuple[list[str], list[ExamBugResult]]:
    """The three checks above (bugs of ``lab_ids`` only, when given); returns (violations, the
    planted bugs' results)."""
    problems: list[str] = []
    results: list[ExamBugResult] = []
    with tempfile.TemporaryDirectory(prefix="course-exam-ref-") as tmp:
        reference = Path(tmp) / "reference.json"
        problems += check_reference(reference)
        if progress:
            progress.finished("engine exam on the reference: "
                              + ("ok" if not problems else "FAILS"))
        if not reference.is_file():
            return problems, results
        bugs = engine_bugs(lab_ids)
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(check_stand_ins, reference): None}
            for lab_id, bug in bugs:
                futures[pool.submit(check_exam_bug, lab_id, bug, reference)] = (lab_id, bug)
            for fut in as_completed(futures):
                if futures[fut] is None:
                    found = fut.result()
                    problems += found
                    if progress:
                        progress.finished("engine exam, every piece a stand-in's: "
                                          + ("ok" if not found else "FAILS"))
                    continue
                r = fut.result()
                results.append(r)
                if r.status == "rejected" and r.blamed != (r.lab_id,):
                    problems.append(
                        f"engine exam: planted bug {r.bug.name!r} of lab {r.lab_id}: the "
                        f"bisection blamed {', '.join(r.blamed) or 'no lab'}"
                    )
                if r.status == "error":
                    problems.append(f"engine exam: planted bug {r.bug.name!r}: {r.detail}")
                if progress:
                    progress.finished(f"engine exam: lab {r.lab_id} planted bug {r.bug.name}: "
                                      f"{r.status}")
    order = {(lab_id, bug.name): i for i, (lab_id, bug) in enumerate(engine_bugs(lab_ids))}
    results.sort(key=lambda r: order[(r.lab_id, r.bug.name)])
    return problems, results


def load_expected_rejections(path: Path = EXAM_REJECTED) -> set[tuple[str, str]]:
    """``(lab id, bug name)`` of every line ``PP-LL bug-name`` of ``path`` (``#`` comments)."""
    if not path.is_file():
        return set()
    expected = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise ValueError(f"{path.name}:{number}: expected `PP-LL bug-name`, got {line!r}")
        expected.add((words[0], words[1]))
    return expected


def compare_with_expected(results: list[ExamBugResult], expected: set[tuple[str, str]],
                          listed_in: str = "planted_bugs/exam_rejected.txt"
                          ) -> tuple[list[str], list[str]]:
    """(violations, notes): listed bugs that ran and were not rejected; rejected bugs not listed.
    Bugs that did not run (a check of some labs only) are not compared."""
    ran = {(r.lab_id, r.bug.name): r for r in results}
    problems = [
        f"engine exam: planted bug {name!r} of lab {lab} is no longer rejected by the exam "
        f"({ran[(lab, name)].status}; it is listed in {listed_in}): an engine change lets that "
        "mistake through; find it, or take the bug off the list and say why"
        for lab, name in sorted(expected) if (lab, name) in ran
        and ran[(lab, name)].status != "rejected"
    ]
    notes = [
        f"engine exam: planted bug {r.bug.name!r} of lab {r.lab_id} is now rejected by the "
        f"exam: add `{r.lab_id} {r.bug.name}` to {listed_in}"
        for r in results if r.status == "rejected" and (r.lab_id, r.bug.name) not in expected
    ]
    return problems, notes


def exam_units(lab_ids: list[str] | None = None) -> int:
    """Progress lines run_exam_checks prints: the reference, the stand-ins, each bug."""
    return 2 + len(engine_bugs(lab_ids))
