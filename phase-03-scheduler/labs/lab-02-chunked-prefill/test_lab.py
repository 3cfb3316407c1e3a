"""Graded tests of lab 03-02: chunked prefill and the batch the model sees.

The metadata builder reproduces a worked example of vLLM's attention metadata exactly (two
484-token prompts under a 512-token budget, three steps), agrees with a token-by-token
computation on random scheduler runs, and the chunked-prefill attention matches phase 01's
reference attention and phase 02's decode kernel.

Task by task: every test uses only the task it is about and the tasks before it. The builder's
tests (task 3) order their batches with the reference's reorder as a stand-in for task 4, and
task 4's own tests run it on the same workloads; the attention tests (task 5) get their
metadata from the reference's builder. Adversarial inputs: caches whose every slot
outside a sequence's context holds NaN (the null block of the padding included), mappings that
hold other requests too, table entries no token reaches holding junk, block ids whose slots pass
2**31, and targeted cases whose messages name the sequence, query row (position) and head.
"""

from __future__ import annotations

import random

import pytest
import torch

from course.labs.loader import load_lab
from course.labs.numerics import assert_close, tolerances
from mini_vllm.attention.metadata import build_attention_metadata as build_reference
from mini_vllm.attention.metadata import (
    reorder_batch_to_split_decodes_and_prefills as reference_reorder,
)
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.attention.reference import ref_attention
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


class BatchTracker:
    """The runner's view of the batch: block tables and computed counts, kept from the diffs."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.order: list[str] = []

    def apply(self, so) -> None:
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
            self.computed[new.req_id] = new.num_computed_tokens
            self.tokens[new.req_id] = len(new.prompt_token_ids)
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            if c.resumed_from_preemption[i]:
                self.blocks[rid] = list(ids[0]) if ids else []
            elif ids is not None:
                self.blocks[rid].extend(ids[0])
            self.computed[rid] = c.num_computed_tokens[i]
        scheduled = so.num_scheduled_tokens
        order = [r for r in self.order if r in scheduled]
        self.order = order + [r for r in so.scheduled_req_ids if r not in order]

    def sampled(self, so) -> ModelRunnerOutput:
        """One token (7) for each request whose scheduled tokens reach its end."""
        out = []
        for rid in self.order:
            done = self.computed[rid] + so.num_scheduled_tokens[rid] >= self.tokens[rid]
            out.append([7] if done else [])
            if done:
                self.tokens[rid] += 1
        return ModelRunnerOutput(list(self.order), {r: i for i, r in enumerate(self.order)}, out)


def _request(rid, n, block_size, base, max_tokens=8):
    hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [base + t % 50 for t in range(n)], params, eos_token_id=None,
                   block_hasher=hasher)


def _ints(t):
    return [int(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------
# Task 1: query_start_loc
# ---------------------------------------------------------------------------------------------


def test_query_start_loc():
    lens = torch.tensor([4, 6], dtype=torch.int32)
    loc = lab.compute_query_start_loc(lens)
    assert loc.dtype == torch.int32, f"query_start_loc must be int32, got {loc.dtype}"
    assert _ints(loc) == [0, 4, 10], (
        f"compute_query_start_loc([4, 6]) must be [0, 4, 10] (a leading 0, then the running "
        f"sums), got {_ints(loc)}"
    )
    assert _ints(lens) == [4, 6], "the input was changed"
    assert _ints(lab.compute_query_start_loc(torch.tensor([1, 1, 5, 3], dtype=torch.int32))) == [
        0, 1, 2, 7, 10], (
        "compute_query_start_loc([1, 1, 5, 3]) must be [0, 1, 2, 7, 10], got "
        f"{_ints(lab.compute_query_start_loc(torch.tensor([1, 1, 5, 3], dtype=torch.int32)))}"
    )


def test_query_start_loc_of_one_none_and_int64():
    assert _ints(lab.compute_query_start_loc(torch.tensor([7], dtype=torch.int32))) == [0, 7], (
        "compute_query_start_loc([7]) must be [0, 7], got "
        f"{_ints(lab.compute_query_start_loc(torch.tensor([7], dtype=torch.int32)))}"
    )
    empty = lab.compute_query_start_loc(torch.tensor([], dtype=torch.int32))
    assert _ints(empty) == [0] and empty.dtype == torch.int32, "no sequences: [0]"
    wide = lab.compute_query_start_loc(torch.tensor([3, 4, 1], dtype=torch.int64))
    assert _ints(wide) == [0, 3, 7, 8] and wide.dtype == torch.int32, (
        f"int64 lengths give int32 offsets too, got {wide.dtype} {_ints(wide)}"
    )


# ---------------------------------------------------------------------------------------------
# Task 2: slot_mapping
# ---------------------------------------------------------------------------------------------


def test_slot_mapping_follows_the_block_table():
    # Two sequences, block size 2: row 0 owns blocks [5, 9], row 1 owns [3].
    tables = torch.tensor([[5, 9], [3, 0]], dtype=torch.int32)
    req_indices = torch.tensor([0, 0, 0, 1, 1])
    positions = torch.tensor([1, 2, 3, 0, 1])
    slots = lab.compute_slot_mapping(tables, req_indices, positions, 2)
    assert slots.dtype == torch.int64, f"compute_slot_mapping must return int64, got {slots.dtype}"
    assert _ints(slots) == [5 * 2 + 1, 9 * 2 + 0, 9 * 2 + 1, 3 * 2 + 0, 3 * 2 + 1], (
        f"block size 2, tables [[5, 9], [3, 0]]: slot = table[row][pos // 2] * 2 + pos % 2 "
        f"gives [11, 18, 19, 6, 7], got {_ints(slots)}"
    )


def test_slot_mapping_of_tokens_in_any_order():
    # Tokens interleaved across rows, int32 positions, block size 1 and 3.
    tables = torch.tensor([[4, 8, 2, -5], [7, 1, 6, 2**31 - 1]], dtype=torch.int32)
    req_indices = torch.tensor([1, 0, 1, 0, 0], dtype=torch.int32)
    positions = torch.tensor([2, 0, 1, 2, 1], dtype=torch.int32)
    got = _ints(lab.compute_slot_mapping(tables, req_indices, positions, 1))
    assert got == [6, 4, 1, 2, 8], f"block size 1: the slot is the block id, got {got}"
    got = _ints(lab.compute_slot_mapping(tables, req_indices, positions * 3 + 1, 3))
    want = [6 * 3 + 1, 4 * 3 + 1, 1 * 3 + 1, 2 * 3 + 1, 8 * 3 + 1]
    assert got == want, f"block size 3: expected {want}, got {got}"


def test_slot_mapping_is_int64_past_2_to_the_31():
    # A cache of 10**8 blocks of 32 tokens: slots pass 2**31 and must not wrap around.
    big = 100_000_000
    tables = torch.tensor([[big, big + 1], [3, 0]], dtype=torch.int32)
    slots = lab.compute_slot_mapping(
        tables, torch.tensor([0, 0, 1]), torch.tensor([31, 32, 5]), 32
    )
    want = [big * 32 + 31, (big + 1) * 32, 3 * 32 + 5]
    assert slots.dtype == torch.int64 and _ints(slots) == want, (
        f"expected {want} (int64), got {_ints(slots)} ({slots.dtype}): block ids times the block "
        f"size overflow int32; convert before multiplying"
    )


# ---------------------------------------------------------------------------------------------
# Task 3: build_attention_metadata (the batch order comes from the reference's reorder)
# ---------------------------------------------------------------------------------------------

# The worked example's runner allocated blocks from the top of a 128234-block cache (V0's
# allocator handed out the highest free id first); ours hands out 1, 2, 3, ... Relabelling
# id -> 128234 - id maps one allocation order onto the other.
SEED_NUM_BLOCKS = 128234

SEED_STEPS = [
    dict(num_prefills=2, num_prefill_tokens=512, num_decode_tokens=0, seq_lens=[28, 484],
         max_query_len=484, max_prefill_seq_len=484, max_decode_seq_len=0,
         query_start_loc=[0, 28, 512], seq_start_loc=[0, 28, 512], context_lens=[0, 0]),
    dict(num_prefills=1, num_prefill_tokens=456, num_decode_tokens=1, seq_lens=[485, 484],
         max_query_len=456, max_prefill_seq_len=484, max_decode_seq_len=485,
         query_start_loc=[0, 1, 457], seq_start_loc=[0, 485, 969], context_lens=[484, 28]),
    dict(num_prefills=0, num_prefill_tokens=0, num_decode_tokens=2, seq_lens=[486, 485],
         max_query_len=1, max_prefill_seq_len=0, max_decode_seq_len=486,
         query_start_loc=[0, 1, 2], seq_start_loc=[0, 486, 971], context_lens=[485, 484],
         slot_mapping=[2051253, 2050756]),
]


def _worked_example(reorder, build):
    """Run the worked example's three steps; yield (step, changed, metadata)."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048,
                             block_size=16, num_gpu_blocks=128, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    scheduler.add_request(_request("A", 484, 16, 100))
    scheduler.add_request(_request("B", 484, 16, 200))
    tracker = BatchTracker()
    tracker.order = ["B", "A"]  # the worked example's runner placed the second prompt first
    for step in range(len(SEED_STEPS)):
        so = scheduler.schedule()
        tracker.apply(so)
        changed = reorder(tracker.order, so.num_scheduled_tokens)
        relabelled = {r: [SEED_NUM_BLOCKS - b for b in ids] for r, ids in tracker.blocks.items()}
        md = build(tracker.order, so.num_scheduled_tokens, tracker.computed, relabelled, 16)
        yield step, changed, list(tracker.order), md
        scheduler.update_from_output(so, tracker.sampled(so))
        for rid, n in so.num_scheduled_tokens.items():
            tracker.computed[rid] += n


def test_worked_example_two_prompts_one_split():
    """Two 484-token prompts, a 512-token budget: A prefills fully and B gets a 28-token chunk;
    then A decodes while B finishes its prompt; then both decode."""
    for step, _, _, md in _worked_example(reference_reorder, lab.build_attention_metadata):
        want = SEED_STEPS[step]
        got = dict(
            num_prefills=md.num_prefills, num_prefill_tokens=md.num_prefill_tokens,
            num_decode_tokens=md.num_decode_tokens, seq_lens=_ints(md.seq_lens),
            max_query_len=md.max_query_len, max_prefill_seq_len=md.max_prefill_seq_len,
            max_decode_seq_len=md.max_decode_seq_len,
            query_start_loc=_ints(md.query_start_loc), seq_start_loc=_ints(md.seq_start_loc),
            context_lens=_ints(md.context_lens),
        )
        if "slot_mapping" in want:
            got["slot_mapping"] = _ints(md.slot_mapping)
        wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        assert not wrong, f"step {step + 1} of the worked example, (got, want): {wrong}"
        for name in ("query_start_loc", "seq_start_loc", "seq_lens", "context_lens"):
            assert getattr(md, name).dtype == torch.int32, name
        assert md.slot_mapping.dtype == torch.int64, (
            f"step {step + 1} of the worked example: slot_mapping must be int64, "
            f"got {md.slot_mapping.dtype}"
        )


def _loop_metadata(order, counts, computed, tables, bs):
    """What the metadata must hold, computed token by token with plain Python."""
    slots, positions, qsl, ssl = [], [], [0], [0]
    for rid in order:
        ctx, q = computed[rid], counts[rid]
        for p in range(ctx, ctx + q):
            positions.append(p)
            slots.append(tables[rid][p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + q)
        ssl.append(ssl[-1] + ctx + q)
    return dict(positions=positions, slot_mapping=slots, query_start_loc=qsl, seq_start_loc=ssl,
                seq_lens=[computed[r] + counts[r] for r in order],
                context_lens=[computed[r] for r in order],
                query_lens=[counts[r] for r in order])


@pytest.mark.parametrize("seed", range(4))
def test_metadata_matches_a_token_by_token_computation(seed):
    """Random workloads through the reference scheduler (chunking, prefix hits, preemption):
    the builder's tensors equal what a plain loop over every scheduled token computes."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    config = SchedulerConfig(max_num_seqs=rng.randint(2, 6),
                             max_num_batched_tokens=rng.randint(8, 40), max_model_len=256,
                             block_size=bs, num_gpu_blocks=96 // bs + 8,
                             enable_prefix_caching=rng.random() < 0.5)
    scheduler = Scheduler(config)
    for i in range(8):
        scheduler.add_request(_request(f"r{i}", rng.randint(1, 40), bs, rng.randrange(100),
                                       max_tokens=rng.randint(1, 10)))
    tracker = BatchTracker()
    steps = 0
    while scheduler.has_unfinished_requests() and steps < 500:
        steps += 1
        so = scheduler.schedule()
        tracker.apply(so)
        if not so.num_scheduled_tokens:
            continue
        counts = so.num_scheduled_tokens
        reference_reorder(tracker.order, counts)
        is_decode = [counts[r] <= 1 for r in tracker.order]
        md = lab.build_attention_metadata(tracker.order, counts, tracker.computed,
                                          tracker.blocks, bs)
        want = _loop_metadata(tracker.order, counts, tracker.computed, tracker.blocks, bs)
        where = f"step {steps}, batch {tracker.order}"
        assert md.req_ids == tracker.order, where
        for name, value in want.items():
            assert _ints(getattr(md, name)) == value, f"{where}: {name}"
        assert md.num_decodes == sum(is_decode), where
        assert md.num_decode_tokens + md.num_prefill_tokens == so.total_num_scheduled_tokens, (
            f"{where}: num_decode_tokens {md.num_decode_tokens} + num_prefill_tokens "
            f"{md.num_prefill_tokens} must be the {so.total_num_scheduled_tokens} tokens scheduled"
        )
        width = max(len(tracker.blocks[r]) for r in tracker.order)
        assert tuple(md.block_tables.shape) == (len(tracker.order), width), where
        for i, rid in enumerate(tracker.order):
            row = _ints(md.block_tables[i])
            assert row[: len(tracker.blocks[rid])] == tracker.blocks[rid], where
            assert all(b == 0 for b in row[len(tracker.blocks[rid]):]), "pad with the null block"
        assert len(set(want["slot_mapping"])) == len(want["slot_mapping"]), (
            f"test premise: {where}: the scheduler's block tables give two tokens one slot"
        )
        scheduler.update_from_output(so, tracker.sampled(so))
        for rid, n in counts.items():
            tracker.computed[rid] += n
    assert not scheduler.has_unfinished_requests(), (
        f"test premise: the reference scheduler left requests unfinished after {steps} steps"
    )


def _hand_batch():
    """Two decodes then two prefills (one of them a first chunk), block size 4; the mappings
    also hold a request that is not in the batch; the tables are tuples and lists, one longer
    than it needs to be."""
    order = ["d0", "d1", "p0", "p1"]
    counts = {"d0": 1, "d1": 1, "p0": 6, "p1": 3, "other": 50}
    computed = {"d0": 9, "d1": 0, "p0": 4, "p1": 0, "other": 0}
    tables = {"d0": (7, 3, 12), "d1": [5], "p0": [2, 8, 6], "p1": [11, 4, 9, 1], "other": [0]}
    return order, counts, computed, tables


def test_build_fills_every_field_of_a_hand_made_batch():
    order, counts, computed, tables = _hand_batch()
    before = (list(order), dict(counts), dict(computed), {k: list(v) for k, v in tables.items()})
    md = lab.build_attention_metadata(order, counts, computed, tables, 4)
    want = _loop_metadata(order, counts, computed, tables, 4)
    for name, value in want.items():
        assert _ints(getattr(md, name)) == value, f"{name}: got {_ints(getattr(md, name))}"
    expect = dict(req_ids=order, num_reqs=4, num_actual_tokens=11, num_decodes=2, num_prefills=2,
                  num_decode_tokens=2, num_prefill_tokens=9, max_query_len=6, max_seq_len=10,
                  max_prefill_seq_len=10, max_decode_seq_len=10)
    for name, value in expect.items():
        got = getattr(md, name)
        assert got == value, f"{name}: expected {value!r}, got {got!r}"
        if isinstance(value, int):
            assert type(got) is int, f"{name} must be a Python int, got {type(got).__name__}"
    assert _ints(md.block_tables.flatten()) == [7, 3, 12, 0, 5, 0, 0, 0, 2, 8, 6, 0, 11, 4, 9, 1], (
        f"block_tables must be the 4 tables padded with 0 (the null block) to the longest, 4 "
        f"wide; got {tuple(md.block_tables.shape)} {_ints(md.block_tables.flatten())}"
    )
    assert md.block_tables.dtype == torch.int32, (
        f"block_tables must be int32, got {md.block_tables.dtype}"
    )
    for name in ("query_start_loc", "seq_start_loc", "query_lens", "seq_lens", "context_lens"):
        assert getattr(md, name).dtype == torch.int32, f"{name} must be int32"
    for name in ("positions", "slot_mapping"):
        assert getattr(md, name).dtype == torch.int64, f"{name} must be int64"
    after = (list(order), dict(counts), dict(computed), {k: list(v) for k, v in tables.items()})
    assert after == before, "build_attention_metadata changed its inputs"


def test_build_max_fields_are_0_for_an_empty_group_and_the_threshold_counts():
    order, counts, computed, tables = _hand_batch()
    decodes = lab.build_attention_metadata(order[:2], counts, computed, tables, 4)
    assert (decodes.num_prefills, decodes.num_prefill_tokens, decodes.max_prefill_seq_len) == (
        0, 0, 0), "no prefills: their counts and max_prefill_seq_len are 0"
    prefills = lab.build_attention_metadata(order[2:], counts, computed, tables, 4)
    assert (prefills.num_decodes, prefills.num_decode_tokens, prefills.max_decode_seq_len) == (
        0, 0, 0), "no decodes: their counts and max_decode_seq_len are 0"
    # With decode_threshold=3, p1 (3 tokens) is a decode: it must then come before p0.
    md = lab.build_attention_metadata(["d0", "d1", "p1", "p0"], counts, computed, tables, 4,
                                      decode_threshold=3)
    assert (md.num_decodes, md.num_decode_tokens, md.max_decode_seq_len) == (3, 5, 10), (
        f"decode_threshold=3 makes d0, d1 and p1 (3 tokens) decodes: (num_decodes, "
        f"num_decode_tokens, max_decode_seq_len) must be (3, 5, 10), got "
        f"{(md.num_decodes, md.num_decode_tokens, md.max_decode_seq_len)}"
    )
    with pytest.raises(ValueError):
        lab.build_attention_metadata(order, counts, computed, tables, 4, decode_threshold=3)
        pytest.fail("with decode_threshold=3, p1 is a decode after the prefill p0")


def test_build_accepts_a_table_that_fits_exactly():
    # Context 3 + query 5 = 8 positions = exactly two blocks of 4.
    md = lab.build_attention_metadata(["a"], {"a": 5}, {"a": 3}, {"a": [6, 2]}, 4)
    assert _ints(md.slot_mapping) == [6 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3], (
        f"context 3 + query 5 in blocks [6, 2] of 4: slots must be [27, 8, 9, 10, 11], "
        f"got {_ints(md.slot_mapping)}"
    )


def test_build_with_blocks_of_one_token():
    # block_size 1 is valid: every position is its own block, the slot is the table entry.
    md = lab.build_attention_metadata(["a", "b"], {"a": 1, "b": 3}, {"a": 2, "b": 0},
                                      {"a": [4, 7, 9], "b": [3, 5, 8]}, 1)
    assert _ints(md.slot_mapping) == [9, 3, 5, 8], (
        f"block_size 1: slots must be the table entries [9, 3, 5, 8], got {_ints(md.slot_mapping)}"
    )
    assert _ints(md.positions) == [2, 0, 1, 2], (
        f"positions are context + offset in the query: a (context 2, 1 token), b (context 0, "
        f"3 tokens) give [2, 0, 1, 2], got {_ints(md.positions)}"
    )


@pytest.mark.parametrize(
    "case",
    ["empty", "twice", "missing-computed", "missing-scheduled", "missing-table", "zero-query",
     "negative-context", "prefill-first", "short-table", "block-size-0", "block-size-float"],
)
def test_build_rejects_bad_input(case):
    counts, computed, tables = {"a": 1, "b": 5}, {"a": 3, "b": 0}, {"a": [1], "b": [2, 3]}
    order, bs = ["a", "b"], 4
    if case == "empty":
        order = []
    elif case == "twice":
        order = ["a", "a", "b"]
    elif case == "missing-computed":
        computed = {"a": 3}
    elif case == "missing-scheduled":
        counts = {"a": 1}
    elif case == "missing-table":
        tables = {"b": [2, 3]}
    elif case == "zero-query":
        counts = {"a": 0, "b": 5}
    elif case == "negative-context":
        computed = {"a": -1, "b": 0}
    elif case == "prefill-first":
        order = ["b", "a"]
    elif case == "short-table":
        tables = {"a": [1], "b": [2]}  # b needs 5 slots, one block of 4 holds 4
    elif case == "block-size-0":
        bs = 0
    else:
        bs = 4.0
    with pytest.raises(ValueError):
        lab.build_attention_metadata(order, counts, computed, tables, bs)
        pytest.fail(f"build_attention_metadata accepted a batch with {case}")


# ---------------------------------------------------------------------------------------------
# Task 4: the decodes-first reorder
# ---------------------------------------------------------------------------------------------


def test_reorder_uses_the_fewest_swaps():
    order = ["p0", "d1", "p2", "d3", "d4"]
    counts = {"p0": 5, "d1": 1, "p2": 9, "d3": 1, "d4": 1}
    same_list = order
    assert lab.reorder_batch_to_split_decodes_and_prefills(order, counts) is True, (
        "reorder of ['p0', 'd1', 'p2', 'd3', 'd4'] (d: decode, p: prefill) must swap the decodes "
        "to the front and return True"
    )
    assert order is same_list, "reorder in place"
    # d4 (last decode) swaps with p0 (first prefill), d3 with p2; d1 was already in place.
    assert order == ["d4", "d1", "d3", "p2", "p0"], (
        f"fewest swaps: d4 (last decode) takes p0's place, d3 takes p2's, d1 stays; want "
        f"['d4', 'd1', 'd3', 'p2', 'p0'], got {order}"
    )
    assert lab.reorder_batch_to_split_decodes_and_prefills(order, counts) is False, (
        "reorder of ['d4', 'd1', 'd3', 'p2', 'p0'], already decodes first, must move nothing "
        "and return False"
    )
    same = ["d1", "d3", "p0"]
    assert lab.reorder_batch_to_split_decodes_and_prefills(same, counts) is False, (
        "reorder of ['d1', 'd3', 'p0'], already decodes first, must return False"
    )
    assert same == ["d1", "d3", "p0"], (
        f"reorder of ['d1', 'd3', 'p0'], already decodes first, must leave it as it is, "
        f"got {same}"
    )


def _oracle_reorder(order, counts, threshold=1):
    """The contract's result, by its description: the misplaced decodes from the back take the
    places of the misplaced prefills from the front."""
    nd = sum(counts[r] <= threshold for r in order)
    late_decodes = [i for i, r in enumerate(order) if counts[r] <= threshold and i >= nd]
    early_prefills = [i for i, r in enumerate(order) if counts[r] > threshold and i < nd]
    out = list(order)
    for d, p in zip(reversed(late_decodes), early_prefills):
        out[d], out[p] = out[p], out[d]
    return out, bool(late_decodes)


@pytest.mark.parametrize("seed", range(6))
def test_reorder_on_random_batches(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(0, 9)
        threshold = rng.choice([1, 1, 2])
        order = [f"r{i}" for i in range(n)]
        counts = {r: rng.choice([1, 1, 2, 3, 17]) for r in order}
        counts["not-in-batch"] = 1
        want, changed = _oracle_reorder(order, counts, threshold)
        got = list(order)
        kwargs = {} if threshold == 1 else {"decode_threshold": threshold}
        result = lab.reorder_batch_to_split_decodes_and_prefills(got, counts, **kwargs)
        where = (f"batch {[(r, counts[r]) for r in order]} (request, tokens), decode_threshold "
                 f"{threshold}")
        assert got == want, f"{where}: expected {want}, got {got}"
        assert result is changed, f"{where}: must return {changed}"


def test_reorder_in_the_worked_example():
    """Only step 2 needs a swap: A became a decode in row 1, behind the prefill B."""
    changes, orders = [], []
    for _, changed, order, _ in _worked_example(
        lab.reorder_batch_to_split_decodes_and_prefills, build_reference
    ):
        changes.append(changed)
        orders.append(order)
    assert changes == [False, True, False], f"swaps per step: {changes}"
    assert orders == [["B", "A"], ["A", "B"], ["A", "B"]], f"orders per step: {orders}"


# ---------------------------------------------------------------------------------------------
# Task 5: attention over the paged cache
# ---------------------------------------------------------------------------------------------


def _paged_batch(seed, dtype, num_heads=4, num_kv_heads=2, head_size=16, bs=4, junk=0.0):
    """A random mixed batch written into a paged cache with shuffled block ids. Every slot that
    holds no context token (stale slots past seq_len, unowned blocks, block 0 which pads the
    tables) holds ``junk``."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [(rng.randint(1, 20), 1) for _ in range(2)] + [
        (rng.randint(0, 12), rng.randint(2, 9)) for _ in range(3)]  # (context, query)
    num_blocks = 64
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    ids = [f"s{i}" for i in range(len(lens))]
    tables, full_kv = {}, {}
    x = 16 // torch.empty((), dtype=dtype).element_size()
    key_cache = torch.full((num_blocks, num_kv_heads, head_size // x, bs, x), junk, dtype=dtype)
    value_cache = torch.full((num_blocks, num_kv_heads, head_size, bs), junk, dtype=dtype)
    for rid, (ctx, q) in zip(ids, lens):
        n = ctx + q
        tables[rid] = [free.pop() for _ in range(-(-n // bs))]
        k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        full_kv[rid] = (k, v)
        pos = torch.arange(n)
        blocks = torch.tensor(tables[rid])[pos // bs]
        key_cache[blocks, :, :, pos % bs, :] = k.reshape(n, num_kv_heads, head_size // x, x)
        value_cache[blocks, :, :, pos % bs] = v
    # The reference's builder stands in for task 3, so that these tests wait on task 5 only.
    md = build_reference(ids, {r: q for r, (_, q) in zip(ids, lens)},
                         {r: c for r, (c, _) in zip(ids, lens)}, tables, bs)
    query = torch.randn(md.num_actual_tokens, num_heads, head_size, generator=gen).to(dtype)
    return ids, lens, md, query, key_cache, value_cache, full_kv


def check_chunked(out, want, md, lens, dtype, what):
    """``out`` equals ``want`` ([num_tokens, heads, head_size]); otherwise name the sequences,
    query rows (with their positions) and heads that are wrong."""
    assert out.shape == want.shape, (
        f"{what}: output shape {tuple(out.shape)}, want {tuple(want.shape)}"
    )
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype}, must be the query's {dtype}"
    atol, rtol = tolerances(dtype)
    g, w = out.detach().double(), want.detach().double()
    bad = ~((g - w).abs() <= atol + rtol * w.abs())
    if not bool(bad.any()):
        return
    lines = [f"{what}: {int(bad.any(-1).sum())} of {bad.shape[0] * bad.shape[1]} (row, head) "
             f"outputs wrong beyond atol={atol:g}, rtol={rtol:g} ({dtype})"]
    qsl = _ints(md.query_start_loc)
    for s, (ctx, q) in enumerate(lens):
        rows = bad[qsl[s]:qsl[s + 1]].any(dim=-1)  # [q, heads]
        if not bool(rows.any()):
            continue
        wrong_rows = rows.any(dim=1).nonzero().flatten().tolist()
        heads = rows.any(dim=0).nonzero().flatten().tolist()
        kind = "decode" if q == 1 else ("first chunk" if ctx == 0 else "chunk after a context")
        lines.append(
            f"  sequence {s} ({kind}: context {ctx}, query {q}): query rows {wrong_rows} "
            f"(positions {[ctx + i for i in wrong_rows]}), heads {heads}"
            + (" -- NaN" if bool(torch.isnan(g[qsl[s]:qsl[s + 1]]).any()) else "")
        )
    if bool(torch.isnan(g).any()):
        lines.append("  the output holds NaN: the only NaN in the caches sits where the contract "
                     "says values are ignored (past seq_len, the null block of the padding); a "
                     "softmax weight of 0 times NaN is NaN")
    raise AssertionError("\n".join(lines))


def _expected(md, lens, query, full_kv, ids, scale):
    want = torch.empty_like(query)
    for i, rid in enumerate(ids):
        s, e = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        k, v = full_kv[rid]
        want[s:e] = ref_attention(query[s:e], k, v, scale=scale)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_chunked_prefill_attention_matches_the_reference(seed, dtype):
    ids, lens, md, query, kc, vc, full_kv = _paged_batch(seed, dtype)
    scale = 0.3
    out = lab.chunked_prefill_attention(query, kc, vc, md, scale)
    check_chunked(out, _expected(md, lens, query, full_kv, ids, scale), md, lens, dtype,
                  f"chunked prefill, seed {seed}")


def test_chunked_prefill_default_scale_is_one_over_sqrt_head_size():
    ids, lens, md, query, kc, vc, full_kv = _paged_batch(4, torch.float32, head_size=32)
    out = lab.chunked_prefill_attention(query, kc, vc, md)
    check_chunked(out, _expected(md, lens, query, full_kv, ids, 32**-0.5), md, lens,
                  torch.float32, "scale left out (1 / sqrt(32))")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_ignores_nan_outside_the_context(dtype):
    """Every slot outside a sequence's context holds NaN: the slots past seq_len in its last
    block, the blocks nobody owns, and block 0, which pads the shorter block tables."""
    ids, lens, md, query, kc, vc, full_kv = _paged_batch(5, dtype, junk=float("nan"))
    out = lab.chunked_prefill_attention(query, kc, vc, md, 0.3)
    check_chunked(out, _expected(md, lens, query, full_kv, ids, 0.3), md, lens, dtype,
                  "chunked prefill over a cache full of NaN outside the contexts")


def test_chunked_prefill_in_float64_accumulates_in_float64():
    ids, lens, md, query, kc, vc, full_kv = _paged_batch(6, torch.float64)
    out = lab.chunked_prefill_attention(query, kc, vc, md, 0.3)
    check_chunked(out, _expected(md, lens, query, full_kv, ids, 0.3), md, lens, torch.float64,
                  "float64 inputs (scores and softmax in float64)")


def _ulps(out, want, dtype):
    """Error of ``out`` in units of ``dtype``'s spacing at ``want`` (at least its spacing at
    1/16, so that outputs near 0 do not turn a tiny absolute error into many units)."""
    mag = want.abs().clamp_min(1 / 16)
    spacing = torch.finfo(dtype).eps * torch.pow(2.0, torch.floor(torch.log2(mag)))
    return (out.double() - want).abs() / spacing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_prefill_in_half_precision_rounds_once(dtype):
    """Scores, softmax and the weighted sum run in float32 and only the result is rounded to
    the query's dtype: every output is within one unit of the float64 result. Computing in
    float16 / bfloat16 throughout is off by several units."""
    for seed in range(4):
        ids, lens, md, query, kc, vc, full_kv = _paged_batch(seed, dtype)
        exact_kv = {r: (k.double(), v.double()) for r, (k, v) in full_kv.items()}
        want = _expected(md, lens, query.double(), exact_kv, ids, 0.3)
        out = lab.chunked_prefill_attention(query, kc, vc, md, 0.3)
        assert out.dtype == dtype, f"output dtype {out.dtype}, must be the query's {dtype}"
        err = _ulps(out, want, dtype)
        worst = int(err.flatten().argmax())
        token, head = divmod(worst // err.shape[-1], err.shape[1])
        assert float(err.max()) <= 1.0, (
            f"seed {seed}, {dtype}: output off by {float(err.max()):.2f} units of {dtype} from "
            f"the float64 result (flat token {token}, head {head}); compute scores, softmax and "
            f"the weighted sum in float32 and round only the result"
        )


@pytest.mark.parametrize("heads", [(8, 2), (6, 3), (4, 4)], ids=lambda h: f"h{h[0]}x{h[1]}")
def test_chunked_prefill_query_head_reads_kv_head_h_over_group(heads):
    """Each KV head's values are a constant, 100 * (k + 1): query head h must come out as
    100 * (h // group + 1) in every row, whatever the weights."""
    num_heads, kvh = heads
    group = num_heads // kvh
    ids, lens, md, query, kc, vc, _ = _paged_batch(8, torch.float32, num_heads=num_heads,
                                                   num_kv_heads=kvh)
    for k in range(kvh):
        vc[:, k] = 100.0 * (k + 1)
    out = lab.chunked_prefill_attention(query, kc, vc, md)
    got = out.mean(dim=-1)  # [tokens, heads]
    problems = []
    for h in range(num_heads):
        vals = torch.unique(got[:, h].round())
        want = 100.0 * (h // group + 1)
        if not torch.allclose(got[:, h], torch.full_like(got[:, h], want)):
            read = sorted({int(v) // 100 - 1 for v in vals.tolist()})
            problems.append(f"query head {h} read KV head(s) {read}, expected {h // group}")
    assert not problems, (
        f"{num_heads} query heads on {kvh} KV heads: query head h reads KV head h // {group}\n  "
        + "\n  ".join(problems)
    )


def test_chunk_sees_exactly_its_context_and_itself():
    """The value of position t is t and every key is zero, so each query row averages the
    positions it may see: row i of a chunk after c cached tokens must give (c + i) / 2."""
    ids, lens, md, query, kc, vc, _ = _paged_batch(9, torch.float32, junk=1000.0)
    bs = kc.shape[3]
    kc.zero_()
    vc.fill_(1000.0)
    for i in range(len(ids)):
        ctx, q = lens[i]
        pos = torch.arange(ctx + q)
        blocks = md.block_tables[i].long()[pos // bs]
        vc[blocks, :, :, pos % bs] = pos.float()[:, None, None]
    out = lab.chunked_prefill_attention(query, kc, vc, md)
    problems = []
    qsl = _ints(md.query_start_loc)
    for i in range(len(ids)):
        ctx, q = lens[i]
        for row in range(q):
            got = float(out[qsl[i] + row].mean())
            want = (ctx + row) / 2
            if abs(got - want) > 1e-3:
                seen = 2 * got if got < 500 else float("inf")
                problems.append(
                    f"sequence {i} (context {ctx}, query {q}), row {row} at position "
                    f"{ctx + row}: mean of the visible positions must be {want:g}, got {got:.4g}"
                    + (f" (as if it saw positions 0..{seen:.0f})" if seen != float("inf") else
                       " (it read slots past seq_len, which hold 1000)")
                )
    assert not problems, (
        "query row i of a chunk sits at position context + i and sees keys 0 .. context + i\n  "
        + "\n  ".join(problems[:10])
    )


def test_chunk_does_not_see_its_future():
    """Query i of a chunk must ignore keys after its own position, even though they are in the
    cache already: changing the last key changes only the last query's output."""
    ids, lens, md, query, kc, vc, full_kv = _paged_batch(7, torch.float32)
    out = lab.chunked_prefill_attention(query, kc, vc, md)
    rid = ids[-1]
    ctx, q = lens[-1]
    table = md.block_tables[len(ids) - 1]
    last = ctx + q - 1
    bs = kc.shape[3]
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[int(table[last // bs]), :, :, last % bs, :] += 5.0
    vc2[int(table[last // bs]), :, :, last % bs] -= 5.0
    out2 = lab.chunked_prefill_attention(query, kc2, vc2, md)
    s, e = int(md.query_start_loc[-2]), int(md.query_start_loc[-1])
    assert torch.equal(out[:s], out2[:s]), "other sequences changed"
    assert torch.equal(out[s:e - 1], out2[s:e - 1]), f"{rid}: an earlier query saw a later key"
    assert not torch.equal(out[e - 1], out2[e - 1]), (
        f"{rid}: changing the key and value at position {last} left the last query row's output "
        f"unchanged; that row sits at position {last} and must see its own key"
    )


def test_decodes_agree_with_paged_attention_v1():
    ids, lens, md, query, kc, vc, _ = _paged_batch(3, torch.float32)
    nd = md.num_decodes
    scale = 0.25
    out = lab.chunked_prefill_attention(query, kc, vc, md, scale)
    want = torch.empty_like(query[:nd])
    paged_attention_v1(want, query[:nd].contiguous(), kc, vc, kc.shape[1], scale,
                       md.block_tables[:nd].contiguous(), md.seq_lens[:nd].contiguous(),
                       kc.shape[3], int(md.seq_lens[:nd].max()))
    assert_close(out[:nd], want, msg="decode rows vs paged_attention_v1")


def test_attention_rejects_inputs_that_do_not_match():
    ids, lens, md, query, kc, vc, _ = _paged_batch(1, torch.float32)
    cases = [
        ("one query row fewer than the metadata", (query[:-1], kc, vc)),
        ("a 2-D query", (query[:, 0], kc, vc)),
        ("a query head size other than the cache's", (query[..., :8].contiguous(), kc, vc)),
        ("3 query heads on 2 KV heads", (query[:, :3].contiguous(), kc, vc)),
        ("a 4-D key cache", (query, kc.flatten(-2), vc)),
    ]
    for what, args in cases:
        with pytest.raises(ValueError):
            lab.chunked_prefill_attention(*args, md)
            pytest.fail(f"chunked_prefill_attention accepted {what}")
