"""`course check`'s null-starter check: no graded test passes when the tasks do nothing.

Each lab's tests run (plain pytest, ``LAB_IMPL=starter``) on a copy of the course whose
``starter.py`` is one of the lab's null variants (course/integrity/null_starters.py). A graded
test (not ``starter_ok``) that passes there gives points for no work: a violation that names the
lab, the variant and the test.

Four runs per lab are too slow for every CI run, so their outcome is recorded in
``planted_bugs/null_starters.json`` under a digest of what decides it: the lab's starter.py and
test_lab.py and the variants' generator. `course check` reruns a lab only when that digest
changed (and a lab whose record holds a passing test fails without a rerun);
``python -m course check --write-null-record`` reruns the labs it checks and writes the record.

A lab whose starter.py has no task body is out of scope: lab 02-06's student writes starter.cu,
and its starter.py only builds it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.integrity import null_starters
from course.integrity.agreement import graded_bytes
from course.integrity.bugs import BUGS_DIR
from course.integrity.checks import CopySlots
from course.labs.catalog import Lab
from course.labs.runner import run_lab

RECORD = "null_starters.json"
# A null body can turn a loop of a test into one that never ends (a step that schedules nothing);
# such a test fails at this limit rather than holding the run for the default 300 s.
NULL_TEST_TIMEOUT = 60
WRITE_HINT = "python -m course check {lab} --write-null-record"


def course_root(lab: Lab) -> Path:
    """The course folder ``lab`` belongs to (phase-PP-*/labs/lab-LL-* sits two levels below)."""
    return lab.phase_dir.parent


def in_scope(lab: Lab) -> bool:
    """A lab whose starter.py has task bodies to empty (one that does not parse has none here;
    the lab's other checks report it)."""
    path = lab.path / "starter.py"
    try:
        return path.is_file() and bool(null_starters.task_bodies(path.read_text(encoding="utf-8")))
    except SyntaxError:
        return False


def out_of_scope_note(lab: Lab) -> str:
    what = ("its student file is starter.cu and its starter.py has no task"
            if (lab.path / "starter.cu").is_file() else "its starter.py has no task to empty")
    return f"null starters: not checked ({what})"


def inputs_digest(lab: Lab) -> str:
    """SHA-256 of what decides the null variants' outcome: the lab's starter.py and test_lab.py
    and the generator's source (their code: docstrings, comments and the tests' assert
    messages change no outcome)."""
    h = hashlib.sha256()
    for path in (lab.path / "starter.py", lab.test_file, Path(null_starters.__file__)):
        data = graded_bytes(path)
        h.update(f"{path.name} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


def record_path(root: Path) -> Path:
    return root / BUGS_DIR / RECORD


def load_record(root: Path) -> dict[str, dict]:
    """``{lab id: {"digest", "passing": {variant: [test ids]}, "broken": {variant: why},
    "seconds"}}``; empty when there is none (then every lab runs: slower, never wrong)."""
    try:
        data = json.loads(record_path(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(record: dict[str, dict], root: Path) -> Path:
    path = record_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n", encoding="utf-8")
    return path


@dataclass
class NullRun:
    """One lab's tests on one null variant of its starter."""

    lab: Lab
    variant: str
    passing: list[str] = field(default_factory=list)  # graded tests that passed (ids in the file)
    broken: str = ""  # why the run gave no results, when it gave none
    seconds: float = 0.0


def run_variant(lab: Lab, variant: str, slots: CopySlots) -> NullRun:
    """Run ``lab``'s tests with ``LAB_IMPL=starter`` on a copy of its course whose starter.py is
    the ``variant`` null starter."""
    start = time.perf_counter()
    root = course_root(lab)
    source = (lab.path / "starter.py").read_text(encoding="utf-8")
    result = NullRun(lab, variant)
    try:
        text = null_starters.null_variant(source, variant)
    except (SyntaxError, ValueError) as exc:
        result.broken = f"cannot make the variant: {exc}"
        return result
    with slots.copy_of(root) as copy:
        (copy / lab.path.relative_to(root) / "starter.py").write_text(text, encoding="utf-8")
        run = run_lab(lab, "starter", root=copy, test_timeout=NULL_TEST_TIMEOUT,
                      extra_env={"MINI_VLLM_BUILD_DIR": str(slots.build_dir)})
    if run.broken:
        tail = " | ".join(run.output.strip().splitlines()[-3:])
        result.broken = f"the test run broke (pytest exit {run.exit_code}): {tail}"
    result.passing = [t["nodeid"].split("::", 1)[-1] for t in run.by_outcome("passed")]
    result.seconds = time.perf_counter() - start
    return result


def entry(lab: Lab, runs: list[NullRun]) -> dict:
    """The record of ``lab``'s runs (one per variant)."""
    return {
        "digest": inputs_digest(lab),
        "passing": {r.variant: r.passing for r in runs if r.passing},
        "broken": {r.variant: r.broken for r in runs if r.broken},
        "seconds": round(sum(r.seconds for r in runs), 1),
    }


def violations(lab: Lab, lab_entry: dict, recorded: bool) -> list[str]:
    """One line per graded test that passes on a null variant (first: lab, variant, test), and
    per run that broke."""
    where = f" (recorded in {BUGS_DIR}/{RECORD})" if recorded else ""
    found = []
    for variant, tests in lab_entry.get("passing", {}).items():
        for test in tests:
            found.append(f"null starter {variant!r} passes graded test {test}: "
                         f"{null_starters.VARIANTS.get(variant, variant)}, and a test must not "
                         f"give points for that{where}")
    for variant, why in lab_entry.get("broken", {}).items():
        found.append(f"null starter {variant!r}: {why}{where}")
    return found


def is_current(lab: Lab, record: dict[str, dict]) -> bool:
    """The record holds ``lab``'s outcome for its present inputs."""
    return record.get(lab.id, {}).get("digest") == inputs_digest(lab)


def summary(lab: Lab, lab_entry: dict, recorded: bool) -> str:
    """One line for `course check`'s report."""
    seconds = lab_entry.get("seconds", 0)
    how = ("recorded" if recorded
           else f"ran {len(null_starters.VARIANTS)} variants ({seconds:g} s)")
    bad = sum(len(t) for t in lab_entry.get("passing", {}).values())
    broken = len(lab_entry.get("broken", {}))
    verdict = "no graded test passes" if not bad and not broken else (
        f"{bad} graded test pass(es)" + (f", {broken} broken run(s)" if broken else ""))
    return f"{lab.id}  {how}: {verdict}"
