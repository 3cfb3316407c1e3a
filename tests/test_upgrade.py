"""Given code is checked (course/labs/published.py) and carried over (course/student/upgrade.py).

The real case: a lab 03-01 starter written against the course before its given ``schedule()``
and ``_preempt()`` called lab 03-03's swap hooks (tests/fixtures/upgrade/, the starter as
published at 7eecd39). It passes 03-01's tests, so only a comparison of its given code with
today's notices it, and ``course upgrade`` carries its tasks onto today's starter.
"""

from __future__ import annotations

import ast
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from course.cli import main as course_main
from course.labs.catalog import Lab, discover, select
from course.labs.moves import old_imports, rewrite_imports
from course.labs.published import (
    changed_given,
    code_digest,
    docstring_digest,
    given_code_note,
    load_given,
    task_names,
    write_published,
)
from course.labs.tasks import _functions, _own_raises
from course.student.upgrade import merge_starters, upgrade_lab

OLD_03_01 = (Path(__file__).parent / "fixtures" / "upgrade"
             / "03-01-starter-before-swap-hooks.py.txt").read_text(encoding="utf-8")
DEMO = Path(__file__).parent / "fixtures" / "demo_lab"
DEMO_LAB = "phase-09-demo/labs/lab-01-demo"


def write_tasks(source: str, lab_id: str, leave: tuple[str, ...] = ()) -> str:
    """A student's starter: each task's raise (but those in ``leave``) becomes the student's
    lines, marked with the task's name so that the test can find them after a merge."""
    lines = source.splitlines()
    tasks = task_names(source, lab_id) - set(leave)
    edits = []
    for name, func in _functions(ast.parse(source)):
        if name in tasks:
            raise_ = min(_own_raises(func), key=lambda n: n.lineno)
            pad = " " * raise_.col_offset
            edits.append((raise_.lineno, raise_.end_lineno,
                          [f"{pad}# mine: how {name} works", f"{pad}return {name!r}"]))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = new
    return "\n".join(lines) + "\n"


def lab_03_01() -> tuple[str, dict]:
    (lab,) = select(discover(), ["03-01"])
    return (lab.path / "starter.py").read_text(encoding="utf-8"), load_given()["03-01"]


def test_given_code_is_compared_by_syntax_tree_not_text():
    one = ast.parse("def f(x):\n    '''Doc.'''\n    return x + 1\n").body[0]
    layout = ast.parse("def f( x ):  # a comment\n    '''Other doc.'''\n\n    return (x+1)\n")
    change = ast.parse("def f(x):\n    return x + 2\n").body[0]
    assert code_digest(one) == code_digest(layout.body[0])
    assert code_digest(one) != code_digest(change)


def test_the_digest_is_the_same_on_every_python_the_course_runs_on():
    """Python 3.12 parses fields 3.11 has not (``type_params``, empty when unused) and ends some
    nested format specs with an empty string part: neither may change a digest, or every
    published digest and record reads as changed on another Python (seen on an H200 machine's
    3.12: `course check` called lab 02-06's agreement record out of date)."""
    tree = ast.parse("def f(x, w):\n    return f'{x:<{w}}'\n")
    before = code_digest(tree)
    f = tree.body[0]
    f.type_params = []  # what 3.12 adds
    spec = f.body[0].value.values[0].format_spec
    spec.values.append(ast.Constant(value=""))  # what 3.12.1 adds
    assert code_digest(tree) == before
    spec.values.append(ast.Constant(value="!"))
    assert code_digest(tree) != before


def test_an_old_03_01_starter_is_named_for_its_given_code_and_todays_is_not():
    new, record = lab_03_01()
    note = given_code_note("03-01", write_tasks(OLD_03_01, "03-01"))
    assert note is not None and note.startswith("lab 03-01: given code changed: ")
    for name in ("Scheduler.schedule", "Scheduler._preempt", "Scheduler._free_request"):
        assert name in note.split(" -- ")[0], note
    assert note.endswith("run `python -m course upgrade 03-01`")
    # Today's starter with every task written and additions of the student's (a class
    # attribute, a helper method, a comment): its given code is the published code.
    mine = write_tasks(new, "03-01").replace(
        "    def schedule(self", "    my_count: int = 0\n\n    def _mine(self):\n"
        "        return 1\n\n    # the step\n    def schedule(self", 1)
    assert "my_count" in mine and changed_given("03-01", mine, record) == []


def test_an_old_03_01_starter_is_carried_onto_todays():
    new, record = lab_03_01()
    # Written against the old starter; _preempt was a task there and is not written yet.
    student = write_tasks(OLD_03_01, "03-01", leave=("Scheduler._preempt",))
    student = student.replace("from __future__ import annotations\n",
                              "from __future__ import annotations\n\nimport heapq  # mine\n")
    student = student.replace("\nclass Scheduler:", "\ndef my_helper(x):\n    return x\n\n\n"
                              "class Scheduler:")
    merge = merge_starters(student, new, "03-01", record)
    assert merge.conflicts == []
    assert {"Scheduler.schedule", "Scheduler._preempt", "Scheduler.__init__"} <= set(
        merge.updated)
    assert merge.kept == ["import heapq", "my_helper"]
    # Every task the old starter had and today's still has: the student's lines, in today's
    # starter; its given code is today's; the one task new since then is left to write.
    assert set(merge.carried) == task_names(new, "03-01") - {"Scheduler._preempt_by_recompute"}
    assert changed_given("03-01", merge.text, record) == []
    assert task_names(merge.text, "03-01") == {"Scheduler._preempt_by_recompute"}
    mine = [line.strip() for line in student.splitlines() if "mine" in line]
    merged = {line.strip() for line in merge.text.splitlines()}
    assert mine and all(line in merged for line in mine)
    assert merge.text.index("import heapq") < merge.text.index("class Scheduler:")


def test_a_conflict_is_reported_never_guessed():
    new, record = lab_03_01()
    # _preempt written when it was a task (today it is given) and a given method edited.
    student = write_tasks(OLD_03_01, "03-01")
    student = student.replace("        del self.requests[request.request_id]\n",
                              "        del self.requests[request.request_id]\n"
                              "        self.freed = True  # my change to given code\n")
    merge = merge_starters(student, new, "03-01", record)
    assert [c.split(":")[0] for c in merge.conflicts] == ["Scheduler._free_request",
                                                          "Scheduler._preempt"]
    assert "you changed this given code" in merge.conflicts[0]
    assert "you wrote it when it was a task" in merge.conflicts[1]
    assert merge.text.count("<<<<<<< yours") == 2
    for line in ("self.freed = True  # my change to given code", "return 'Scheduler._preempt'"):
        assert line in merge.text


@pytest.fixture
def demo(tmp_path: Path) -> tuple[Path, Lab]:
    """A course checkout (git) with lab 09-01 published twice: its given Counter.__init__
    changed in the second version. The student's starter is the first version, task 1 written."""
    root = tmp_path / "course-repo"
    shutil.copytree(DEMO, root / DEMO_LAB)
    (root / "course" / "labs").mkdir(parents=True)
    lab = Lab(root / DEMO_LAB)
    published = root / "course" / "labs" / "published_starters.json"
    starter = lab.path / "starter.py"
    first = starter.read_text()

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                       check=True, capture_output=True)

    write_published([lab], published)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "v1")
    starter.write_text(first.replace("self.value = start", "self.value = int(start)"))
    write_published([lab], published)
    git("commit", "-qam", "v2")
    starter.write_text(first.replace(
        'raise NotImplementedError(\n        "lab 09-01, task 1: implement add '
        '(hint: python -m course hint 09-01 1)"\n    )', "return a + b  # mine"))
    return root, lab


def test_upgrade_rewrites_the_starter_keeps_a_backup_and_says_so_first(demo):
    root, lab = demo
    starter = lab.path / "starter.py"
    before = starter.read_text()
    assert changed_given("09-01", before, load_given(
        root / "course/labs/published_given.json")["09-01"]) == ["Counter.__init__"]
    code, lines = upgrade_lab(lab, root)
    assert code == 0 and lines[0].startswith("lab 09-01: upgraded "), lines
    after = starter.read_text()
    assert "return a + b  # mine" in after and "self.value = int(start)" in after
    assert (lab.path / "starter.py.before-upgrade").read_text() == before
    assert upgrade_lab(lab, root)[1][0].startswith("lab 09-01: nothing to upgrade")


def test_bad_input_is_one_line_and_changes_nothing(demo, capsys):
    root, lab = demo
    starter = lab.path / "starter.py"
    starter.write_text(starter.read_text() + "\n<<<<<<< HEAD\n")
    before = sorted(p.name for p in lab.path.iterdir()), starter.read_text()
    code, lines = upgrade_lab(lab, root)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("error: lab 09-01: your starter.py does not parse (line ")
    assert "git checkout --ours" in lines[0] and "nothing changed" in lines[0]
    assert (sorted(p.name for p in lab.path.iterdir()), starter.read_text()) == before
    # An unknown lab, through the command line.
    assert course_main(["upgrade", "99-99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no lab named '99-99'") and "\n" not in err


def test_without_the_published_starter_in_history_nothing_changes(demo):
    root, lab = demo
    digest = hashlib.sha256(b"a starter nobody published").hexdigest()
    published = root / "course" / "labs" / "published_starters.json"
    published.write_text(f'{{"09-01": {{"starter.py": "{digest}"}}}}')
    before = (lab.path / "starter.py").read_text()
    code, lines = upgrade_lab(lab, root)
    assert code == 2 and "is not in this checkout's git history" in lines[0]
    assert (lab.path / "starter.py").read_text() == before


def test_a_carried_task_takes_todays_docstring_unless_the_student_edited_theirs():
    new = ('__all__ = ["f", "g"]\n\n\n# Task 1.\ndef f(x):\n    """New contract."""\n'
           '    raise NotImplementedError("lab 09-01, task 1: f")\n\n\n'
           'def g(x):\n    """New g."""\n    raise NotImplementedError("lab 09-01, task 2: g")\n')
    old = ('__all__ = ["f", "g"]\n\n\n# Task 1.\n# my own note\ndef f(x):\n    """Old contract."""'
           '\n    # mine\n    return x\n\n\ndef g(x):\n    """Old g, and my notes."""\n'
           '    return -x\n')
    published_old = old.replace("Old g, and my notes.", "Old g.")
    record = {"tasks": ["f", "g"], "task_docs": {
        name: [docstring_digest(node) for node in (new_node, old_node)]
        for name, new_node, old_node in zip(
            "fg", ast.parse(new).body[1:], ast.parse(published_old).body[1:])}}
    merge = merge_starters(old, new, "09-01", record)
    assert merge.conflicts == [] and merge.carried == ["f", "g"]
    assert merge.text == ('__all__ = ["f", "g"]\n\n\n# Task 1.\n# my own note\ndef f(x):\n'
                          '    """New contract."""\n    # mine\n    return x\n\n\n'
                          'def g(x):\n    """Old g, and my notes."""\n    return -x\n')


def test_what_an_upgrade_leaves_beside_the_starter_is_ignored_by_git():
    """`git add -A` after `course upgrade` must not commit the old starter or the merge: they
    are the student's scratch files, and only starter.py is graded."""
    from course.labs.catalog import REPO_ROOT

    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    (lab,) = select(discover(), ["03-01"])
    rel = lab.path.relative_to(REPO_ROOT)
    left = [rel / name for name in ("starter.py.before-upgrade", "starter.py.before-upgrade.2",
                                    "starter.py.merge")]

    def ignored(path: Path) -> bool:
        proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", str(path)],
                              cwd=REPO_ROOT, capture_output=True, text=True)
        assert proc.returncode in (0, 1), proc.stderr
        return proc.returncode == 0

    assert [p for p in left if not ignored(p)] == []
    assert not ignored(rel / "starter.py")



def test_a_carried_task_that_never_calls_a_new_given_helper_is_named():
    """The course added a given helper that a task's contract now relies on (lab 03-04's
    `_with_logprobs`); a body written before it cannot know to call it, and the upgrade cannot
    write the call: it names the task and the helper."""
    new = ('__all__ = ["Runner"]\n\n\nclass Runner:\n'
           '    def _with_logprobs(self, out):\n        """Given."""\n        return out\n\n'
           '    def step(self, x):\n        """Pass the result through the given\n'
           '        ``self._with_logprobs(out)``."""\n'
           '        raise NotImplementedError("lab 09-01, task 1: step")\n\n'
           '    def other(self, x):\n        """No helper here."""\n'
           '        raise NotImplementedError("lab 09-01, task 2: other")\n')
    old = ('__all__ = ["Runner"]\n\n\nclass Runner:\n'
           '    def step(self, x):\n        """Old contract."""\n        return x + 1\n\n'
           '    def other(self, x):\n        """Old."""\n        return x\n')
    record = {"tasks": ["Runner.step", "Runner.other"]}
    merge = merge_starters(old, new, "09-01", record)
    assert merge.conflicts == [] and merge.carried == ["Runner.step", "Runner.other"]
    assert merge.added == ["Runner._with_logprobs"]
    assert merge.uncalled == [("Runner.step", ["_with_logprobs"])]
    # A body that calls it is not named.
    calls = old.replace("return x + 1", "return self._with_logprobs(x + 1)")
    assert merge_starters(calls, new, "09-01", record).uncalled == []


def test_an_old_03_04_starter_is_told_which_logprob_helpers_its_bodies_must_call():
    """The real case (the 03-04 starter as published before 60a8c1b): its execute_model and
    _sample bodies predate the given log-probability helpers their docstrings now name."""
    old = (Path(__file__).parent / "fixtures" / "upgrade"
           / "03-04-starter-before-logprob-helpers.py.txt").read_text(encoding="utf-8")
    (lab,) = select(discover(), ["03-04"])
    new = (lab.path / "starter.py").read_text(encoding="utf-8")
    merge = merge_starters(write_tasks(old, "03-04"), new, "03-04", load_given()["03-04"])
    assert merge.conflicts == []
    uncalled = dict(merge.uncalled)
    assert "_with_logprobs" in uncalled["ModelRunner.execute_model"]
    assert uncalled["ModelRunner._sample"] == ["_gather_sample_logprobs"]


OLD_LAYOUT_03_01 = (Path(__file__).parent / "fixtures" / "upgrade"
                    / "03-01-starter-before-the-layout.py.txt").read_text(encoding="utf-8")


def test_a_starter_of_mini_vllms_old_layout_is_named_and_its_imports_follow_the_move():
    """Before mini_vllm's packages (issue 44), lab 03-01's starter imported
    mini_vllm.scheduler_output and mini_vllm.kv_cache_manager; a student may have added an
    import of their own from the old layout too."""
    new, record = lab_03_01()
    student = write_tasks(OLD_LAYOUT_03_01, "03-01")
    student = student.replace(
        "from __future__ import annotations\n",
        "from __future__ import annotations\n\n"
        "from mini_vllm.kv_cache_utils import BlockHash, hash_block_tokens  # mine\n", 1)
    note = given_code_note("03-01", student)
    assert note is not None and "mini_vllm.scheduler_output (now mini_vllm.core.sched.output, "\
        "mini_vllm.outputs)" in note and note.endswith("run `python -m course upgrade 03-01`")
    assert given_code_note("03-01", write_tasks(new, "03-01")) is None

    merge = merge_starters(student, new, "03-01", record)
    assert merge.conflicts == []
    text, rewritten = rewrite_imports(merge.text)
    # The course's imports are today's starter's; the student's own import is pointed at
    # mini_vllm.core.kv_cache_utils, comment kept; nothing of the old layout is left.
    assert rewritten == ["from mini_vllm.kv_cache_utils import BlockHash, hash_block_tokens # mine"
                         " -> from mini_vllm.core.kv_cache_utils import BlockHash, "
                         "hash_block_tokens  # mine"]
    assert old_imports(text) == [] and given_code_note("03-01", text) is None
    assert set(merge.carried) == task_names(new, "03-01") & task_names(OLD_LAYOUT_03_01, "03-01")
    compile(text, "starter.py", "exec")
