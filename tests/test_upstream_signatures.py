"""`course refs` compares full signatures between a record's two pins (issue 48).

Two tiny fake releases in a tmp dir, the pin a record cites (v9.9.9) and today's (v10.0.0), read
with ``ast``: parameter names in order, kinds, defaults and annotations as source text, and the
return annotation. A record that keeps its signature where they differ is a mismatch naming the
record, both releases and what differs; one that flags a change where none is, is one too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course.upstream.symbols import python_symbols, signature_differences
from course.upstream.today import check_today_source

PINNED = """\
from typing import Optional


class Pool:
    def __init__(self, n: int) -> None:
        self.n = n

    def touch(self, blocks: tuple[list[Block], ...]) -> None:
        pass

    def free(self, block_ids: list[int]) -> None:
        pass

    def same(self, n: Optional[int] = None, *, key: "Key") -> int:
        return 0
"""
TODAY = """\
class Pool:
    def __init__(self, n: int) -> None:
        self.n = n

    def touch(self, blocks: Sequence[Block]) -> None:
        pass

    def free(self, ids: list[int]) -> None:
        pass

    def same(self, n: int | None = None, *, key: Key) -> int:
        return 1  # the body changed, the signature did not
"""


def _record(qualname: str, changes: str = "") -> str:
    return (f'[[piece]]\nat = "vllm/core/pool.py::{qualname}"\nversion = "9.9.9"\n'
            f'today = "vllm/core/pool.py::{qualname}"\n{changes}\n')


def _release(root: Path, version: str, text: str) -> Path:
    tree = root / f"v{version}"
    (tree / "vllm/core").mkdir(parents=True)
    (tree / "vllm/core/pool.py").write_text(text)
    return tree


@pytest.fixture
def releases(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(repo, pinned tree, today's tree); the repo's records are written by each test."""
    repo = tmp_path / "repo"
    (repo / "upstream_refs/today").mkdir(parents=True)
    (repo / "upstream_refs/pins.toml").write_text('[today]\nversion = "10.0.0"\n')
    return repo, _release(tmp_path, "9.9.9", PINNED), _release(tmp_path, "10.0.0", TODAY)


def _check(repo: Path, pinned: Path, today: Path, records: str) -> list[str]:
    (repo / "upstream_refs/today/pool.toml").write_text(records)
    problems, checked = check_today_source(today, {"9.9.9": pinned}, repo)
    assert checked == records.count("[[piece]]")
    return problems


def test_a_kept_signature_whose_annotation_changed_or_parameter_was_renamed_is_flagged(releases):
    repo, pinned, today = releases
    records = _record("Pool.touch") + _record("Pool.free") + _record("Pool.same") + \
        _record("Pool")
    problems = _check(repo, pinned, today, records)
    assert len(problems) == 2, problems
    touch, free = problems
    assert touch.startswith("today/pool.toml: vllm/core/pool.py::Pool.touch @ v9.9.9: ")
    assert "from v9.9.9 to v10.0.0" in touch
    assert ("parameter 'blocks' annotation 'tuple[list[Block], ...]' -> 'Sequence[Block]'"
            in touch)
    assert "add 'signature' in changes" in touch
    assert free.startswith("today/pool.toml: vllm/core/pool.py::Pool.free @ v9.9.9: ")
    assert "from v9.9.9 to v10.0.0" in free and "parameter 'block_ids' renamed 'ids'" in free


def test_records_that_flag_the_real_changes_pass(releases):
    repo, pinned, today = releases
    flagged = 'changes = ["signature"]'
    records = _record("Pool.touch", flagged) + _record("Pool.free", flagged) + \
        _record("Pool.same")
    assert _check(repo, pinned, today, records) == []


def test_a_signature_change_claimed_where_there_is_none_is_flagged(releases):
    repo, pinned, today = releases
    problems = _check(repo, pinned, today, _record("Pool.same", 'changes = ["signature"]'))
    assert len(problems) == 1 and "vllm/core/pool.py::Pool.same @ v9.9.9" in problems[0]
    assert "did not change from v9.9.9 to v10.0.0" in problems[0]
    assert "drop 'signature' in changes" in problems[0]


def _differences(then: str, now: str, name: str = "f") -> list[str]:
    return signature_differences(python_symbols(then)[name], python_symbols(now)[name])


@pytest.mark.parametrize(
    ("then", "now", "expected"),
    [
        ("def f(a, b=1): ...", "def f(a, b=2): ...", ["parameter 'b' default '1' -> '2'"]),
        ("def f(a, b): ...", "def f(a, b=None): ...", ["parameter 'b' default none -> 'None'"]),
        ("def f(a, b): ...", "def f(a, *, b): ...",
         ["parameter 'b' kind regular -> keyword-only"]),
        ("def f(a, /, b): ...", "def f(a, b): ...",
         ["parameter 'a' kind positional-only -> regular"]),
        ("def f(*args): ...", "def f(*xs): ...", ["parameter 'args' renamed 'xs'"]),
        ("def f(**kw: int): ...", "def f(**kw: str): ...",
         ["parameter 'kw' annotation 'int' -> 'str'"]),
        ("def f(a, b): ...", "def f(b, a): ...", ["parameters reordered (a, b) -> (b, a)"]),
        ("def f(a, b): ...", "def f(a, c, d): ...",
         ["parameter 'b' renamed 'c'", "parameter 'd' added"]),
        ("def f(a, b): ...", "def f(b): ...", ["parameter 'a' removed"]),
        ("def f(a) -> int: ...", "def f(a): ...", ["return annotation 'int' -> none"]),
        ("class f:\n    def __init__(self, n): ...", "class f:\n    def __init__(self, m): ...",
         ["parameter 'n' renamed 'm'"]),
        ("from typing import List\ndef f(a: List[int] = [1]) -> 'X': ...",
         "def f(a: list[int]=[1]) -> X: ...", []),
    ],
    ids=["default", "default-added", "keyword-only", "positional-only", "star-args", "kwargs-type",
         "reordered", "renamed-and-added", "removed", "return", "class-init", "same"],
)
def test_each_part_of_a_signature_is_compared(then, now, expected):
    assert _differences(then, now) == expected
