"""`course refs` and today's pin (course/upstream/today.py, symbols.py).

Against a small fake course and two fake releases in a tmp dir: the pin the map cites (v9.9.9)
and "today's" (v10.0.0), in which one piece stayed, one moved, one changed its signature and
one is gone. The real releases are checked where their source is on this machine (`python -m
course refs --fetch` fetches every pin; CI does, before the suite).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT
from course.upstream.refs import check_consistency
from course.upstream.symbols import c_symbols, enclosing, python_symbols
from course.upstream.today import (
    changes_report,
    check_today_consistency,
    check_trees,
    today_version,
)

PINNED = """\
class Pool:
    def __init__(self, n):
        self.n = n

    def take(self, k):
        return k

    def give(self, blocks):
        pass


def helper(x):
    return x
"""
TODAY = """\
class Pool:
    def __init__(self, n, hash_size):
        self.n = n

    def give(self, blocks):
        pass
"""
MAP = """\
[[ref]]
symbol = "mini.pool.Pool"
file = "vllm/core/pool.py"
line = 1
version = "9.9.9"
text = "class Pool:"
qualname = "Pool"

[[ref]]
symbol = "mini.pool.Pool.take"
file = "vllm/core/pool.py"
line = 6
version = "9.9.9"
text = "return k"
qualname = "Pool.take"

[[ref]]
symbol = "mini.pool.Pool.give"
file = "vllm/core/pool.py"
line = 8
version = "9.9.9"
text = "def give("
qualname = "Pool.give"

[[ref]]
symbol = "mini.pool.helper"
file = "vllm/core/pool.py"
line = 12
version = "9.9.9"
text = "def helper("
qualname = "helper"
"""
PIECES = """\
[[piece]]
at = "vllm/core/pool.py::Pool"
version = "9.9.9"
today = "vllm/core/pool.py::Pool"
changes = ["signature"]

[[piece]]
at = "vllm/core/pool.py::Pool.take"
version = "9.9.9"
today = ""
note = "taking is done by give's caller now"
replaced_by = ["vllm/core/pool.py::Pool.give"]

[[piece]]
at = "vllm/core/pool.py::Pool.give"
version = "9.9.9"
today = "vllm/core/pool.py::Pool.give"
changes = ["behaviour"]
note = "gives to the front"
cite = ["https://github.com/vllm-project/vllm/pull/1"]

[[piece]]
at = "vllm/core/pool.py::helper"
version = "9.9.9"
today = "vllm/utils/math.py::helper"
"""
README = """\
# Lab 09-01: A pool

| piece | upstream |
| --- | --- |
| Pool | `vllm/core/pool.py:1 @ v9.9.9` |
| take | `vllm/core/pool.py:6 @ v9.9.9` |
| give | `vllm/core/pool.py:8 @ v9.9.9` |
| helper | `vllm/core/pool.py:12 @ v9.9.9` |

## Upstream today

In v10.0.0, `give` now gives to the front ([#1](https://github.com/vllm-project/vllm/pull/1)).
"""


def _release(root: Path, version: str, files: dict[str, str]) -> Path:
    tree = root / f"v{version}"
    tree.mkdir(parents=True)
    (tree / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    return tree


@pytest.fixture
def course(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(repo, pinned tree, today's tree): a course whose one lab cites four pieces."""
    repo = tmp_path / "repo"
    for folder in ("upstream_refs/map", "upstream_refs/today", "phase-09-demo/labs/lab-01-pool"):
        (repo / folder).mkdir(parents=True)
    (repo / "upstream_refs/pins.toml").write_text('[primary]\nversion = "9.9.9"\n'
                                                  '[today]\nversion = "10.0.0"\n')
    (repo / "upstream_refs/map/pool.toml").write_text(MAP)
    (repo / "upstream_refs/today/pool.toml").write_text(PIECES)
    (repo / "phase-09-demo/labs/lab-01-pool/README.md").write_text(README)
    pinned = _release(tmp_path, "9.9.9", {"vllm/core/pool.py": PINNED})
    today = _release(tmp_path, "10.0.0", {"vllm/core/pool.py": TODAY,
                                           "vllm/utils/math.py": "def helper(x):\n    pass\n"})
    return repo, pinned, today


def test_a_true_record_passes_against_both_pins_and_is_reported_per_lab(course):
    repo, pinned, today = course
    assert check_consistency(repo) == []
    assert check_today_consistency(repo) == []
    problems, lines = check_trees([pinned, today], repo)
    assert problems == []
    assert "4 map entries checked" in lines[0] and "4 pieces checked" in lines[1]
    report = "\n".join(changes_report(repo))
    assert "09-01: 4 pieces at v10.0.0: 1 moved, 1 signature, 1 behaviour, 1 gone" in report
    assert "moved                vllm/core/pool.py::helper -> vllm/utils/math.py::helper" in report


def test_a_tree_that_matches_no_entry_fails(course, tmp_path):
    repo, _, _ = course
    stranger = _release(tmp_path / "other", "0.9.9", {"vllm/core/pool.py": PINNED})
    problems, lines = check_trees([stranger], repo)
    assert len(problems) == 1 and "matches no entry" in problems[0] and lines == []


def test_moving_todays_pin_without_its_tree_fails(course):
    """A pin bump is one edit, and the old tree then matches nothing: never a silent pass."""
    repo, _, today = course
    (repo / "upstream_refs/pins.toml").write_text('[today]\nversion = "11.0.0"\n')
    problems, _ = check_trees([today], repo)
    assert today_version(repo) == "11.0.0" and "matches no entry" in problems[0]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('today = "vllm/utils/math.py::helper"', 'today = "vllm/core/pool.py::helper"',
         "vllm/core/pool.py::helper is not in v10.0.0; helper is defined in vllm/utils/math.py"),
        ('changes = ["signature"]\n', "",
         "it changed from v9.9.9 to v10.0.0: parameter 'hash_size' added "
         "((self, n) -> (self, n, hash_size))"),
        ('today = ""\nnote = "taking', 'today = "vllm/core/pool.py::Pool.take"\nnote = "taking',
         "vllm/core/pool.py::Pool.take is not in v10.0.0"),
        ('replaced_by = ["vllm/core/pool.py::Pool.give"]', 'replaced_by = ["vllm/x.py::Y"]',
         "replaced_by vllm/x.py::Y is not in v10.0.0"),
    ],
    ids=["moved-elsewhere", "signature-flag-missing", "gone-but-said-present", "replacement"],
)
def test_a_false_record_is_caught_against_the_source(course, old, new, expected):
    repo, pinned, today = course
    path = repo / "upstream_refs/today/pool.toml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    problems, _ = check_trees([pinned, today], repo)
    assert any(expected in p for p in problems), problems


def test_a_piece_recorded_gone_that_is_still_there_is_caught(course):
    repo, pinned, today = course
    release = today / "vllm/core/pool.py"
    release.write_text(release.read_text() + "\n    def take(self, k):\n        return k\n")
    problems, _ = check_trees([pinned, today], repo)
    assert any("recorded as gone, but v10.0.0 still has it" in p for p in problems), problems


def test_a_wrong_qualname_in_the_map_is_caught_against_the_pinned_source(course):
    repo, pinned, _ = course
    path = repo / "upstream_refs/map/pool.toml"
    path.write_text(path.read_text().replace('qualname = "Pool.take"', 'qualname = "Pool.give"'))
    problems, _ = check_trees([pinned], repo)
    assert any("qualname = 'Pool.take' (the map says 'Pool.give')" in p for p in problems)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace('qualname = "helper"\n', ""), "lacks qualname"),
        (lambda t: t.replace('"Pool.take"', '"Pool.tak"'), "has no [[piece]]"),
    ],
    ids=["no-qualname", "unrecorded-piece"],
)
def test_every_cited_piece_needs_a_record(course, edit, expected):
    repo, _, _ = course
    path = repo / "upstream_refs/map/pool.toml"
    path.write_text(edit(path.read_text()))
    assert any(expected in p for p in check_today_consistency(repo))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("## Upstream today", "## Upstream now"), "end the README with"),
        (lambda t: t + "\n## Later\n", "end the README with"),
        (lambda t: t.replace("pull/1)", "pull/2)"), "does not cite the change to"),
        (lambda t: t.replace("v10.0.0", "v9.9.9"), "does not say what v10.0.0"),
    ],
    ids=["no-section", "not-last", "behaviour-uncited", "stale-release"],
)
def test_each_lab_readme_ends_with_upstream_today_citing_each_behaviour_change(
    course, edit, expected
):
    repo, _, _ = course
    readme = repo / "phase-09-demo/labs/lab-01-pool/README.md"
    readme.write_text(edit(readme.read_text()))
    assert any(expected in p for p in check_today_consistency(repo))


def test_a_behaviour_change_without_a_cite_is_refused(course):
    repo, _, _ = course
    path = repo / "upstream_refs/today/pool.toml"
    path.write_text(path.read_text().replace('cite = ["https://github.com/vllm-project/vllm/pull/1"]',
                                             'cite = ["https://example.com/1"]'))
    assert any("is not a vllm-project/vllm pull request" in p
               for p in check_today_consistency(repo))


def test_the_command_fails_in_one_line_on_a_tree_that_matches_no_entry(tmp_path):
    stranger = _release(tmp_path, "0.9.9", {"vllm/__init__.py": ""})
    done = subprocess.run(
        [sys.executable, "-m", "course", "refs", "--vllm-src", str(stranger)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert done.returncode == 1
    lines = [line for line in done.stdout.splitlines() if "matches no entry" in line]
    assert len(lines) == 1 and "nothing was checked" in lines[0], done.stdout


def test_the_course_agrees_with_its_records_of_todays_pin():
    """Every cited piece has its record at today's pin; every lab README ends with its
    "Upstream today" section citing each behaviour change of its pieces."""
    problems = check_today_consistency(REPO_ROOT)
    assert today_version(REPO_ROOT) is not None and not problems, "\n".join(problems)


def _release_here(version: str | None) -> Path | None:
    cache = Path(os.environ.get("VLLM_SRC_CACHE", Path.home() / ".cache" / "vllm-src"))
    tree = cache / f"v{version}"
    return tree if version and (tree / "vllm" / "__init__.py").is_file() else None


def test_the_records_are_true_of_the_real_releases():
    """Both pins' source, where this machine has them (fetching needs the network)."""
    primary, today = _release_here("0.11.0"), _release_here(today_version(REPO_ROOT))
    if primary is None or today is None:
        pytest.skip("the v0.11.0 and today's vLLM source are not unpacked here; fetch them "
                    "with `python -m course refs --fetch` (CI does) to run this check")
    problems, lines = check_trees([primary, today], REPO_ROOT)
    assert not problems, "\n".join(problems)
    assert "0 mismatch(es)" in lines[-1] or "0 mismatch(es)" in lines[-2]


# --- the symbol finder ------------------------------------------------------------------------


def test_python_symbols_have_qualified_names_spans_and_signatures():
    symbols = python_symbols(PINNED + "\nLIMIT: int = 3\n")
    assert symbols["Pool.take"].signature == "(self, k)"
    assert (symbols["Pool"].start, symbols["Pool"].end) == (1, 9)
    assert enclosing(symbols, 6).qualname == "Pool.take"
    assert enclosing(symbols, 10) is None and "LIMIT" in symbols


def test_a_signature_holds_the_types_in_one_spelling():
    """A parameter's type is part of its signature (0.33.0's ``BlockPool.touch`` takes a flat
    sequence where 0.11.0's took one list per group: same names, another signature), but a new
    spelling of the same type (``Optional[X]`` as ``X | None``, ``List`` as ``list``, a quoted
    name) is not a change."""
    def sig(source: str, name: str = "f") -> str:
        return python_symbols(source)[name].signature

    then = sig("def f(blocks: tuple[list[Block], ...]) -> None: ...")
    assert then == "(blocks: tuple[list[Block], ...]) -> None"
    assert sig("def f(blocks: Sequence[Block]) -> None: ...") != then
    assert sig("def f(x: int) -> list[int]: ...") != sig("def f(x: int) -> list[str]: ...")
    old = sig("from typing import Optional, Union, List\n"
              "def f(a: Optional[int], b: Union[str, List[int]] = 1, *, c: 'Request') -> None: ...")
    new = sig("def f(a: int | None, b: str | list[int] = 1, *, c: Request) -> None: ...")
    assert old == new == "(a: int | None, b: str | list[int] = 1, *, c: Request) -> None"
    assert sig("class C:\n    x: Optional[int] = None\n", "C") == "(x: int | None = None)"
    assert sig("def f(x: typing.List[typing.Optional[int]]): ...") == "(x: list[int | None])"


def test_c_symbols_find_functions_structs_specialisations_and_macros():
    source = """\
#define MAX(a, b) ((a) > (b) ? (a) : (b))
namespace vllm {
// a comment with a brace {
template <typename T, int N = 4>
__device__ void kernel(T* out, const T* in) {
  if (N > 1) { out[0] = in[0]; }
}
template <>
float convert<float, uint8_t>(const uint8_t& a) { return a; }
struct Impl {
  static void call(int x) { }
};
}  // namespace vllm
"""
    symbols = c_symbols(source)
    assert symbols["kernel"].signature == "(T* out, const T* in)"
    assert (symbols["kernel"].start, symbols["kernel"].end) == (4, 7)
    assert enclosing(symbols, 5).qualname == "kernel"
    assert "convert<float,uint8_t>" in symbols and symbols["MAX"].signature == "(a, b)"
    assert enclosing(symbols, 11).qualname == "Impl::call"


# --- fetching the releases --------------------------------------------------------------------


def test_fetch_keeps_the_tree_pip_unpacked_and_says_what_pip_said_when_it_cannot(
        tmp_path, monkeypatch):
    """pip unpacks an sdist, then fails to build vLLM's metadata: the unpacked tree (or the
    archive, unpacked here) becomes the cache's ``vVERSION``; once there it is not fetched again;
    a release pip cannot get raises with pip's own last lines and leaves nothing behind."""
    import tarfile

    from course.upstream import fetch as fetching

    monkeypatch.setenv("VLLM_SRC_CACHE", str(tmp_path / "cache"))
    calls = []

    def pip(cmd, env, **kwargs):
        calls.append(cmd[-1])
        work = Path(env["TMPDIR"])
        if cmd[-1] == "vllm==9.9.9":  # pip's unpacked copy, kept by --no-clean
            tree = work / "pip-download-x" / "vllm_0123"
            (tree / "vllm").mkdir(parents=True)
            (tree / "vllm" / "__init__.py").write_text("")
            (tree / "tests" / "v1").mkdir(parents=True)
        elif cmd[-1] == "vllm==7.7.7":  # only the archive
            inner = work / "src" / "vllm-7.7.7" / "vllm"
            inner.mkdir(parents=True)
            (inner / "__init__.py").write_text("")
            (work / "dl").mkdir()
            with tarfile.open(work / "dl" / "vllm-7.7.7.tar.gz", "w:gz") as tar:
                tar.add(work / "src" / "vllm-7.7.7", arcname="vllm-7.7.7")
        return subprocess.CompletedProcess(cmd, 1, "", "error: metadata-generation-failed\n")

    monkeypatch.setattr(fetching.subprocess, "run", pip)
    tree = fetching.fetch("9.9.9")
    assert tree == tmp_path / "cache" / "v9.9.9" and (tree / "tests" / "v1").is_dir()
    assert fetching.fetch("9.9.9") == tree and calls == ["vllm==9.9.9"]
    assert (fetching.fetch("7.7.7") / "vllm" / "__init__.py").is_file()
    with pytest.raises(fetching.FetchError, match="metadata-generation-failed"):
        fetching.fetch("8.8.8")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["v7.7.7", "v9.9.9"]


def test_refs_fetch_that_cannot_reach_the_index_exits_2_with_one_line_first(tmp_path):
    env = dict(os.environ, VLLM_SRC_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
               PIP_FIND_LINKS="", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "course", "refs", "--fetch"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: could not fetch the vLLM 0.11.0 source from the package "
                            "index"), proc.stderr
