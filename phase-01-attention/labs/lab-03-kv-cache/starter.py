"""Lab 01-03: decoding with a flat KV cache. Fill in every body that raises NotImplementedError.

Use lab 01's reference for attention (``from mini_vllm.attention.reference import
ref_attention``, already imported). Read the README for the picture and the order of the tasks;
run ``LAB_IMPL=starter pytest <this folder> -q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mini_vllm.attention.reference import ref_attention  # noqa: F401  (you will need it)

__all__ = [
    "FlatKVCache",
    "MemoryReport",
    "cached_attention",
    "decode_step",
    "memory_report",
]


class FlatKVCache:
    """Keys and values of ``batch_size`` sequences, each with room for ``max_seq_len`` tokens.

    Invariants your code must keep:

    * ``key_cache``, ``value_cache``: ``[batch_size, num_kv_heads, max_seq_len, head_size]``,
      allocated once (zeros) and never resized.
    * ``seq_lens``: a ``torch.long`` tensor ``[batch_size]``; sequence ``s`` stores its tokens in
      slots ``0 .. seq_lens[s] - 1`` (token ``t`` in slot ``t``). Later slots are never read.
    * ``max_seq_len``: the int given to ``__init__``.
    * A rejected ``append`` raises ValueError and changes nothing.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        """Allocate both caches (zeros, ``dtype``, ``device``) and ``seq_lens`` (zeros).
        Raise ValueError unless all four sizes are positive ints."""
        raise NotImplementedError("lab 01-03, task 1: implement FlatKVCache.__init__")

    def append(self, seq_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``n`` new tokens (``key``, ``value``: ``[n, num_kv_heads, head_size]``, the
        cache's dtype) in slots ``seq_lens[seq_idx] ..`` and advance ``seq_lens[seq_idx]``.

        Check everything first (seq_idx in range, shapes, dtype, room left): ValueError and no
        change otherwise. Mind the layout: the cache is head-major, the input token-major.
        """
        raise NotImplementedError("lab 01-03, task 2: implement FlatKVCache.append")

    def keys(self, seq_idx: int) -> torch.Tensor:
        """The stored keys of one sequence as ``[seq_lens[seq_idx], num_kv_heads, head_size]``:
        a view of the filled slots only (no copy, no empty slots)."""
        raise NotImplementedError("lab 01-03, task 3: implement FlatKVCache.keys")

    def values(self, seq_idx: int) -> torch.Tensor:
        """The stored values of one sequence, like ``keys``."""
        raise NotImplementedError("lab 01-03, task 3: implement FlatKVCache.values")

    def reserved_bytes(self) -> int:
        """Bytes the two cache tensors occupy (every slot, used or not)."""
        raise NotImplementedError("lab 01-03, task 6: implement FlatKVCache.reserved_bytes")

    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token: ``sum(seq_lens)`` tokens, keys and values."""
        raise NotImplementedError("lab 01-03, task 6: implement FlatKVCache.used_bytes")


def cached_attention(
    cache: FlatKVCache,
    seq_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward step of one sequence: append the new tokens' K/V, then attend the new queries
    (``[n, num_heads, head_size]``) over EVERY stored token with ``ref_attention``.

    The same function serves the prefill (``n`` = prompt length) and a decode step (``n = 1``).
    Raise ValueError if ``query`` is not 3-D or its ``n`` differs from ``key``'s.
    """
    raise NotImplementedError("lab 01-03, task 4: implement cached_attention")


def decode_step(
    cache: FlatKVCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step for the whole batch at once. ``query`` ``[batch, num_heads, head_size]``,
    ``key``/``value`` ``[batch, num_kv_heads, head_size]``: one new token per sequence.

    1. Validate shapes; if any sequence is already full raise ValueError BEFORE storing anything.
    2. Append each sequence's new token.
    3. Compute attention as ONE batched computation over all ``max_seq_len`` slots of the cache
       (float32, or float64 for float64 inputs; KV heads repeated for GQA as in lab 01), masking
       slot ``t`` of sequence ``s`` to ``-inf`` unless ``t < seq_lens[s]``.
    Returns ``[batch, num_heads, head_size]`` in ``query.dtype``.
    """
    raise NotImplementedError("lab 01-03, task 5: implement decode_step")


class MemoryReport(NamedTuple):
    """KV memory of a flat cache for a batch of sequences (complete)."""

    reserved_bytes: int
    used_bytes: int
    wasted_bytes: int
    waste_fraction: float


def memory_report(
    final_lens: Sequence[int],
    max_seq_len: int,
    *,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    num_layers: int = 1,
) -> MemoryReport:
    """Reserved vs used KV memory of a flat cache whose sequences end at ``final_lens`` tokens.

    One token costs ``2 (K and V) * num_layers * num_kv_heads * head_size * bytes(dtype)``.
    Each sequence reserves ``max_seq_len`` tokens and uses its final length;
    ``waste_fraction = wasted / reserved``. ValueError for an empty list or a length outside
    ``[0, max_seq_len]``.
    """
    raise NotImplementedError("lab 01-03, task 6: implement memory_report")
