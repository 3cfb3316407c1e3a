"""planted_bugs/bug_verdicts.json (course/integrity/bug_record.py): a lab's recorded planted-bug
verdicts are replayed only while nothing that decides them changed, and the committed record
holds for today's course."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from course.integrity import bug_record
from course.integrity.bugs import PlantedBug
from course.labs.catalog import REPO_ROOT, discover

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "grading"


@pytest.fixture
def course(tmp_path: Path) -> Path:
    """A small course: the fixture phase, a mini_vllm, a planted-bug file and the shared files."""
    shutil.copytree(FIXTURE / "phase-09-demo", tmp_path / "phase-09-demo")
    (tmp_path / "mini_vllm").mkdir()
    (tmp_path / "mini_vllm" / "ref.py").write_text('def f(x):\n    """Doc."""\n    return x\n')
    (tmp_path / "planted_bugs").mkdir()
    (tmp_path / "planted_bugs" / "09-01.py").write_text("BUGS = []\n")
    return tmp_path


def lab_of(root: Path):
    return next(lab for lab in discover(root) if lab.id == "09-01")


def test_the_digest_follows_the_code_that_decides_a_verdict(course):
    lab = lab_of(course)
    before = bug_record.lab_digest(lab, course)
    # What no verdict reads: a docstring, a comment, the lab's README.
    ref = course / "mini_vllm" / "ref.py"
    ref.write_text('def f(x):  # a comment\n    """Other doc."""\n    return x\n')
    (lab.path / "README.md").write_text("# Reworded\n")
    assert bug_record.lab_digest(lab, course) == before
    # What can change one: the reference code, the lab's tests, its planted bugs.
    for path, text in ((ref, "def f(x):\n    return x + 1\n"),
                       (lab.test_file, lab.test_file.read_text() + "\nX = 1\n"),
                       (course / "planted_bugs" / "09-01.py", "BUGS = [1]\n")):
        old = path.read_text()
        path.write_text(text)
        assert bug_record.lab_digest(lab, course) != before, path
        path.write_text(old)
    assert bug_record.lab_digest(lab, course) == before


def test_verdicts_are_replayed_only_for_todays_inputs_and_bugs(course, monkeypatch):
    lab = lab_of(course)
    bug = PlantedBug("off-by-one", "a planted mistake", "x.py", "a", "b")

    class Result:
        def __init__(self, status):
            self.bug, self.status, self.detail, self.seen_by, self.seconds = (
                bug, status, "by test_x", "test_x", 1.0)

    def verdicts(bugs):
        return bug_record.recorded_verdicts(lab, bugs, record, bug_record.lab_digest(lab, course))

    record = {"labs": {lab.id: bug_record.lab_entry(bug_record.lab_digest(lab, course),
                                                     [Result("rejected")])}}
    (verdict,) = verdicts([bug])
    assert verdict["status"] == "rejected"
    # A bug the record does not name, or inputs changed since: everything runs.
    other = PlantedBug("another", "another mistake", "x.py", "a", "c")
    assert verdicts([bug, other]) is None
    (course / "mini_vllm" / "ref.py").write_text("def f(x):\n    return -x\n")
    assert verdicts([bug]) is None
    # A different Hypothesis profile draws other examples: not the recorded run either.
    (course / "mini_vllm" / "ref.py").write_text('def f(x):\n    """Doc."""\n    return x\n')
    assert verdicts([bug]) is not None
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "thorough")
    assert verdicts([bug]) is None


def test_the_committed_record_holds_every_labs_verdicts_and_all_are_rejections():
    """Every lab's planted bugs have a recorded verdict, each a rejection: CI replays them, so
    a record that went stale is a note there, never a silently skipped bug."""
    record = bug_record.load_record()
    assert record.get("command") == bug_record.WRITE_HINT
    from course.integrity.bugs import load_bugs

    for lab in discover():
        entry = record["labs"].get(lab.id)
        assert entry is not None, f"lab {lab.id} has no recorded verdicts: {bug_record.WRITE_HINT}"
        assert set(entry["bugs"]) == {b.name for b in load_bugs(lab)}, lab.id
        bad = {n: v["status"] for n, v in entry["bugs"].items() if v["status"] != "rejected"}
        assert not bad, f"lab {lab.id}: {bad}"
