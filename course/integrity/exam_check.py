"""The engine exam in ``python -m course check``.

Three things are checked, each in its own worker process (:mod:`course.engine.worker`):

1. the reference engine passes every graded case (a violation otherwise; the run also writes the
   reference statistics and oracle completions that the other runs reuse);
2. stand-in students (:mod:`course.integrity.shadow`) whose every engine piece is a private copy
   of the reference pass it too: the composition works with objects that are not the reference's;
3. every planted bug of an engine lab, planted in that lab's private copy only, is run through
   the exam, and its first failing case again with that lab alone the student's. The report says
   which bugs the exam rejects (many lab-level mistakes, a missing input check say, cannot change
   what an engine does: those are reported, not violations) and whether the bisection blamed
   the bug's lab; a failure that lab alone does not reproduce is a violation.

Two lists under ``planted_bugs/`` pin the verdicts. ``exam_rejected.txt``: the bugs the exam
rejects, each with the case that rejected it (run first, so the run stops at once); one the exam
lets through fails the check. ``exam_not_rejected.txt``: the bugs it lets through; they are not
run again (a rerun could only give a note, never a violation), unless ``every_bug``. ``course check
--write-exam-lists`` runs every bug and writes both.
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
EXAM_NOT_REJECTED = REPO_ROOT / "planted_bugs" / "exam_not_rejected.txt"


@dataclass
class ExamBugResult:
    lab_id: str
    bug: PlantedBug
    status: str  # "rejected", "not rejected", "not an engine piece", "error"
    detail: str = ""
    blamed: tuple[str, ...] = ()
    case: str = ""  # the case that rejected it


def _job(labs: list[str], reference: Path, *, fail_fast: bool, bisect: bool,
         first: str = "") -> dict:
    return {"mode": "exam", "labs": labs, "cases": [c.name for c in cases(GRADED_SWEEP)],
            "sweep": GRADED_SWEEP, "timeout": CASE_TIMEOUT_S, "gpu": False,
            "fail_fast": fail_fast, "bisect": bisect, "reference": str(reference),
            "first": first}


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


def check_exam_bug(lab_id: str, bug: PlantedBug, reference: Path,
                   first: str = "") -> ExamBugResult:
    """Run the exam with ``bug`` planted in lab ``lab_id``'s stand-in, case ``first`` first."""
    labs = [lab.id for lab in engine_labs() if lab.id not in CPU_LABS_EXCLUDED]
    with tempfile.TemporaryDirectory(prefix="course-exam-bug-") as tmp:
        try:
            root = shadow_tree(Path(tmp) / "tree", (lab_id, bug))
        except NotAnEnginePiece as exc:
            return ExamBugResult(lab_id, bug, "not an engine piece", str(exc))
        except ValueError as exc:
            return ExamBugResult(lab_id, bug, "error", str(exc))
        # The bisection of the first failure, over the bug's lab only: with another lab alone
        # the student's, the engine holds no copy of the bug (it lives in this lab's private
        # package), so those runs are the stand-ins' (checked above), the same for every bug.
        job = {**_job(labs, reference, fail_fast=True, bisect="first", first=first),
               "bisect_labs": [lab_id]}
        report = run_exam_job(job, _budget(job), root)
    failing = [c for c in report["cases"] if c["outcome"] not in ("passed", "not run")]
    if not failing:
        if report["error"]:
            return ExamBugResult(lab_id, bug, "error", report["error"])
        return ExamBugResult(lab_id, bug, "not rejected", "every case passes")
    blamed = tuple((report.get("bisection") or {}).get("blamed", ()))
    return ExamBugResult(lab_id, bug, "rejected",
                         f"by {failing[0]['case']}: {failing[0]['message']}", blamed,
                         failing[0]["case"])


def engine_bugs(lab_ids: list[str] | None = None) -> list[tuple[str, PlantedBug]]:
    """The planted bugs of the engine labs (of ``lab_ids`` only, when given)."""
    return [(lab.id, bug) for lab in engine_labs() if lab.id not in CPU_LABS_EXCLUDED
            and (lab_ids is None or lab.id in lab_ids) for bug in load_bugs(lab)]


def recorded_results(entries: list[dict]) -> list[ExamBugResult]:
    """ExamBugResults from their record (course/integrity/bug_record.py's exam entry)."""
    bugs = {(lab_id, bug.name): bug for lab_id, bug in engine_bugs()}
    return [ExamBugResult(e["lab"], bugs[(e["lab"], e["bug"])], e["status"], e.get("detail", ""),
                          tuple(e.get("blamed", ())), e.get("case", "")) for e in entries]


def bugs_to_run(lab_ids: list[str] | None = None,
                every_bug: bool = False) -> list[tuple[str, PlantedBug]]:
    """The engine bugs this check runs: all of them with ``every_bug``, else all but those
    ``exam_not_rejected.txt`` lists."""
    if every_bug:
        return engine_bugs(lab_ids)
    let_through = load_bug_list(EXAM_NOT_REJECTED)
    return [(lab_id, bug) for lab_id, bug in engine_bugs(lab_ids)
            if (lab_id, bug.name) not in let_through]


def run_exam_checks(jobs: int, lab_ids: list[str] | None = None, progress=None,
                    every_bug: bool = False) -> tuple[list[str], list[ExamBugResult]]:
    """The three checks above (bugs of ``lab_ids`` only, when given; see :func:`bugs_to_run`);
    returns (violations, the planted bugs' results)."""
    problems: list[str] = []
    results: list[ExamBugResult] = []
    bugs = bugs_to_run(lab_ids, every_bug)
    first_case = {} if every_bug else load_bug_list(EXAM_REJECTED)
    with tempfile.TemporaryDirectory(prefix="course-exam-ref-") as tmp:
        reference = Path(tmp) / "reference.json"
        problems += check_reference(reference)
        if progress:
            progress.finished("engine exam on the reference: "
                              + ("ok" if not problems else "FAILS"))
        if not reference.is_file():
            return problems, results
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(check_stand_ins, reference): None}
            for lab_id, bug in bugs:
                first = first_case.get((lab_id, bug.name), "")
                futures[pool.submit(check_exam_bug, lab_id, bug, reference, first)] = bug
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
    order = {(lab_id, bug.name): i for i, (lab_id, bug) in enumerate(bugs)}
    results.sort(key=lambda r: order[(r.lab_id, r.bug.name)])
    return problems, results


def load_bug_list(path: Path) -> dict[tuple[str, str], str]:
    """``{(lab id, bug name): case}`` from the lines ``PP-LL bug-name [case]`` of ``path``
    (``#`` starts a comment; the case is "" when not given)."""
    if not path.is_file():
        return {}
    listed = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) not in (2, 3):
            raise ValueError(f"{path.name}:{number}: expected `PP-LL bug-name [case]`, "
                             f"got {line!r}")
        listed[(words[0], words[1])] = words[2] if len(words) == 3 else ""
    return listed


def compare_with_expected(results: list[ExamBugResult], rejected: dict[tuple[str, str], str],
                          not_rejected: dict[tuple[str, str], str] | None = None
                          ) -> tuple[list[str], list[str]]:
    """(violations, notes). A violation: a bug ``rejected`` lists that ran and was not
    rejected. Notes: a bug neither list has (or now on the other side), a bug rejected by
    another case than the one recorded. Bugs that did not run are not compared."""
    not_rejected = not_rejected or {}
    ran = {(r.lab_id, r.bug.name): r for r in results}
    problems = [
        f"engine exam: planted bug {name!r} of lab {lab} is no longer rejected by the exam "
        f"({ran[(lab, name)].status}; it is listed in planted_bugs/{EXAM_REJECTED.name}): an "
        "engine change lets that mistake through; find it, or take the bug off the list and say why"
        for lab, name in sorted(rejected) if (lab, name) in ran
        and ran[(lab, name)].status != "rejected"
    ]
    write = "record them: python -m course check --write-exam-lists"
    notes = [
        f"engine exam: planted bug {r.bug.name!r} of lab {r.lab_id} is "
        + (f"now rejected by the exam (by {r.case}); {write}" if r.status == "rejected" else
           f"not rejected by the exam and in neither list; {write}")
        for r in results if (r.status == "rejected" and (r.lab_id, r.bug.name) not in rejected)
        or (r.status == "not rejected"
            and (r.lab_id, r.bug.name) not in not_rejected.keys() | rejected.keys())
    ]
    moved = [r for r in results if r.status == "rejected"
             and rejected.get((r.lab_id, r.bug.name)) not in ("", None, r.case)]
    if moved:
        notes.append(f"engine exam: {len(moved)} planted bug(s) were rejected by another case "
                     f"than {EXAM_REJECTED.name} records (same verdict, a slower run); {write}")
    return problems, notes


def write_exam_lists(results: list[ExamBugResult]) -> list[Path]:
    """Update both lists with the verdicts of ``results`` (other bugs keep their lines), in the
    order of :func:`engine_bugs`; the comment lines at the top of each file are kept."""
    verdicts = {(r.lab_id, r.bug.name): r for r in results
                if r.status in ("rejected", "not rejected")}
    order = {(lab_id, bug.name): i for i, (lab_id, bug) in enumerate(engine_bugs())}
    written = []
    for path, status in ((EXAM_REJECTED, "rejected"), (EXAM_NOT_REJECTED, "not rejected")):
        keep = {key: case for key, case in load_bug_list(path).items() if key not in verdicts}
        keep.update({key: r.case for key, r in verdicts.items() if r.status == status})
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        header = [line for line in text.splitlines() if line.startswith("#")]
        lines = [" ".join(w for w in (*key, case) if w)
                 for key, case in sorted(keep.items(), key=lambda kv: order.get(kv[0], 1 << 30))]
        path.write_text("\n".join(header + lines) + "\n", encoding="utf-8")
        written.append(path)
    return written


def exam_units(lab_ids: list[str] | None = None, every_bug: bool = False) -> int:
    """Progress lines run_exam_checks prints: the reference, the stand-ins, each bug."""
    return 2 + len(bugs_to_run(lab_ids, every_bug))
