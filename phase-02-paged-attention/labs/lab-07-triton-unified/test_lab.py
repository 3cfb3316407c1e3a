"""Graded tests for lab 02-07: the unified paged attention kernel, in Triton.

The expected outputs never come from the lab's code: the tests write each sequence's keys and
values into the caches with index arithmetic spelled out here, and compute each query row with
lab 01's reference (``mini_vllm.attention.reference.ref_attention``) over the keys that row may
see.

Task by task: a task's tests run the kernel with that task's pieces yours and the reference's
for the others (the wrapper's ``yours``), so a task passes as soon as it is done. The last tests
take every piece from the lab.

Adversarial caches: every slot that holds no token of a sequence holds NaN, block-table entries
past a sequence's blocks are -1 or ids beyond the cache, and blocks sit in shuffled order, so
reading anything outside a sequence poisons the result.

On a CPU the kernels run in Triton's interpreter (one program after another, in numpy), so the
shapes are small: head size 16, sequences of a few tiles.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from mini_vllm.attention.reference import ref_attention

if importlib.util.find_spec("triton") is None:  # found, not imported: the lab chooses how
    pytest.skip("lab 02-07 needs Triton, which ships wheels for Linux only: run this lab on "
                "Linux or Colab", allow_module_level=True)

lab = load_lab(__file__)

HEAD = 16
TILE = 16  # the launcher's tile: sequences longer than this span several tiles
NAN = float("nan")


# ------------------------------------------------------------------------------------------
# Helpers written independently of the lab
# ------------------------------------------------------------------------------------------


class Batch:
    """A flat batch of sequences in the course's paged layout, with its oracle."""

    def __init__(self, q_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype, seed=0,
                 scale_keys=1.0, head=HEAD, query_scales=None):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        x = 16 // torch.empty((), dtype=dtype).element_size()
        self.q_lens, self.seq_lens = list(q_lens), list(seq_lens)
        self.num_heads, self.num_kv_heads, self.dtype = num_heads, num_kv_heads, dtype
        blocks_per = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per) + 2  # two blocks nobody owns
        self.key_cache = torch.full((num_blocks, num_kv_heads, head // x, block_size, x), NAN,
                                    dtype=dtype)
        self.value_cache = torch.full((num_blocks, num_kv_heads, head, block_size), NAN,
                                      dtype=dtype)
        order = list(range(num_blocks))
        rng.shuffle(order)
        width = max(blocks_per) + 1
        self.block_tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
        self.keys, self.values = [], []
        for s, n in enumerate(seq_lens):
            owned = [order.pop() for _ in range(blocks_per[s])]
            padding = [rng.choice([-1, num_blocks + 7]) for _ in range(width - len(owned))]
            self.block_tables[s] = torch.tensor(owned + padding, dtype=torch.int32)
            k = (torch.randn(n, num_kv_heads, head, generator=gen) * scale_keys).to(dtype)
            v = torch.randn(n, num_kv_heads, head, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            for p in range(n):
                block, slot = owned[p // block_size], p % block_size
                for d in range(0, head, x):  # key element d: chunk d // x, lane d % x
                    self.key_cache[block, :, d // x, slot, :] = k[p, :, d:d + x]
                self.value_cache[block, :, :, slot] = v[p]
        query = torch.randn(sum(q_lens), num_heads, head, generator=gen)
        if query_scales is not None:  # one factor per query head
            query = query * torch.tensor(query_scales)[None, :, None]
        self.query = query.to(dtype)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = head ** -0.5

    def run(self, yours=None, sliding_window=0, num_segments=1):
        kwargs = {} if yours is None else {"yours": tuple(yours)}
        return lab.unified_attention(
            self.query, self.key_cache, self.value_cache, self.query_start_loc,
            self.seq_lens_t, self.block_tables, self.scale, sliding_window=sliding_window,
            num_segments=num_segments, **kwargs)

    def expected(self, sliding_window=0):
        """Row by row: the reference over the keys the row sees (causal, and the window)."""
        out = torch.empty_like(self.query)
        starts = self.query_start_loc.tolist()
        for s, (q_len, n) in enumerate(zip(self.q_lens, self.seq_lens)):
            for i in range(q_len):
                pos = n - q_len + i
                lo = max(0, pos - sliding_window + 1) if sliding_window else 0
                row = starts[s] + i
                out[row] = ref_attention(self.query[row:row + 1], self.keys[s][lo:pos + 1],
                                         self.values[s][lo:pos + 1], scale=self.scale)[0]
        return out

    def check(self, what, yours=None, sliding_window=0, num_segments=1):
        got = self.run(yours, sliding_window, num_segments)
        assert got.shape == self.query.shape, (
            f"{what}: the output has shape {tuple(got.shape)}, expected "
            f"{tuple(self.query.shape)}")
        assert_close(got, self.expected(sliding_window), msg=what,
                     dims=("token", "head", "dim"))


def task(*names):
    """The wrapper's ``yours`` for a task's tests."""
    return names


# ------------------------------------------------------------------------------------------
# Not graded
# ------------------------------------------------------------------------------------------


@pytest.mark.starter_ok
def test_the_lab_imports():
    assert callable(lab.unified_attention), "the lab's unified_attention is missing"


@pytest.mark.starter_ok
def test_the_reference_pieces_pass_through_the_wrapper():
    """With none of the lab's pieces, the wrapper runs the reference (this checks the tests'
    own helpers, and that the given code is intact)."""
    Batch([1, 3], [5, 9], 4, 2, 4, torch.float32).check("reference pieces", yours=())


# ------------------------------------------------------------------------------------------
# Task 1: the Q tile
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2), (8, 1)])
def test_q_tile_packs_the_query_heads_of_a_kv_head(num_heads, num_kv_heads):
    """A decode and a prefill chunk; G = 1, 2, 3 (rows past 5 groups are padding) and 8."""
    batch = Batch([1, 6], [7, 12], num_heads, num_kv_heads, 4, torch.float32, seed=1)
    batch.check(f"heads {num_heads}/{num_kv_heads}", yours=task("load_q_tile"))


def test_q_tile_masks_the_columns_past_the_head():
    """A head of 24 in tiles of 32 columns: the 8 columns past the head are padding (reading
    them reads the next head's query)."""
    batch = Batch([1, 5], [9, 13], 4, 2, 4, torch.float32, seed=12, head=24)
    batch.check("head size 24", yours=task("load_q_tile"))


def test_q_tile_walks_several_q_blocks_of_a_long_chunk():
    """A chunk of 37 queries (BLOCK_Q = 16 with G = 1: three Q blocks, the last one partial)
    after a decode, so the second sequence's rows start at an offset."""
    batch = Batch([1, 37], [3, 40], 2, 2, 8, torch.float32, seed=2)
    batch.check("a 37-query chunk", yours=task("load_q_tile"))


# ------------------------------------------------------------------------------------------
# Task 2: the KV tiles, through the block table
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_kv_tiles_follow_the_block_table(block_size):
    """Sequences of 1, 17 and 35 positions (up to three tiles), shuffled blocks, NaN in every
    unused slot and junk past each table row."""
    batch = Batch([1, 2, 1], [1, 17, 35], 4, 2, block_size, torch.float32, seed=3)
    batch.check(f"block size {block_size}", yours=task("load_kv_tile"))


def test_kv_tiles_mask_the_columns_past_the_head():
    """A head of 24 in tiles of 32 columns: the key and value columns past the head are padding
    (reading them reads the next KV head's, or NaN)."""
    batch = Batch([1, 3], [19, 10], 4, 2, 8, torch.float32, seed=13, head=24)
    batch.check("head size 24", yours=task("load_kv_tile"))


def test_kv_tiles_read_the_right_kv_head():
    """Two KV heads whose keys differ in scale, so reading the other head's keys changes every
    score."""
    batch = Batch([1, 4], [20, 9], 4, 4, 8, torch.float32, seed=4, scale_keys=3.0)
    batch.check("four KV heads", yours=task("load_kv_tile"))


# ------------------------------------------------------------------------------------------
# Task 3: the causal mask and the online softmax
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_a_chunk_is_causal_inside_itself():
    """A prefill chunk of 9 queries after 7 tokens of context: query i sees the context and the
    chunk up to itself, itself included."""
    batch = Batch([9], [16], 2, 1, 4, torch.float32, seed=5)
    batch.check("a chunk after context", yours=task("visible", "softmax_step"))


@pytest.mark.points(2)
def test_the_online_softmax_rescales_across_tiles():
    """Sequences of 60 and 33 positions (four and three tiles) with large keys, so each tile's
    running max moves and the earlier tiles' sums must be rescaled."""
    batch = Batch([1, 3], [60, 33], 2, 2, 8, torch.float32, seed=6, scale_keys=6.0)
    batch.check("several tiles", yours=task("visible", "softmax_step"))


def test_each_row_keeps_its_own_running_max():
    """Two query heads of one KV head whose scores lie hundreds apart (one head's queries 40
    times the other's, over large keys): each row is shifted by its own max. A max shared by
    the tile's rows would underflow the other row's weights to 0."""
    batch = Batch([1, 4], [20, 9], 2, 1, 4, torch.float32, seed=15, scale_keys=6.0,
                  query_scales=(40.0, 1.0))
    batch.check("rows hundreds apart", yours=task("visible", "softmax_step"))


def test_a_first_token_sees_only_itself():
    """A one-token prefill and a fresh sequence of 4: the first query has a single visible key
    (its weight is exactly 1, so its output is that key's value)."""
    batch = Batch([1, 4], [1, 4], 2, 2, 4, torch.float32, seed=7)
    batch.check("first tokens", yours=task("visible", "softmax_step"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(dtype):
    """float16 and bfloat16 queries and caches (scores and sums stay float32)."""
    batch = Batch([1, 5], [21, 11], 4, 2, 8, dtype, seed=8)
    batch.check(f"{dtype}", yours=task("visible", "softmax_step"))


# ------------------------------------------------------------------------------------------
# Task 4: split KV
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("num_segments", [2, 4])
def test_split_kv_partials_combine(num_segments):
    """Decodes over 70 and 40 positions with large keys (each segment's max differs), split in
    2 or 4 segments."""
    batch = Batch([1, 1], [70, 40], 2, 1, 8, torch.float32, seed=9, scale_keys=6.0)
    batch.check(f"{num_segments} segments", yours=task("reduce_segments"),
                num_segments=num_segments)


def test_split_kv_with_large_scores_and_a_padded_head():
    """Scores in the hundreds (exp of a sum of two maxima overflows float32; only differences
    from the overall max stay finite) and a head of 24 in 32 columns (the output's padding
    columns are not written)."""
    batch = Batch([1, 1], [50, 33], 2, 1, 8, torch.float32, seed=14, scale_keys=60.0, head=24)
    batch.check("large scores", yours=task("reduce_segments"), num_segments=4)


def test_split_kv_with_empty_segments():
    """A decode over 5 positions split in 4 segments: three of them hold no key of it, and a
    chunk whose first rows see fewer segments than its last."""
    batch = Batch([1, 3], [5, 40], 2, 2, 4, torch.float32, seed=10)
    batch.check("empty segments", yours=task("reduce_segments"), num_segments=4)


# ------------------------------------------------------------------------------------------
# Task 5: the sliding window
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("window", [1, 5, 13, 16, 17])
def test_a_sliding_window_keeps_the_last_keys(window):
    """Decodes and a chunk over up to four tiles, windows of 1, 5, 13, 16 and 17 keys (the
    query's own key included): the window's first tile is past the start, so a first tile too
    late loses keys (with 13, the decode's oldest key is the last of its tile), and a window one
    key too wide or narrow changes every row."""
    batch = Batch([1, 5, 1], [60, 38, 9], 2, 1, 8, torch.float32, seed=11)
    batch.check(f"window {window}", yours=task("in_window", "first_tile"),
                sliding_window=window)


# ------------------------------------------------------------------------------------------
# All of it
# ------------------------------------------------------------------------------------------


@pytest.mark.points(3)
@settings(max_examples=12)
@given(
    shape=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 40)), min_size=1, max_size=3),
    heads=st.sampled_from([(2, 2), (4, 2), (6, 2), (4, 1)]),
    block_size=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([0, 0, 3, 20]),
    num_segments=st.sampled_from([1, 1, 2, 4]),
    decodes=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_every_piece_yours_on_drawn_batches(shape, heads, block_size, dtype, window,
                                            num_segments, decodes, seed):
    """Mixed batches drawn by Hypothesis: decodes and prefill chunks of several lengths after
    any context, GQA ratios, block sizes, dtypes, windows and split KV, every piece yours."""
    q_lens = [1] * decodes + [q for q, _ in shape]
    seq_lens = [1 + seed % 30] * decodes + [q + c for q, c in shape]
    batch = Batch(q_lens, seq_lens, heads[0], heads[1], block_size, dtype, seed=seed)
    batch.check(f"drawn batch q_lens={q_lens} seq_lens={seq_lens}", sliding_window=window,
                num_segments=num_segments)
