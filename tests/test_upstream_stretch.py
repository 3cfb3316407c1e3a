"""Today's vLLM (issue 26): lab 02-01's optional stretch, and vLLM's own unit tests run against
mini_vllm with today's behaviour switched on.

The stretch, filled with correct bodies on top of a starter filled from the reference, passes its
tests (``test_stretch.py``, ``LAB_IMPL=starter``); untouched, it is skipped with a sentence.
The upstream tests are read from the release's source at run time: without it (CI has no
network) their tests skip, at no cost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT
from course.labs.loader import load_module

LAB = REPO_ROOT / "phase-02-paged-attention" / "labs" / "lab-01-block-allocator"
UPSTREAM_TESTS = REPO_ROOT / "upstream_refs" / "upstream_tests"

# Correct bodies for the stretch's four tasks (each replaces its task's `raise`).
SOLVED = {
    1: """
        if not blocks:
            return
        head = self.fake_free_list_head
        first, prev = head.next_free_block, head
        for block in blocks:
            block.prev_free_block, prev.next_free_block = prev, block
            prev = block
        prev.next_free_block, first.prev_free_block = first, prev
        self.num_free_blocks += len(blocks)
""",
    2: """
        to_front, to_back = [], []
        for i, block in enumerate(blocks):
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                for done in blocks[:i]:
                    done.ref_cnt += 0 if done.is_null else 1
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                cached = self.enable_caching and block.block_hash is not None
                (to_back if cached else to_front).append(block)
        self.free_block_queue.prepend_n(to_front)
        self.free_block_queue.append_n(to_back)
""",
    3: """
    seed = os.getenv("PYTHONHASHSEED")
    yours.NONE_HASH = hash_fn(TODAY_NONE_HASH_SEED if seed is None else seed)
""",
    4: """
    lora = request.lora_request
    keys = [("lora", lora.lora_name, getattr(lora, "lora_path", None))] if lora else []
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    return (tuple(keys) if keys else None), start_mm_idx
""",
}


def solved_stretch() -> str:
    text = (LAB / "stretch.py").read_text(encoding="utf-8")
    for n, body in SOLVED.items():
        start = text.index(f'"lab 02-01 stretch, task {n}:')
        first = text.rindex("raise NotImplementedError(", 0, start)
        first = text.rindex("\n", 0, first) + 1
        end = text.index(")\n", text.index("Stretch)", start)) + 2
        text = text[:first] + body.lstrip("\n") + text[end:]
    return text.replace("STARTED = False", "STARTED = True")


@pytest.fixture(scope="module")
def solved_lab(tmp_path_factory) -> Path:
    """Lab 02-01's folder with the starter filled from the reference and the stretch solved."""
    spec = importlib.util.spec_from_file_location("task_by_task_for_stretch",
                                                  REPO_ROOT / "scripts" / "task_by_task.py")
    task_by_task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task_by_task)
    from course.labs.tasks import open_tasks

    (lab,) = task_by_task.select(task_by_task.discover(), ["02-01"])
    names = [name for t in open_tasks(lab) for name, _ in t.functions]
    solution = load_module(LAB, "solution", "02-01")
    starter = load_module(LAB, "starter", "02-01")
    folder = tmp_path_factory.mktemp("stretch") / "lab-01-block-allocator"
    folder.mkdir()
    (folder / "starter.py").write_text(
        task_by_task.fill((LAB / "starter.py").read_text(encoding="utf-8"), solution, names,
                          starter))
    (folder / "stretch.py").write_text(solved_stretch())
    shutil.copy(LAB / "test_stretch.py", folder / "test_stretch.py")
    return folder


def run_stretch_tests(folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAB_IMPL="starter", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "--rootdir", str(REPO_ROOT), "-c", str(REPO_ROOT / "pyproject.toml"),
         str(folder / "test_stretch.py")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_solved_stretch_passes_its_tests(solved_lab):
    done = run_stretch_tests(solved_lab)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-2000:])
    # Only the two reference-only tests skip; every stretch test ran.
    assert "2 skipped" in done.stdout, done.stdout[-2000:]


def test_an_untouched_stretch_is_skipped_with_a_sentence(monkeypatch):
    monkeypatch.setenv("LAB_IMPL", "starter")
    for name in ("lab_02_01_stretch", "lab_02_01_starter_for_stretch"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # the lab's own files, fresh
    spec = importlib.util.spec_from_file_location("lab_02_01_test_stretch_untouched",
                                                  LAB / "test_stretch.py")
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    with pytest.raises(pytest.skip.Exception,
                       match="set STARTED = True in stretch.py when you start it"):
        tests.pieces()
    for name in ("lab_02_01_stretch", "lab_02_01_starter_for_stretch"):
        sys.modules.pop(name, None)


# --------------------------------------------------------------------------------------------
# vLLM's own tests (need the release's source: skipped without it)
# --------------------------------------------------------------------------------------------


RESULTS = UPSTREAM_TESTS / "results.json"


def test_lab_readme_counts_are_the_recorded_run():
    """Lab 02-01's file-by-file table is ``results.json``'s (which the next test checks against
    a fresh run)."""
    recorded = json.loads(RESULTS.read_text(encoding="utf-8"))["by_file"]
    readme = (LAB / "README.md").read_text(encoding="utf-8")
    table = {m[0]: {"items": int(m[1]), "passed": int(m[2]), "excluded": int(m[3])}
             for m in re.findall(r"^\| `((?:core|sample)/[\w/]+\.py)` \| (\d+) \| (\d+) \| "
                                 r"(\d+) \|$", readme, flags=re.M)}
    assert table == {name: {k: row[k] for k in ("items", "passed", "excluded")}
                     for name, row in recorded.items()}


@pytest.mark.slow
def test_upstream_tests_pass_or_are_excluded_with_a_reason(upstream_release):
    run, src = upstream_release
    result = run.run(src, "solution")
    assert not result["failing"], f"upstream items fail: {result['failing']}"
    assert not result["stale_exclusions"], (
        f"exclusions that name nothing or only passing items: {result['stale_exclusions']}")
    assert result["counts"]["passed"] > 0
    recorded = json.loads(RESULTS.read_text(encoding="utf-8"))
    assert result["by_file"] == recorded["by_file"], (
        "upstream_refs/upstream_tests/results.json is not today's run: write it again with "
        f"`{recorded['command']}` and copy its counts into lab 02-01's README")


@pytest.mark.slow
def test_upstream_tests_tell_the_switch_apart(upstream_release):
    """With the switch off, the upstream tests of the four changed behaviours fail."""
    run, src = upstream_release
    failing = run.run(src, "solution", today=False)["failing"]
    assert {key.split("::")[1].split("[")[0] for key in failing} == {
        "test_none_hash", "test_generate_block_hash_extra_keys_lora",
        "test_lora_path_change_changes_block_hashes", "test_cache_key_salting", "test_evict",
        "test_prefill", "test_prefill_plp"}, failing


@pytest.mark.slow
def test_upstream_tests_pass_on_a_solved_stretch(upstream_release, solved_lab, monkeypatch):
    run, src = upstream_release
    monkeypatch.setenv("UPSTREAM_TESTS_STRETCH_DIR", str(solved_lab))
    result = run.run(src, "stretch")
    assert not result["failing"], f"upstream items fail on the stretch: {result['failing']}"


# Each of the stretch's behaviour changes left undone, as v0.11.0 had it (task, today's line, the
# old line), and the upstream tests that must see it.
OLD_BEHAVIOUR = {
    "free-order": ("(to_back if cached else to_front).append(block)", "to_back.append(block)",
                   {"test_evict", "test_prefill"}),
    "random-none-hash": ("hash_fn(TODAY_NONE_HASH_SEED if seed is None else seed)",
                         "os.urandom(32) if seed is None else hash_fn(seed)",
                         {"test_none_hash"}),
    "untagged-extra-keys": ('[("lora", lora.lora_name, getattr(lora, "lora_path", None))]',
                            "[lora.lora_name]", {"test_generate_block_hash_extra_keys_lora"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", sorted(OLD_BEHAVIOUR))
def test_a_stretch_that_keeps_the_old_behaviour_fails_upstream_tests(upstream_release, change,
                                                                      solved_lab, tmp_path,
                                                                      monkeypatch):
    """A stretch that leaves one of today's changes undone fails vLLM 0.33.0's own tests of it
    (the manager those tests build runs on the student's pool and hashing)."""
    run, src = upstream_release
    today, old, caught_by = OLD_BEHAVIOUR[change]
    planted = tmp_path / solved_lab.name
    shutil.copytree(solved_lab, planted)
    text = (planted / "stretch.py").read_text(encoding="utf-8")
    assert text.count(today) == 1
    (planted / "stretch.py").write_text(text.replace(today, old), encoding="utf-8")
    monkeypatch.setenv("UPSTREAM_TESTS_STRETCH_DIR", str(planted))
    failing = run.run(src, "stretch")["failing"]
    assert caught_by <= {key.split("::")[1].split("[")[0] for key in failing}, failing
