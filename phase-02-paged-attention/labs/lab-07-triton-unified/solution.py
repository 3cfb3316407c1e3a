"""Lab 02-07 reference: the unified paged attention kernel of today's vLLM, in Triton.

The pieces live once in ``mini_vllm.attention.triton_unified`` (with the kernel that calls them
and its launcher); this file re-exports them and holds the lab's wrapper (the same as the
starter's).
"""

from __future__ import annotations

from mini_vllm.attention import triton_unified
from mini_vllm.attention.triton_unified import (
    first_tile,
    in_window,
    load_kv_tile,
    load_q_tile,
    reduce_segments,
    softmax_step,
    visible,
)

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


# Given: ``unified_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
# block_tables, scale, *, sliding_window=0, num_segments=1, yours=PIECE_NAMES)``, the kernel of
# ``triton_unified`` with this file's functions named in ``yours`` (the reference's for the
# others): the tests of one task take yours for that task only.
unified_attention = triton_unified.lab_entry_point(globals())
