"""Lab 02-07 starter: the unified paged attention kernel of today's vLLM, in Triton.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Each is a ``@triton.jit`` function the given kernel calls (``mini_vllm.attention.triton_unified``:
read ``unified_attention_kernel`` there first); its docstring is the contract. When stuck, climb
the hint ladder: ``python -m course hint 02-07 N`` (a question), then ``--level 2`` (a case to
trace by hand), ``--level 3`` (the idea, and the tests that check it), ``--level 4`` (the
upstream lines to read).

Without a GPU, importing ``triton_unified`` (first, below) sets ``TRITON_INTERPRET=1``, and your
functions run in Triton's interpreter: each ``tl`` operation on numpy arrays, one program after
another. ``print`` works inside them there (``tl.device_print`` on a GPU).

The kernel's conventions: one program per (Q block, KV head[, segment]); its ``BLOCK_M`` rows
pack ``BLOCK_Q`` query tokens times the ``G`` query heads of the KV head (row ``m``: token
``m // G``, head ``kv_head * G + m % G``); tiles of ``TILE`` key positions; scores in float32.
Layouts (``x = 16 // element_size``)::

    query       [num_tokens, num_heads, head]   (rows of a sequence: its last q_len tokens)
    key_cache   [num_blocks, num_kv_heads, head // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head, block_size]

Rules: from ``triton_unified`` use only what the given lines use (``PIECE_NAMES``,
``lab_entry_point``, which makes this file's ``unified_attention``); its other functions are the
answers. Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-02-paged-attention/labs/lab-07-triton-unified -q
"""

from __future__ import annotations

import triton
import triton.language as tl

# Importing it picks Triton's interpreter where there is no GPU, before the functions below are
# made into kernels.
from mini_vllm.attention import triton_unified

__all__ = [
    "PIECE_NAMES",
    "load_q_tile",
    "load_kv_tile",
    "visible",
    "softmax_step",
    "reduce_segments",
    "in_window",
    "first_tile",
    "unified_attention",
]

# The functions of this file the kernel calls, by the names it calls them.
PIECE_NAMES = triton_unified.PIECE_NAMES


@triton.jit
def load_q_tile(query_ptr, q_start, q_len, q_block, kv_head, stride_tok, stride_head,
                BLOCK_Q: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Task 1. The Q tile of Q block ``q_block`` of a sequence whose queries are rows
    ``q_start .. q_start + q_len - 1`` of ``query``, for KV head ``kv_head``.

    Returns ``(q, token, head, row_ok)``: ``q [BLOCK_M, HEAD_PAD]`` with row ``m`` the query of
    token ``q_block * BLOCK_Q + m // G`` (counted within the sequence's queries) and head
    ``kv_head * G + m % G``; ``token [BLOCK_M]`` and ``head [BLOCK_M]`` those indices;
    ``row_ok [BLOCK_M]`` True for a real row: ``m < BLOCK_Q * G`` and its token ``< q_len``.
    Element ``(token, head, d)`` sits at ``query_ptr + (q_start + token) * stride_tok +
    head * stride_head + d``. Columns ``d >= HEAD`` and rows that are not real are 0 and never
    read from memory (they may lie past the tensor).
    """
    raise NotImplementedError(
        "lab 02-07, task 1: implement load_q_tile (hint: python -m course hint 02-07 1)")


@triton.jit
def load_kv_tile(key_cache_ptr, value_cache_ptr, table_ptr, tile, seq_len, kv_head,
                 sk_block, sk_head, sk_chunk, sk_slot, sv_block, sv_head, sv_dim,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, X: tl.constexpr,
                 HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Task 2. Tile ``tile`` of a sequence's keys and values for KV head ``kv_head``: positions
    ``tile * TILE .. tile * TILE + TILE - 1``; ``table_ptr`` points at the sequence's row of the
    block table.

    Returns ``(k_t, v, pos)``: ``k_t [HEAD_PAD, TILE]`` (the keys, transposed: column ``j`` is
    position ``pos[j]``'s key), ``v [TILE, HEAD_PAD]`` (row ``j`` its value), ``pos [TILE]``.
    Position ``p`` lives in physical block ``b = table[p // BLOCK_SIZE]`` at slot
    ``s = p % BLOCK_SIZE``; its key element ``d`` at ``key_cache_ptr + b * sk_block +
    kv_head * sk_head + (d // X) * sk_chunk + s * sk_slot + d % X``, its value element at
    ``value_cache_ptr + b * sv_block + kv_head * sv_head + d * sv_dim + s``. Positions at or past
    ``seq_len`` and columns ``d >= HEAD`` are 0 and never read: neither their table entries nor
    their slots (which may hold NaN or ids beyond the cache).
    """
    raise NotImplementedError(
        "lab 02-07, task 2: implement load_kv_tile (hint: python -m course hint 02-07 2)")


@triton.jit
def visible(q_pos, k_pos, seq_len):
    """Task 3. ``[BLOCK_M, TILE]`` booleans: element ``(i, j)`` is True when the key at absolute
    position ``k_pos[j]`` may be attended by the query at absolute position ``q_pos[i]``: at or
    before it (causal, inside a prefill chunk too) and inside the sequence (``< seq_len``).
    """
    raise NotImplementedError(
        "lab 02-07, task 3: implement visible (hint: python -m course hint 02-07 3)")


@triton.jit
def softmax_step(s, m, l, acc, v):  # noqa: E741 (l: the running sum, as in the papers)
    """Task 3. One tile of the online softmax, for every row at once.

    ``s [BLOCK_M, TILE]``: this tile's float32 scores, ``-inf`` where not visible;
    ``v [TILE, HEAD_PAD]``: its values. ``m [BLOCK_M]``, ``l [BLOCK_M]``,
    ``acc [BLOCK_M, HEAD_PAD]`` (float32): the running max of the scores seen, the sum of
    ``exp(score - m)`` over them, and the sum of ``exp(score - m) * value``. Returns the three
    updated to include this tile. A row that has seen no visible score yet has ``m = -inf``,
    ``l = 0``, ``acc = 0`` before and after (never NaN). Multiply the weights by ``v`` with
    ``tl.dot`` (weights cast to ``v.dtype``, ``out_dtype=tl.float32``).
    """
    raise NotImplementedError(
        "lab 02-07, task 3: implement softmax_step (hint: python -m course hint 02-07 3)")


@triton.jit
def reduce_segments(out_ptr, segm_acc_ptr, segm_max_ptr, segm_sum_ptr, num_tokens,
                    stride_tok, stride_head, NUM_HEADS: tl.constexpr,
                    NUM_SEGMENTS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Task 4. A kernel of its own (grid ``(num_tokens, NUM_HEADS)``): combine one query
    (token ``tl.program_id(0)``, head ``tl.program_id(1)``)'s split-KV partials into its output.

    Segment ``k`` of that query left, at index ``i = (token * NUM_HEADS + head) * NUM_SEGMENTS
    + k``: its running max ``segm_max[i]``, sum ``segm_sum[i]`` and unnormalised output
    ``segm_acc[i * HEAD_PAD .. i * HEAD_PAD + HEAD_PAD - 1]`` (float32, as ``softmax_step``
    left them). A segment that saw no visible key has sum 0 and must count for nothing. Write
    ``output = sum_k exp(m_k - M) acc_k / sum_k exp(m_k - M) l_k`` (``M``: the largest max of
    the segments that count) at ``out_ptr + token * stride_tok + head * stride_head + d`` for
    ``d < HEAD``, in the output's dtype.
    """
    raise NotImplementedError(
        "lab 02-07, task 4: implement reduce_segments (hint: python -m course hint 02-07 4)")


@triton.jit
def in_window(q_pos, k_pos, WINDOW: tl.constexpr):
    """Task 5. ``[BLOCK_M, TILE]`` booleans: the key at ``k_pos[j]`` is inside the sliding window
    of the query at ``q_pos[i]``: a window of ``WINDOW`` keys ending at the query itself (the
    query's own position and the ``WINDOW - 1`` before it). Causality is ``visible``'s job.
    """
    raise NotImplementedError(
        "lab 02-07, task 5: implement in_window (hint: python -m course hint 02-07 5)")


@triton.jit
def first_tile(first_q_pos, WINDOW: tl.constexpr, TILE: tl.constexpr):
    """Task 5. The first tile a Q block needs under a sliding window of ``WINDOW`` keys, its
    earliest query sitting at absolute position ``first_q_pos``: the tile holding the oldest key
    that query still sees (no row of the block sees anything before it).
    """
    raise NotImplementedError(
        "lab 02-07, task 5: implement first_tile (hint: python -m course hint 02-07 5)")


# Given: ``unified_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
# block_tables, scale, *, sliding_window=0, num_segments=1, yours=PIECE_NAMES)``, the kernel of
# ``triton_unified`` with this file's functions named in ``yours`` (the reference's for the
# others): the tests of one task take yours for that task only.
unified_attention = triton_unified.lab_entry_point(globals())
