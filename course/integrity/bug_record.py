"""`course check`'s planted-bug verdicts, recorded: a lab's planted bugs (and the engine exam over
the engine labs' bugs) run again only when something that decides their verdicts changed.

Every planted bug is a run of its lab's tests on a copy of the course with the bug in place; all
of them, and the engine exam over them, take about 13 of CI's minutes on two cores. What decides
a bug's verdict is known: the lab's folder, its planted bugs, the test recorded to run first
(seen_by.json), its labs.toml table, and the code the tests run besides the lab's own:
``mini_vllm`` (the references and oracles the tests compare with), the course's test tooling
(``course/labs``), this check (``course/integrity``), the root conftest, the pinned
requirements; and the environment a lab's remembered result is keyed by
(:func:`course.labs.results.environment`: Python, torch, pytest and Hypothesis versions, the
machine, a visible GPU, the variables that choose a test's tier or profile). The exam's verdicts
depend on every engine lab's folder and bugs, on ``course/engine`` and on the exam lists too.
Python files count by their code, as in the agreement record (docstrings, comments and a test's
assert messages decide no verdict): :func:`course.integrity.agreement.graded_bytes`.

``planted_bugs/bug_verdicts.json`` holds, per lab, the digest of those inputs and each bug's
verdict, and the exam's digest and results. `course check` replays a lab's verdicts when its
digest still holds (a recorded "NOT REJECTED" is replayed as the violation it is) and runs the
lab's bugs otherwise, with a note; ``python -m course check --write-bug-record`` runs them all
and writes the record (with ``HYPOTHESIS_PROFILE=ci``, as CI runs). A record can only skip work:
with none, or a stale one, everything runs.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from course.integrity.agreement import NOT_GRADED, graded_bytes
from course.integrity.bugs import BUGS_DIR, PlantedBug, load_seen_by
from course.labs.catalog import REPO_ROOT, Lab, lab_metadata
from course.labs.results import environment, tree_digest

RECORD = "bug_verdicts.json"
WRITE_HINT = "python -m course check --write-bug-record"
# The code a lab's tests and the checks run, besides the lab's folder and its bugs.
SHARED = ("mini_vllm", "course/labs", "course/integrity", "conftest.py", "pyproject.toml",
          "requirements.txt")
# ... and the engine exam, besides those and every engine lab's folder and bugs.
EXAM_SHARED = ("course/engine", f"{BUGS_DIR}/exam_rejected.txt",
               f"{BUGS_DIR}/exam_not_rejected.txt")


@lru_cache(maxsize=4096)
def _graded(file: Path, mtime_ns: int, size: int) -> bytes:
    """graded_bytes, parsed once per version of a file (every lab's digest reads mini_vllm)."""
    return graded_bytes(file)


def _code(file: Path) -> bytes:
    stat = file.stat()
    return _graded(file, stat.st_mtime_ns, stat.st_size)


def _feed(h, root: Path, rel: str) -> None:
    """Every file under ``root / rel`` by name and code, in a fixed order (what no test reads,
    NOT_GRADED, left out)."""
    tree_digest(h, root, rel, read=_code, skip=NOT_GRADED)


def _environment() -> bytes:
    """The same facts a lab's remembered result is keyed by (course/labs/results.py)."""
    return json.dumps(environment(), sort_keys=True).encode()


def _lab_inputs(h, lab: Lab, root: Path) -> None:
    _feed(h, root, lab.path.relative_to(root).as_posix())
    _feed(h, root, f"{BUGS_DIR}/{lab.id}.py")
    h.update(json.dumps(lab_metadata().get(lab.id, {}), sort_keys=True).encode())
    h.update(json.dumps(load_seen_by(root).get(lab.id, {}), sort_keys=True).encode())


def lab_digest(lab: Lab, root: Path = REPO_ROOT) -> str:
    """SHA-256 of what decides the verdicts of ``lab``'s planted bugs (module doc)."""
    h = hashlib.sha256(_environment())
    _lab_inputs(h, lab, root)
    for rel in SHARED:
        _feed(h, root, rel)
    return h.hexdigest()


def exam_digest(labs: list[Lab], root: Path = REPO_ROOT) -> str:
    """SHA-256 of what decides the engine exam's verdicts over ``labs`` (the engine labs)."""
    h = hashlib.sha256(_environment())
    for lab in sorted(labs, key=lambda lab: lab.id):
        _lab_inputs(h, lab, root)
    for rel in SHARED + EXAM_SHARED:
        _feed(h, root, rel)
    return h.hexdigest()


def record_path(root: Path = REPO_ROOT) -> Path:
    return root / BUGS_DIR / RECORD


def load_record(root: Path = REPO_ROOT) -> dict:
    """``{"labs": {lab id: {"digest", "bugs": {name: verdict}}}, "exam": {"digest", "problems",
    "results"}}``; empty when there is none (then everything runs: slower, never wrong)."""
    try:
        data = json.loads(record_path(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(record: dict, root: Path = REPO_ROOT) -> Path:
    path = record_path(root)
    record = {"command": WRITE_HINT, "labs": dict(sorted(record.get("labs", {}).items())),
              **({"exam": record["exam"]} if record.get("exam") else {})}
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def recorded_verdicts(lab: Lab, bugs: list[PlantedBug], record: dict,
                      digest: str) -> list[dict] | None:
    """The recorded verdict of each of ``bugs`` (in their order) when ``lab``'s entry holds for
    today's inputs (``digest``, its :func:`lab_digest`) and names every one of them; None
    otherwise (then they run)."""
    entry = record.get("labs", {}).get(lab.id)
    if not isinstance(entry, dict) or entry.get("digest") != digest:
        return None
    verdicts = entry.get("bugs", {})
    if set(verdicts) != {b.name for b in bugs}:
        return None
    return [verdicts[b.name] for b in bugs]


def lab_entry(digest: str, results) -> dict:
    """A lab's record from its BugResults (course/integrity/checks.py), under the digest taken
    *before* they ran: a file edited during the run then reads as changed, never as checked."""
    return {"digest": digest,
            "bugs": {r.bug.name: {"status": r.status, "detail": r.detail, "seen_by": r.seen_by,
                                  "seconds": round(r.seconds, 1)} for r in results}}


def recorded_exam(record: dict, digest: str) -> dict | None:
    """The recorded exam ({"problems", "results"}) when it holds for today's inputs (``digest``,
    the :func:`exam_digest`)."""
    entry = record.get("exam")
    if not isinstance(entry, dict) or entry.get("digest") != digest:
        return None
    return entry


def exam_entry(digest: str, problems: list[str], results) -> dict:
    """The exam's record from its ExamBugResults (course/integrity/exam_check.py), under the
    digest taken before it ran."""
    return {"digest": digest, "problems": problems,
            "results": [{"lab": r.lab_id, "bug": r.bug.name, "status": r.status,
                         "detail": r.detail, "blamed": list(r.blamed), "case": r.case}
                        for r in results]}
