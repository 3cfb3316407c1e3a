"""Graded tests of lab 02-02: reservation sizes, the contiguous allocator, the slot split, paging
with the real BlockPool, and the fragmentation measured on the shipped traces.

Task by task: the tests of tasks 1-3 use only that task; the paging tests use only ``PagedKV``;
the measurements need every task (`python scripts/task_by_task.py 02-02` checks it).
"""

from __future__ import annotations

import re
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab

lab = load_lab(__file__)


_CACHE: dict[str, object] = {}


def message_names(exc_info, *values):
    text = str(exc_info.value)
    for v in values:
        assert re.search(rf"(?<![\w-]){re.escape(str(v))}(?![\w])", text), (
            f"the error message should give {v!r}: {text!r}"
        )


def chat_run():
    """The chat trace and its reports for every strategy, replayed once per test session.

    Called inside the tests (not as a fixture) so that a missing task fails the test with its
    one-line message instead of erroring in setup.
    """
    if "chat" not in _CACHE:
        spec = lab.load_trace_specs()["chat"]
        trace = lab.generate_trace(spec)
        reports = {r.strategy: r for r in lab.run_all(trace, spec.budget, spec.max_model_len)}
        _CACHE["chat"] = (spec, trace, reports)
    return _CACHE["chat"]


# --------------------------------------------------------------------------- the shipped traces


@pytest.mark.starter_ok
def test_shipped_traces_are_seeded_long_tailed_and_fit_the_model():
    specs = lab.load_trace_specs()
    assert {"chat", "instruct"} <= set(specs), (
        f"test premise: traces.json should define the 'chat' and 'instruct' traces, "
        f"got {sorted(specs)}"
    )
    for spec in specs.values():
        trace = lab.generate_trace(spec)
        assert trace == lab.generate_trace(spec), "a trace must not change between runs"
        assert len(trace) == spec.num_requests, (
            f"test premise: trace {spec.name!r} should have {spec.num_requests} requests, "
            f"got {len(trace)}"
        )
        assert all(p >= 1 and o >= 1 and p + o <= spec.max_model_len for p, o in trace), (
            f"test premise: trace {spec.name!r} has (prompt, output) pairs below 1 or over "
            f"max_model_len {spec.max_model_len}: "
            f"{[(p, o) for p, o in trace if min(p, o) < 1 or p + o > spec.max_model_len][:4]}"
        )
        outputs = sorted(o for _, o in trace)
        # Long tail: the slowest 1% of answers are many times the typical one.
        assert outputs[int(0.99 * len(outputs))] > 5 * statistics.median(outputs), (
            f"test premise: trace {spec.name!r} should be long-tailed: 99th-percentile "
            f"output {outputs[int(0.99 * len(outputs))]} is not over 5x the median "
            f"{statistics.median(outputs)}"
        )


# --------------------------------------------------------------------------- task 1


def test_reservation_sizes():
    """reservation_size(policy, prompt, output, max_model_len) follows its policy: the model's
    length, the next power of two (capped), or exactly prompt + output."""
    rs = lab.reservation_size
    for args, want, why in (
        (("max", 10, 5, 2048), 2048, "max reserves the model's length"),
        (("oracle", 10, 5, 2048), 15, "oracle reserves exactly prompt + output"),
        (("pow2", 10, 5, 2048), 16, "15 rounds up to the next power of two"),
        (("pow2", 10, 6, 2048), 16, "an exact power of two is not doubled"),
        (("pow2", 10, 7, 2048), 32, "17 rounds up to 32"),
        (("pow2", 1, 1, 2048), 2, "2 is a power of two"),
        (("pow2", 1500, 100, 2048), 2048, "capped at the model's length"),
        (("oracle", 2000, 48, 2048), 2048, "exactly the model's length"),
    ):
        got = rs(*args)
        assert got == want, f"reservation_size{args} is {want} ({why}), got {got}"


def test_reservation_sizes_at_the_edges():
    rs = lab.reservation_size
    # A request exactly as long as the model allows fits every policy.
    assert [rs(p, 2000, 48, 2048) for p in ("max", "pow2", "oracle")] == [2048, 2048, 2048], (
        f"a 2048-token request with max_model_len 2048 fits every policy: max, pow2, "
        f"oracle should reserve 2048 each, got "
        f"{[rs(p, 2000, 48, 2048) for p in ('max', 'pow2', 'oracle')]}"
    )
    # The cap is max_model_len itself, also when it is not a power of two.
    assert rs("pow2", 2000, 500, 3000) == 3000, (
        f"pow2 of 2500 tokens is capped at max_model_len 3000 (no power of two), "
        f"got {rs('pow2', 2000, 500, 3000)}"
    )
    assert rs("max", 1, 1, 3000) == 3000, (
        f"max reserves max_model_len 3000 even when it is no power of two, "
        f"got {rs('max', 1, 1, 3000)}"
    )
    assert rs("pow2", 1000, 24, 3000) == 1024 and rs("pow2", 1000, 25, 3000) == 2048, (
        f"pow2: 1024 tokens reserve 1024 (not doubled) and 1025 reserve 2048, got "
        f"{rs('pow2', 1000, 24, 3000)} and {rs('pow2', 1000, 25, 3000)}"
    )
    assert rs("pow2", 1, 2, 5) == 4 and rs("oracle", 1, 2, 5) == 3, (
        f"3 tokens, max_model_len 5: pow2 reserves 4 and oracle 3, got "
        f"{rs('pow2', 1, 2, 5)} and {rs('oracle', 1, 2, 5)}"
    )


@pytest.mark.parametrize(
    "args, named",
    [
        (("best", 10, 5, 2048), ["best"]),
        (("max", 0, 5, 2048), [0]),
        (("oracle", 10, 0, 2048), [0]),
        (("pow2", -3, 10, 2048), [-3]),
        (("pow2", 2000, 49, 2048), [2049, 2048]),
        (("max", 2000, 49, 2048), [2049, 2048]),
        (("oracle", 2048, 1, 2048), [2049, 2048]),
    ],
)
def test_reservation_size_rejects_bad_input(args, named):
    with pytest.raises(ValueError) as exc:
        lab.reservation_size(*args)
    message_names(exc, *named)


# --------------------------------------------------------------------------- task 2


def test_allocator_first_fit_and_merging():
    a = lab.ContiguousAllocator(100)
    starts = [a.allocate(n) for n in (10, 20, 30)]
    assert starts == [0, 10, 30], f"10, 20, 30 slots from an empty 100: [0, 10, 30], got {starts}"
    a.free(10)  # hole [10, 30)
    assert a.allocate(25) == 60, "first fit: the 20-slot hole is too small"
    assert a.allocate(15) == 10, "first fit: the lowest hole that fits"
    assert a.holes == [(25, 5), (85, 15)], f"holes (start, size) after the fits: {a.holes}"
    for start, want, why in (
        (0, [(0, 10), (25, 5), (85, 15)], "a freed run between allocations is a hole of its own"),
        (10, [(0, 30), (85, 15)], "freeing [10, 25) joins the holes on both sides"),
        (60, [(0, 30), (60, 40)], "freeing [60, 85) joins the hole after it"),
        (30, [(0, 100)], "freeing the last run leaves one hole"),
    ):
        a.free(start)
        assert a.holes == want, f"free({start}): {why}; holes {want} expected, got {a.holes}"
    assert a.allocated == {}, f"everything freed, yet allocated is {a.allocated}"
    assert a.free_slots() == a.largest_hole() == 100, (
        f"free_slots {a.free_slots()} and largest_hole {a.largest_hole()} of an empty 100"
    )
    assert a.allocate(101) is None, "101 slots never fit in 100: allocate returns None"


def test_allocator_exact_fits():
    a = lab.ContiguousAllocator(64)
    assert a.allocate(64) == 0, "the whole capacity fits exactly"
    assert a.holes == [] and a.free_slots() == 0 and a.largest_hole() == 0, (
        f"allocate(64) of all 64 slots must remove the hole that fits exactly: holes {a.holes}, "
        f"free {a.free_slots()}, largest {a.largest_hole()} (all should be empty/0)"
    )
    assert a.allocate(1) is None, f"allocate(1) with no free slot must return None; holes {a.holes}"
    a.free(0)
    assert a.holes == [(0, 64)], f"free(0) of the only range leaves holes [(0, 64)], got {a.holes}"
    assert [a.allocate(n) for n in (16, 16, 32)] == [0, 16, 32], (
        f"allocating 16, 16, 32 from an empty 64 starts at 0, 16, 32; allocated {a.allocated}"
    )
    a.free(16)
    assert a.allocate(17) is None and a.allocate(16) == 16, "a hole that fits exactly"
    assert a.holes == [] and a.allocated == {0: 16, 16: 16, 32: 32}, (
        f"after refilling the exact 16-slot hole: holes [] and allocated {{0: 16, 16: 16, 32: 32}} "
        f"expected, got holes {a.holes}, allocated {a.allocated}"
    )


def test_allocator_refuses_what_no_single_hole_can_hold():
    a = lab.ContiguousAllocator(30)
    starts = [a.allocate(10) for _ in range(3)]
    a.free(starts[0])
    a.free(starts[2])
    before = (list(a.holes), dict(a.allocated))
    assert a.free_slots() == 20 and a.allocate(11) is None, "20 free slots, but in two holes"
    assert (list(a.holes), dict(a.allocated)) == before, (
        f"a refused allocate(11) must change nothing: holes {before[0]} -> {a.holes}, "
        f"allocated {before[1]} -> {a.allocated}"
    )


def test_allocator_rejects_bad_input_and_changes_nothing():
    a = lab.ContiguousAllocator(50)
    a.allocate(20)
    a.allocate(5)
    a.free(0)
    before = (list(a.holes), dict(a.allocated))
    calls = [
        (lambda: a.allocate(0), 0),
        (lambda: a.allocate(-7), -7),
        (lambda: a.free(0), 0),  # freed already
        (lambda: a.free(22), 22),  # inside the range [20, 25)
        (lambda: a.free(25), 25),  # the start of a hole
        (lambda: a.free(99), 99),
    ]
    for call, named in calls:
        with pytest.raises(ValueError) as exc:
            call()
        message_names(exc, named)
        assert (list(a.holes), dict(a.allocated)) == before, (
            f"the call rejected for {named} must change nothing (check before changing state): "
            f"holes {before[0]} -> {a.holes}, allocated {before[1]} -> {a.allocated}"
        )


def _runs(used: bytearray) -> list[tuple[int, int]]:
    """Maximal runs of free slots, as (start, size): what the holes must be."""
    runs, start = [], None
    for i, u in enumerate(list(used) + [1]):
        if not u and start is None:
            start = i
        elif u and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 50)), max_size=60))
def test_allocator_matches_a_slot_by_slot_model(ops):
    capacity = 128
    a = lab.ContiguousAllocator(capacity)
    used = bytearray(capacity)
    live: list[tuple[int, int]] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            fitting = [s for s, n in _runs(used) if n >= size]
            start = a.allocate(size)
            assert start == (fitting[0] if fitting else None), (
                f"allocate({size}) should return {fitting[0] if fitting else None} (the lowest "
                f"hole that fits), got {start}; holes {a.holes[:8]}"
            )
            if start is not None:
                used[start : start + size] = b"\x01" * size
                live.append((start, size))
        else:
            start, size = live.pop(pick % len(live))
            a.free(start)
            used[start : start + size] = bytes(size)
        assert a.holes == _runs(used), "holes must be sorted, disjoint and merged"
        assert a.free_slots() + sum(n for _, n in live) == capacity, (
            f"free slots {a.free_slots()} + allocated {sum(n for _, n in live)} "
            f"should be {capacity}"
        )


# --------------------------------------------------------------------------- task 3


def test_slot_breakdown():
    """slot_breakdown(allocated, num_tokens, final_len) splits the allocated slots into
    (token states, reserved, internal fragmentation), each counted as the README defines it."""
    sb = lab.slot_breakdown
    for args, want, why in (
        ((2048, 300, 700), (300, 400, 1348), "max reservation"),
        ((700, 300, 700), (300, 400, 0), "oracle"),
        ((1024, 700, 700), (700, 0, 324), "pow2, at the last token"),
        ((48, 37, 40), (37, 3, 8), "paging, block 16: the last block will stop at 40"),
        ((48, 37, 900), (37, 11, 0), "paging: the rest of the block will be used"),
        ((48, 0, 40), (0, 40, 8), "nothing written yet"),
        ((40, 40, 40), (40, 0, 0), "full, at its last token"),
        ((16, 16, 900), (16, 0, 0), "paging, the block just filled"),
    ):
        got = sb(*args)
        assert got == want, (
            f"slot_breakdown{args} ({why}) is (token states, reserved, internal) = {want}: "
            f"reserved are the slots it will still write, internal the ones it never will; "
            f"got {got}"
        )
    for bad in ((10, 11, 20), (10, 5, 4), (10, -1, 5), (3, 4, 4)):
        with pytest.raises(ValueError) as exc:
            sb(*bad)
        message_names(exc, *bad)


# --------------------------------------------------------------------------- task 4


def _req(rid, prompt, output):
    return lab.SimRequest(rid, prompt, output, num_tokens=prompt)


def test_paged_kv_takes_blocks_on_demand_from_the_block_pool():
    kv = lab.PagedKV(block_size=4, budget=40)  # 10 usable blocks
    assert isinstance(kv.pool, lab.BlockPool) and kv.pool.get_num_free_blocks() == 10, (
        f"test premise: PagedKV(4, 40) should make a BlockPool with 10 free blocks, "
        f"got a {type(kv.pool).__name__}"
    )
    r = _req(0, 5, 20)
    assert kv.admit(r), (
        f"admit of a 5-token prompt (2 blocks of 4) with "
        f"{kv.pool.get_num_free_blocks()} free blocks should return True"
    )
    assert kv.allocated(r) == 8 and kv.pool.get_num_free_blocks() == 8, (
        f"admitting 5 tokens takes 2 blocks (8 slots), leaving 8 free; got {kv.allocated(r)} "
        f"slots and {kv.pool.get_num_free_blocks()} free"
    )
    running = [r]
    for _ in range(10):  # tokens 6..15
        assert kv.grow(r, running) == [], (
            f"grow at {r.num_tokens} tokens with {kv.pool.get_num_free_blocks()} free blocks "
            f"must preempt nobody and return []"
        )
        r.num_tokens += 1
        assert kv.allocated(r) == 4 * -(-r.num_tokens // 4), "a block only when one fills"
    assert kv.pool.get_num_free_blocks() == 6, (
        f"at 15 tokens the request holds 4 blocks of 4: 6 of 10 free expected, "
        f"got {kv.pool.get_num_free_blocks()}"
    )
    ids = [b.block_id for b in kv.tables[0]]
    kv.release(r)
    free = [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()]
    assert free[-4:] == ids[::-1], "blocks go back last block first"
    assert kv.pool.get_num_free_blocks() == 10, (
        f"release must return all 4 blocks: 10 free expected, got {kv.pool.get_num_free_blocks()}"
    )


def test_paged_kv_admission_that_fits_exactly_and_a_refusal_that_changes_nothing():
    kv = lab.PagedKV(block_size=4, budget=16)  # 4 usable blocks
    a, b = _req(0, 9, 10), _req(1, 4, 10)
    assert kv.admit(a) and kv.pool.get_num_free_blocks() == 1, (
        f"admitting 9 tokens (3 blocks of 4) into 4 free blocks succeeds and leaves 1 free; "
        f"free now {kv.pool.get_num_free_blocks()}"
    )
    free_before = [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()]
    assert not kv.admit(_req(2, 5, 3)), "2 blocks needed, 1 free"
    assert 2 not in kv.tables, f"a refused admit must create no table; tables {sorted(kv.tables)}"
    assert [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()] == free_before, (
        f"a refused admit must take no block: free blocks {free_before} before, "
        f"{[b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()][:8]} after"
    )
    assert kv.admit(b), "1 block needed, 1 free: an exact fit"
    assert kv.pool.get_num_free_blocks() == 0 and kv.allocated(b) == 4, (
        f"after the exact fit: 0 free and request 1 holding 1 block expected, got "
        f"{kv.pool.get_num_free_blocks()} free and {len(kv.tables.get(1, ()))} blocks"
    )
    assert [len(kv.tables[r]) for r in (0, 1)] == [3, 1], (
        f"tables of requests 0 and 1 should hold [3, 1] blocks, got "
        f"{[len(kv.tables[r]) for r in (0, 1)]}"
    )


def test_paged_kv_a_newest_request_preempts_itself_not_an_older_one():
    kv = lab.PagedKV(block_size=4, budget=8)  # 2 usable blocks
    old, new = _req(0, 4, 10), _req(1, 4, 10)
    assert kv.admit(old) and kv.admit(new), (
        f"two 4-token requests (1 block each) fit 2 free blocks; tables {sorted(kv.tables)}"
    )
    running = [old, new]
    assert kv.grow(new, running) == [new] and running == [old], "the newest is new itself"
    assert new.num_preemptions == 1 and old.num_preemptions == 0, (
        f"grow counts one preemption on its victim only: new {new.num_preemptions} (want 1), "
        f"old {old.num_preemptions} (want 0)"
    )
    assert new.rid not in kv.tables and kv.allocated(old) == 4, (
        f"the preempted request loses its table, old keeps its 1 block: tables "
        f"{sorted(kv.tables)}, old holds {len(kv.tables.get(0, ()))} blocks"
    )
    assert kv.pool.get_num_free_blocks() == 1, (
        f"preempting new frees its 1 block: 1 free expected, got {kv.pool.get_num_free_blocks()}"
    )
    assert kv.admit(new), "back from the queue"
    running.append(new)
    assert kv.grow(new, running) == [new] and new.num_preemptions == 2, "counted each time"
    assert running == [old] and kv.pool.get_num_free_blocks() == 1, (
        f"after new preempts itself again: running {[r.rid for r in running]} (want [0]), "
        f"free {kv.pool.get_num_free_blocks()} (want 1)"
    )
    assert kv.grow(old, running) == [] and kv.allocated(old) == 8, (
        f"old at 4 tokens takes the 1 free block without preempting: it holds "
        f"{len(kv.tables.get(0, ()))} blocks (want 2), running {[r.rid for r in running]}"
    )


def test_paged_kv_preempts_only_as_many_as_needed():
    kv = lab.PagedKV(block_size=2, budget=8)  # 4 usable blocks
    reqs = [_req(i, 2, 10) for i in range(4)]
    for r in reqs:
        assert kv.admit(r), (
            f"admit of request {r.rid} (2 tokens, 1 block of 2) should succeed with "
            f"{kv.pool.get_num_free_blocks()} free blocks"
        )
    running = list(reqs)
    assert kv.grow(reqs[1], running) == [reqs[3]], (
        f"out of blocks, grow preempts only the newest (request 3) for one block; running now "
        f"{[r.rid for r in running]}, preemptions {[r.num_preemptions for r in reqs]}"
    )
    assert running == reqs[:3], "only the newest leaves; the others keep their order"
    assert kv.allocated(reqs[1]) == 4 and kv.pool.get_num_free_blocks() == 0, (
        f"request 1 should hold 2 blocks of 2 and none be free, got "
        f"{kv.allocated(reqs[1])} slots and {kv.pool.get_num_free_blocks()} free"
    )


def test_paged_kv_admission_and_preemption_of_the_newest():
    kv = lab.PagedKV(block_size=4, budget=16)  # 4 usable blocks
    a, b, c = _req(0, 4, 10), _req(1, 4, 10), _req(2, 9, 10)
    assert kv.admit(a) and kv.admit(b), (
        f"a and b (4 tokens, 1 block each) fit 4 free blocks; tables {sorted(kv.tables)}"
    )
    assert not kv.admit(c), "c needs 3 blocks, 2 are free"
    assert kv.pool.get_num_free_blocks() == 2, (
        f"a refused admit takes no block: 2 free expected, got {kv.pool.get_num_free_blocks()}"
    )
    running = [a, b]
    assert kv.grow(a, running) == [], (  # a is at 4 tokens: its next token needs block 2
        f"a at 4 tokens takes 1 of {kv.pool.get_num_free_blocks() + 1} free blocks: "
        f"no preemption; running {[r.rid for r in running]}"
    )
    a.num_tokens += 1
    assert kv.grow(b, running) == [], (
        f"b at 4 tokens takes the last free block: no preemption; running "
        f"{[r.rid for r in running]}"
    )
    b.num_tokens += 1
    assert kv.pool.get_num_free_blocks() == 0, (
        f"a and b each took a second block: 0 free expected, got {kv.pool.get_num_free_blocks()}"
    )
    for r in running:
        for _ in range(3):
            r.num_tokens += 1  # 8 tokens each: both blocks full
    assert kv.grow(a, running) == [b] and running == [a], "the newest request is preempted"
    assert b.num_preemptions == 1 and b.rid not in kv.tables, (
        f"preempted b counts 1 preemption (got {b.num_preemptions}) and loses its table "
        f"(tables {sorted(kv.tables)})"
    )
    assert kv.allocated(a) == 12, f"a should hold 3 blocks (12 slots), got {kv.allocated(a)}"
    a.num_tokens += 4  # 12 tokens: three blocks full
    solo = [a]
    assert kv.grow(a, solo) == [] and kv.pool.get_num_free_blocks() == 0, (  # the last block
        f"a at 12 tokens takes the last free block without preempting: free "
        f"{kv.pool.get_num_free_blocks()} (want 0), running {[r.rid for r in solo]}"
    )
    a.num_tokens += 4  # 16 tokens: four blocks full, none free
    assert kv.grow(a, solo) == [a] and solo == [], "with nobody else left, a preempts itself"
    assert kv.pool.get_num_free_blocks() == 4, (
        f"a preempting itself frees all 4 of its blocks: 4 free expected, "
        f"got {kv.pool.get_num_free_blocks()}"
    )


@given(st.lists(st.tuples(st.sampled_from("aggr"), st.integers(0, 99), st.integers(1, 14)),
                max_size=60))
def test_paged_kv_matches_a_model_of_blocks_and_preemptions(ops):
    """Random admissions, token-by-token growth and releases, as the replay drives a backend:
    every running request holds exactly the blocks its tokens need, a refused admission and a
    growth without a full block change nothing, and out of blocks the newest request goes."""
    bs, usable = 4, 10
    kv = lab.PagedKV(block_size=bs, budget=bs * usable)
    running: list = []
    gone: set[int] = set()
    for rid, (kind, pick, prompt) in enumerate(ops):
        free = usable - sum(-(-r.num_tokens // bs) for r in running)
        assert kv.pool.get_num_free_blocks() == free, (
            f"free blocks should be {free} ({usable} minus the blocks the running requests' tokens "
            f"need), got {kv.pool.get_num_free_blocks()}"
        )
        if kind == "a" or not running:
            req = _req(rid, prompt, 50)
            fits = -(-prompt // bs) <= free
            assert kv.admit(req) == fits, (
                f"admit of a {prompt}-token prompt ({-(-prompt // bs)} blocks) with {free} free "
                f"blocks should return {fits}"
            )
            if fits:
                running.append(req)
            else:
                assert rid not in kv.tables, f"a refused admit must create no table (request {rid})"
        elif kind == "g":
            req = running[pick % len(running)]
            newest_first = running[::-1]
            expect = []
            if req.num_tokens % bs == 0 and free == 0:
                expect = [newest_first[0]]  # one victim frees at least one block
            got = kv.grow(req, running)
            assert got == expect, (
                f"grow of request {req.rid} at {req.num_tokens} tokens with {free} free blocks "
                f"should preempt {[r.rid for r in expect]}, got "
                f"{[getattr(r, 'rid', r) for r in got] if isinstance(got, list) else got!r}"
            )
            for victim in got:
                assert victim.num_preemptions == 1 and victim.rid not in kv.tables, (
                    f"preempted request {victim.rid} should count 1 preemption (got "
                    f"{victim.num_preemptions}) and lose its table (tables {sorted(kv.tables)[:8]})"
                )
                gone.add(victim.rid)
            if req not in got:
                req.num_tokens += 1
            victim_ids = {v.rid for v in got}
            running_ids = [r.rid for r in newest_first[::-1] if r.rid not in victim_ids]
            assert [r.rid for r in running] == running_ids, (
                f"grow removes only its victims from running, in order: {running_ids[:8]} "
                f"expected, got {[r.rid for r in running][:8]}"
            )
        else:
            req = running.pop(pick % len(running))
            kv.release(req)
            assert req.rid not in kv.tables, f"release must forget the table of request {req.rid}"
        for r in running:
            assert kv.allocated(r) == bs * -(-r.num_tokens // bs), (
                f"request {r.rid} with {r.num_tokens} tokens should hold {-(-r.num_tokens // bs)} "
                f"blocks ({bs * -(-r.num_tokens // bs)} slots), got {kv.allocated(r)} slots"
            )
        for r in gone:
            assert r not in kv.tables, f"preempted request {r} must not get a table back"


# --------------------------------------------------------------------------- the measurements


def test_split_sums_to_one_and_batches_are_bounded():
    spec, trace, chat_reports = chat_run()
    for r in chat_reports.values():
        total = r.token_states + r.reserved + r.internal + r.external
        assert total == pytest.approx(1.0), (
            f"{r.strategy}: token states + reserved + internal + external should be 1, got {total}"
        )
        assert min(r.token_states, r.reserved, r.internal, r.external) >= 0, (
            f"{r.strategy}: no share may be negative: token states {r.token_states:.3f}, reserved "
            f"{r.reserved:.3f}, internal {r.internal:.3f}, external {r.external:.3f}"
        )
        assert r.max_batch <= len(trace), (
            f"{r.strategy}: max batch {r.max_batch} exceeds the {len(trace)} requests of the trace"
        )
    assert chat_reports["max"].max_batch == spec.budget // spec.max_model_len, (
        f"max reservation fits {spec.budget // spec.max_model_len} requests of "
        f"{spec.max_model_len} slots in {spec.budget}, got max batch "
        f"{chat_reports['max'].max_batch}"
    )
    assert chat_reports["oracle"].internal == 0, (
        f"oracle reserves exactly the final length, so internal fragmentation should be 0, "
        f"got {chat_reports['oracle'].internal:.4f}"
    )
    for name in ("max", "pow2", "oracle"):
        assert chat_reports[name].num_preemptions == 0, "a reservation never runs out"


def test_reservation_systems_use_a_fraction_of_their_memory():
    """The paper's regime: 20.4% to 38.2% of KV memory holds token states in the
    reservation-based systems it measured."""
    chat_reports = chat_run()[2]
    share = {n: chat_reports[n].token_states for n in ("max", "pow2", "oracle")}
    assert share["max"] < share["pow2"] < share["oracle"] < 0.6, (
        f"token-state shares should rise max < pow2 < oracle < 0.6, got {share['max']:.3f}, "
        f"{share['pow2']:.3f}, {share['oracle']:.3f}"
    )
    assert 0.15 < share["max"] < 0.30, (
        f"max reservation should hold 15-30% token states, got {share['max']:.3f}"
    )
    assert chat_reports["max"].internal > 0.5, "max reservation wastes most on never-used slots"
    assert chat_reports["pow2"].external > 0 and chat_reports["oracle"].external > 0, (
        f"pow2 and oracle ranges leave holes too small to use (external > 0), got "
        f"{chat_reports['pow2'].external:.4f} and {chat_reports['oracle'].external:.4f}"
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paging_wastes_under_4_percent(block_size):
    """The paper's regime: under 4% of KV memory wasted with paging."""
    chat_reports = chat_run()[2]
    r = chat_reports[f"paged-{block_size}"]
    assert r.waste < 0.04, (
        f"paged-{block_size} should waste under 4%, got {r.waste:.2%} (reserved "
        f"{r.reserved:.2%}, internal {r.internal:.2%}, external {r.external:.2%})"
    )
    assert r.mean_batch > 1.5 * chat_reports["oracle"].mean_batch, (
        f"paged-{block_size} mean batch {r.mean_batch:.1f} should exceed 1.5x oracle's "
        f"{chat_reports['oracle'].mean_batch:.1f}"
    )
    assert r.max_batch > chat_reports["oracle"].max_batch, (
        f"paged-{block_size} max batch {r.max_batch} should exceed oracle's "
        f"{chat_reports['oracle'].max_batch}"
    )


def test_smaller_blocks_waste_less_on_short_requests():
    spec = lab.load_trace_specs()["instruct"]
    trace = lab.generate_trace(spec)[:300]
    names = ("max", "paged-8", "paged-16", "paged-32")
    reports = lab.run_all(trace, spec.budget, spec.max_model_len, names)
    waste = [r.waste for r in reports]
    assert waste[1] < waste[2] < waste[3] < waste[0], (
        f"on short requests waste should rise paged-8 < paged-16 < paged-32 < max, got "
        f"{[round(w, 4) for w in waste]} (max, paged-8, paged-16, paged-32)"
    )
    assert reports[0].token_states < 0.1, "short requests in max-length reservations"


def test_command_line_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "bars.png"
    assert lab.main(["--trace", "instruct", "--requests", "120", "--plot", str(out)]) == 0, (
        "main() should return 0 after printing the table and writing the plot"
    )
    text = capsys.readouterr().out
    for name in lab.STRATEGIES:
        assert name in text, f"the printed table should have a row for {name!r}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (
        f"--plot should write a PNG, the file starts {out.read_bytes()[:8]!r}"
    )
    fig = lab.plot_reports([lab.replay([(5, 5)] * 4, "oracle", 64, 2048)])
    assert len(fig.axes) == 1, f"plot_reports should draw one axes, got {len(fig.axes)}"
