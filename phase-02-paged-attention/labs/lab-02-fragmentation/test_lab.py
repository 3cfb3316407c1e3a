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
    assert {"chat", "instruct"} <= set(specs)
    for spec in specs.values():
        trace = lab.generate_trace(spec)
        assert trace == lab.generate_trace(spec), "a trace must not change between runs"
        assert len(trace) == spec.num_requests
        assert all(p >= 1 and o >= 1 and p + o <= spec.max_model_len for p, o in trace)
        outputs = sorted(o for _, o in trace)
        # Long tail: the slowest 1% of answers are many times the typical one.
        assert outputs[int(0.99 * len(outputs))] > 5 * statistics.median(outputs)


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
    assert [rs(p, 2000, 48, 2048) for p in ("max", "pow2", "oracle")] == [2048, 2048, 2048]
    # The cap is max_model_len itself, also when it is not a power of two.
    assert rs("pow2", 2000, 500, 3000) == 3000
    assert rs("max", 1, 1, 3000) == 3000
    assert rs("pow2", 1000, 24, 3000) == 1024 and rs("pow2", 1000, 25, 3000) == 2048
    assert rs("pow2", 1, 2, 5) == 4 and rs("oracle", 1, 2, 5) == 3


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
    assert a.holes == [] and a.free_slots() == 0 and a.largest_hole() == 0
    assert a.allocate(1) is None
    a.free(0)
    assert a.holes == [(0, 64)]
    assert [a.allocate(n) for n in (16, 16, 32)] == [0, 16, 32]
    a.free(16)
    assert a.allocate(17) is None and a.allocate(16) == 16, "a hole that fits exactly"
    assert a.holes == [] and a.allocated == {0: 16, 16: 16, 32: 32}


def test_allocator_refuses_what_no_single_hole_can_hold():
    a = lab.ContiguousAllocator(30)
    starts = [a.allocate(10) for _ in range(3)]
    a.free(starts[0])
    a.free(starts[2])
    before = (list(a.holes), dict(a.allocated))
    assert a.free_slots() == 20 and a.allocate(11) is None, "20 free slots, but in two holes"
    assert (list(a.holes), dict(a.allocated)) == before


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
        assert (list(a.holes), dict(a.allocated)) == before


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
            assert start == (fitting[0] if fitting else None)
            if start is not None:
                used[start : start + size] = b"\x01" * size
                live.append((start, size))
        else:
            start, size = live.pop(pick % len(live))
            a.free(start)
            used[start : start + size] = bytes(size)
        assert a.holes == _runs(used), "holes must be sorted, disjoint and merged"
        assert a.free_slots() + sum(n for _, n in live) == capacity


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
    assert isinstance(kv.pool, lab.BlockPool) and kv.pool.get_num_free_blocks() == 10
    r = _req(0, 5, 20)
    assert kv.admit(r)
    assert kv.allocated(r) == 8 and kv.pool.get_num_free_blocks() == 8
    running = [r]
    for _ in range(10):  # tokens 6..15
        assert kv.grow(r, running) == []
        r.num_tokens += 1
        assert kv.allocated(r) == 4 * -(-r.num_tokens // 4), "a block only when one fills"
    assert kv.pool.get_num_free_blocks() == 6
    ids = [b.block_id for b in kv.tables[0]]
    kv.release(r)
    free = [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()]
    assert free[-4:] == ids[::-1], "blocks go back last block first"
    assert kv.pool.get_num_free_blocks() == 10


def test_paged_kv_admission_that_fits_exactly_and_a_refusal_that_changes_nothing():
    kv = lab.PagedKV(block_size=4, budget=16)  # 4 usable blocks
    a, b = _req(0, 9, 10), _req(1, 4, 10)
    assert kv.admit(a) and kv.pool.get_num_free_blocks() == 1
    free_before = [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()]
    assert not kv.admit(_req(2, 5, 3)), "2 blocks needed, 1 free"
    assert 2 not in kv.tables
    assert [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()] == free_before
    assert kv.admit(b), "1 block needed, 1 free: an exact fit"
    assert kv.pool.get_num_free_blocks() == 0 and kv.allocated(b) == 4
    assert [len(kv.tables[r]) for r in (0, 1)] == [3, 1]


def test_paged_kv_a_newest_request_preempts_itself_not_an_older_one():
    kv = lab.PagedKV(block_size=4, budget=8)  # 2 usable blocks
    old, new = _req(0, 4, 10), _req(1, 4, 10)
    assert kv.admit(old) and kv.admit(new)
    running = [old, new]
    assert kv.grow(new, running) == [new] and running == [old], "the newest is new itself"
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.rid not in kv.tables and kv.allocated(old) == 4
    assert kv.pool.get_num_free_blocks() == 1
    assert kv.admit(new), "back from the queue"
    running.append(new)
    assert kv.grow(new, running) == [new] and new.num_preemptions == 2, "counted each time"
    assert running == [old] and kv.pool.get_num_free_blocks() == 1
    assert kv.grow(old, running) == [] and kv.allocated(old) == 8


def test_paged_kv_preempts_only_as_many_as_needed():
    kv = lab.PagedKV(block_size=2, budget=8)  # 4 usable blocks
    reqs = [_req(i, 2, 10) for i in range(4)]
    for r in reqs:
        assert kv.admit(r)
    running = list(reqs)
    assert kv.grow(reqs[1], running) == [reqs[3]]
    assert running == reqs[:3], "only the newest leaves; the others keep their order"
    assert kv.allocated(reqs[1]) == 4 and kv.pool.get_num_free_blocks() == 0


def test_paged_kv_admission_and_preemption_of_the_newest():
    kv = lab.PagedKV(block_size=4, budget=16)  # 4 usable blocks
    a, b, c = _req(0, 4, 10), _req(1, 4, 10), _req(2, 9, 10)
    assert kv.admit(a) and kv.admit(b)
    assert not kv.admit(c), "c needs 3 blocks, 2 are free"
    assert kv.pool.get_num_free_blocks() == 2
    running = [a, b]
    assert kv.grow(a, running) == []  # a is at 4 tokens: its next token needs block 2
    a.num_tokens += 1
    assert kv.grow(b, running) == []
    b.num_tokens += 1
    assert kv.pool.get_num_free_blocks() == 0
    for r in running:
        for _ in range(3):
            r.num_tokens += 1  # 8 tokens each: both blocks full
    assert kv.grow(a, running) == [b] and running == [a], "the newest request is preempted"
    assert b.num_preemptions == 1 and b.rid not in kv.tables
    assert kv.allocated(a) == 12
    a.num_tokens += 4  # 12 tokens: three blocks full
    solo = [a]
    assert kv.grow(a, solo) == [] and kv.pool.get_num_free_blocks() == 0  # the last block
    a.num_tokens += 4  # 16 tokens: four blocks full, none free
    assert kv.grow(a, solo) == [a] and solo == [], "with nobody else left, a preempts itself"
    assert kv.pool.get_num_free_blocks() == 4


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
        assert kv.pool.get_num_free_blocks() == free
        if kind == "a" or not running:
            req = _req(rid, prompt, 50)
            fits = -(-prompt // bs) <= free
            assert kv.admit(req) == fits
            if fits:
                running.append(req)
            else:
                assert rid not in kv.tables
        elif kind == "g":
            req = running[pick % len(running)]
            newest_first = running[::-1]
            expect = []
            if req.num_tokens % bs == 0 and free == 0:
                expect = [newest_first[0]]  # one victim frees at least one block
            got = kv.grow(req, running)
            assert got == expect
            for victim in got:
                assert victim.num_preemptions == 1 and victim.rid not in kv.tables
                gone.add(victim.rid)
            if req not in got:
                req.num_tokens += 1
            victim_ids = {v.rid for v in got}
            running_ids = [r.rid for r in newest_first[::-1] if r.rid not in victim_ids]
            assert [r.rid for r in running] == running_ids
        else:
            req = running.pop(pick % len(running))
            kv.release(req)
            assert req.rid not in kv.tables
        for r in running:
            assert kv.allocated(r) == bs * -(-r.num_tokens // bs)
        for r in gone:
            assert r not in kv.tables


# --------------------------------------------------------------------------- the measurements


def test_split_sums_to_one_and_batches_are_bounded():
    spec, trace, chat_reports = chat_run()
    for r in chat_reports.values():
        total = r.token_states + r.reserved + r.internal + r.external
        assert total == pytest.approx(1.0)
        assert min(r.token_states, r.reserved, r.internal, r.external) >= 0
        assert r.max_batch <= len(trace)
    assert chat_reports["max"].max_batch == spec.budget // spec.max_model_len
    assert chat_reports["oracle"].internal == 0
    for name in ("max", "pow2", "oracle"):
        assert chat_reports[name].num_preemptions == 0, "a reservation never runs out"


def test_reservation_systems_use_a_fraction_of_their_memory():
    """The paper's regime: 20.4% to 38.2% of KV memory holds token states in the
    reservation-based systems it measured."""
    chat_reports = chat_run()[2]
    share = {n: chat_reports[n].token_states for n in ("max", "pow2", "oracle")}
    assert share["max"] < share["pow2"] < share["oracle"] < 0.6
    assert 0.15 < share["max"] < 0.30
    assert chat_reports["max"].internal > 0.5, "max reservation wastes most on never-used slots"
    assert chat_reports["pow2"].external > 0 and chat_reports["oracle"].external > 0


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paging_wastes_under_4_percent(block_size):
    """The paper's regime: under 4% of KV memory wasted with paging."""
    chat_reports = chat_run()[2]
    r = chat_reports[f"paged-{block_size}"]
    assert r.waste < 0.04
    assert r.mean_batch > 1.5 * chat_reports["oracle"].mean_batch
    assert r.max_batch > chat_reports["oracle"].max_batch


def test_smaller_blocks_waste_less_on_short_requests():
    spec = lab.load_trace_specs()["instruct"]
    trace = lab.generate_trace(spec)[:300]
    names = ("max", "paged-8", "paged-16", "paged-32")
    reports = lab.run_all(trace, spec.budget, spec.max_model_len, names)
    waste = [r.waste for r in reports]
    assert waste[1] < waste[2] < waste[3] < waste[0]
    assert reports[0].token_states < 0.1, "short requests in max-length reservations"


def test_command_line_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "bars.png"
    assert lab.main(["--trace", "instruct", "--requests", "120", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    for name in lab.STRATEGIES:
        assert name in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = lab.plot_reports([lab.replay([(5, 5)] * 4, "oracle", 64, 2048)])
    assert len(fig.axes) == 1
