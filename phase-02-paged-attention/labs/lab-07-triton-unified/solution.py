"""Lab 02-07 reference: the unified paged attention kernel of today's vLLM, in Triton.

The pieces live once in ``mini_vllm.attention.triton_unified`` (with the kernel that calls them
and its launcher); this file re-exports them and holds the lab's wrapper (the same as the
starter's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
PIECE_NAMES = ("load_q_tile", "load_kv_tile", "visible", "softmax_step", "reduce_segments",
               "in_window", "first_tile")


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, *, sliding_window: int = 0,
                      num_segments: int = 1, yours: Sequence[str] = PIECE_NAMES) -> torch.Tensor:
    """Given. The kernel of ``mini_vllm.attention.triton_unified`` with this file's functions
    named in ``yours`` (the reference's for the others): the tests of one task take yours for
    that task only. Returns ``[num_tokens, num_heads, head]`` in the query's dtype.
    """
    unknown = sorted(set(yours) - set(PIECE_NAMES))
    if unknown:
        raise ValueError(f"unified_attention: {unknown} are not pieces of this lab; "
                         f"choose among {list(PIECE_NAMES)}")
    return triton_unified.unified_attention(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
        sliding_window=sliding_window, num_segments=num_segments,
        pieces={name: globals()[name] for name in yours})
