"""Assertions that teach: a failed assertion a student can reach names the invariant, the values
and the student's function.

Two halves. The rule, read with `ast` (milliseconds): in every lab's tests a bare ``assert``
sits directly in a test function, whose docstring or sentence-like name the report then shows
(course/labs/assertions.py); an assertion anywhere else in a test file (a simulator's check, a
state machine's rule, a helper) carries a message of its own, since the report can name only
the test; and the ``mini_vllm`` modules a starter imports (the reference code a student's piece
calls into) hold no bare ``assert``. The plugin, run on a small demo lab: the line above pytest's
values for each kind of failure.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course.labs.assertions import (
    TASKS_PATH,
    first_sentence,
    published_task_functions,
    sentence,
)
from course.labs.catalog import REPO_ROOT, discover

LAB_TEST_FILES = {
    f"{lab.id}/{p.name}": p
    for lab in discover(REPO_ROOT)
    for p in sorted(lab.path.glob("test_*.py"))
}
MIN_NAME_WORDS = 3  # "test_fork_counts_holders": a name that reads as the rule it checks


def _bare_asserts(tree: ast.AST):
    """(assert node, enclosing function or None, is that function a test) for every assert
    without a message; nested functions and classes count as not a test."""
    def walk(node, func, is_test):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                top_level_test = func is None and not in_class[0] and child.name.startswith(
                    "test_"
                )
                yield from walk(child, child, top_level_test)
            elif isinstance(child, ast.ClassDef):
                in_class[0] += 1
                yield from walk(child, func, False)
                in_class[0] -= 1
            else:
                if isinstance(child, ast.Assert) and child.msg is None:
                    yield child, func, is_test
                yield from walk(child, func, is_test)

    in_class = [0]
    yield from walk(tree, None, False)


@pytest.mark.parametrize("name", LAB_TEST_FILES)
def test_every_bare_assert_in_a_lab_test_is_one_the_report_can_explain(name):
    path = LAB_TEST_FILES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    problems = []
    for node, func, is_test in _bare_asserts(tree):
        where = f"{path.name}:{node.lineno}"
        if not is_test:
            owner = func.name if func is not None else "module level"
            problems.append(
                f"{where} in {owner}: a bare assert outside a test function; give it a message "
                f"that names the invariant and the values (the report can only name the test)"
            )
        elif ast.get_docstring(func) is None and len(sentence(func.name).split()) < MIN_NAME_WORDS:
            problems.append(
                f"{where} in {func.name}: give the test a docstring or a name that states the "
                f"rule it checks (at least {MIN_NAME_WORDS} words), or give the assert a message"
            )
    assert not problems, (
        f"{len(problems)} assertion(s) in {path.relative_to(REPO_ROOT)} would fail without "
        f"saying which rule broke:\n" + "\n".join(problems)
    )


def _modules_starters_import() -> list[Path]:
    """The mini_vllm modules that any lab's starter.py imports (the code a student's piece
    calls into)."""
    found = set()
    for lab in discover(REPO_ROOT):
        starter = lab.path / "starter.py"
        if not starter.is_file():
            continue
        for node in ast.walk(ast.parse(starter.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mini_vllm"):
                base = REPO_ROOT / node.module.replace(".", "/")
                for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                    if candidate.is_file():
                        found.add(candidate)
    return sorted(found)


STARTER_IMPORTS = _modules_starters_import()


def test_starters_import_mini_vllm_modules():
    """The list below is not empty by accident: the starters do import reference pieces."""
    names = {p.relative_to(REPO_ROOT).as_posix() for p in STARTER_IMPORTS}
    assert {"mini_vllm/core/block_pool.py", "mini_vllm/core/kv_cache_manager.py"} <= names, (
        f"expected lab starters to import the block pool and the cache manager; found {names}"
    )


@pytest.mark.parametrize(
    "path", STARTER_IMPORTS, ids=[p.relative_to(REPO_ROOT).as_posix() for p in STARTER_IMPORTS]
)
def test_reference_code_a_starter_calls_into_has_no_bare_assert(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is None]
    assert not bare, (
        f"{path.relative_to(REPO_ROOT)} has a bare assert at line(s) {bare}: a student's piece "
        f"that breaks it gets an AssertionError with no words; say which invariant broke, "
        f"with the values, and which of the student's methods to look at"
    )


def test_the_table_of_task_functions_matches_the_starters():
    """The report names only the student's tasks, read from course/labs/task_functions.json
    (a student's starter no longer marks the tasks done): it must list the published ones."""
    recorded = json.loads(TASKS_PATH.read_text(encoding="utf-8"))
    assert recorded == published_task_functions(REPO_ROOT), (
        "course/labs/task_functions.json is not the starters' task functions; after changing "
        "a starter's tasks, write it anew with `python -m course.labs.assertions`"
    )


# ---------------------------------------------------------------------------------------------
# The plugin on a demo lab, run as a student would (LAB_IMPL=starter)
# ---------------------------------------------------------------------------------------------

LAB = "phase-09-demo/labs/lab-01-asserts"

STARTER = '''
__all__ = ["Box", "sort_desc", "total"]


class Box:
    def __init__(self):
        self.items = []

    def put(self, x):
        self.items.append(x)
        self.items.append(x)  # the student's bug: every item twice



def sort_desc(xs):
    return sorted(xs)  # the student's bug: smallest first


def total(xs):
    assert all(x >= 0 for x in xs)  # the student's own check
    return sum(xs)
'''

TESTS = '''
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from course.labs.loader import load_lab

lab = load_lab(__file__)


def test_put_stores_one_item_per_call():
    """Box.put stores each item once. A second sentence the report leaves out."""
    box = lab.Box()
    box.put(3)
    assert len(box.items) == 1


def test_sorting_gives_the_largest_first():
    assert lab.sort_desc([1, 3, 2]) == [3, 2, 1], "sort_desc puts the largest first"


def check_descending(xs):
    assert all(a >= b for a, b in zip(xs, xs[1:])), f"{xs} is not descending"


def test_sorted_output_is_descending():
    check_descending(lab.sort_desc([2, 5, 1]))


def test_total_takes_negative_numbers():
    assert lab.total([-1, 2]) == 1


def test_sorting_refuses_a_string():
    with pytest.raises(TypeError):
        lab.sort_desc("abc")


class BoxMachine(RuleBasedStateMachine):
    """Every put adds exactly one item."""

    def __init__(self):
        super().__init__()
        self.box = lab.Box()
        self.n = 0

    @rule(x=st.integers(0, 3))
    def add(self, x):
        self.box.put(x)
        self.n += 1
        assert len(self.box.items) == self.n, "one item per put"


test_a_box_counts_its_puts = BoxMachine.TestCase
'''


def run_demo_lab(root: Path) -> str:
    """The demo lab's tests run as a student would run them, in the course at `root`, every
    failure rendered in full (--every-failure); their output."""
    lab = root / LAB
    lab.mkdir(parents=True)
    for name, text in {"starter.py": STARTER, "solution.py": STARTER, "test_lab.py": TESTS,
                       "README.md": "# Lab 09-01: Asserts\n"}.items():
        (lab / name).write_text(textwrap.dedent(text).lstrip())
    env = dict(os.environ, PYTHONPATH=str(root), LAB_IMPL="starter")
    env.pop("HYPOTHESIS_PROFILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", LAB, "-q", "-p", "no:randomly", "--every-failure"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stdout


def _e_lines(out: str, test: str) -> list[str]:
    """The `E` lines of one test's report, without the exception's type."""
    section = out.split(f"_ {test} _", 1)[1]
    section = re.split(r"\n_{3,} \S+ _{3,}\n|\n=+ short test summary", section, maxsplit=1)[0]
    return [
        line[1:].strip().removeprefix("AssertionError: ")
        for line in section.splitlines()
        if line.startswith("E ")
    ]


def at(name: str) -> str:
    """``name (starter.py:LINE)``: where the demo starter defines `name`."""
    source = textwrap.dedent(STARTER).lstrip().splitlines()
    line = next(i for i, text in enumerate(source, 1) if f"def {name.split('.')[-1]}(" in text)
    return f"{name} (starter.py:{line})"


def test_the_report_names_the_invariant_and_the_students_function(course_skeleton):
    """Every kind of failure of the demo lab, from one run (one subprocess: the cases would
    otherwise start it once per xdist worker)."""
    out = run_demo_lab(course_skeleton(pytest_cache=True))

    # A bare assert: the docstring's first sentence and the functions, above pytest's values.
    lines = _e_lines(out, "test_put_stores_one_item_per_call")
    assert lines[:2] == [
        f"broken: Box.put stores each item once; look at your {at('Box.put')}, "
        f"{at('Box.__init__')}",
        "assert 2 == 1",
    ], lines

    # An assert with a message keeps it first; the test's name, read as a sentence, follows.
    lines = _e_lines(out, "test_sorting_gives_the_largest_first")
    assert lines[:3] == [
        "sort_desc puts the largest first",
        f"(the test: sorting gives the largest first; look at your {at('sort_desc')})",
        "assert [1, 2, 3] == [3, 2, 1]",
    ], lines

    # An assert in a helper of the test file names the helper.
    lines = _e_lines(out, "test_sorted_output_is_descending")
    assert lines[:2] == [
        "[1, 2, 5] is not descending",
        "(the test: sorted output is descending (checked in check_descending); "
        f"look at your {at('sort_desc')})",
    ], lines

    # A failure inside the student's code names that line (the assert under `def total`).
    lines = _e_lines(out, "test_total_takes_negative_numbers")
    name, line = at("total").rstrip(")").rsplit(":", 1)
    assert lines[0] == (
        f"broken: total takes negative numbers; look at your {name}:{int(line) + 1})"
    ), lines

    # pytest.raises's DID NOT RAISE is explained too.
    lines = _e_lines(out, "test_sorting_refuses_a_string")
    assert lines[:2] == [
        "Failed: DID NOT RAISE <class 'TypeError'>",
        f"(the test: sorting refuses a string; look at your {at('sort_desc')})",
    ], lines

    # A state machine: named by the variable holding its TestCase, described by the machine.
    lines = _e_lines(out, "test_a_box_counts_its_puts.runTest")
    assert lines[:2] == [
        "one item per put",
        f"(the test: Every put adds exactly one item (checked in BoxMachine.add); "
        f"look at your {at('Box.put')})",
    ], lines


def test_the_invariant_is_the_first_sentence_or_the_name():
    assert first_sentence("Forks share blocks. Then more.\n\nDetails.") == "Forks share blocks"
    assert first_sentence("One line, no stop") == "One line, no stop"
    assert sentence("test_fork_counts_every_holder") == "fork counts every holder"
