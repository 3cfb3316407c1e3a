"""Lab 01-03 starter: decoding with a flat KV cache, and what it wastes.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold, which errors, and the cost.
How to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint
01-03 N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea,
and the tests that check it), then ``--level 4`` (the upstream lines to read).

Use lab 01's reference for attention (``ref_attention``, already imported); ``MemoryReport`` is
complete. Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-01-attention/labs/lab-03-kv-cache -q
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

    * ``key_cache``, ``value_cache``: ``[batch_size, num_kv_heads, max_seq_len, head_size]``
      (head-major within a sequence), allocated once and never resized or replaced.
    * ``seq_lens``: a ``torch.long`` tensor ``[batch_size]``; sequence ``s`` stores its tokens in
      slots ``0 .. seq_lens[s] - 1``, token ``t`` in slot ``t``.
    * Slots at or past ``seq_lens[s]`` may hold anything (NaN included): no result of this lab
      may depend on them.
    * ``max_seq_len``: the int given to ``__init__``.
    * A rejected call raises ValueError and changes nothing.
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
        """An empty cache: ``key_cache`` and ``value_cache`` of zeros in ``dtype`` on ``device``
        (``None``: torch's default device), ``seq_lens`` all 0, ``max_seq_len`` kept.

        Errors: ValueError unless all four sizes are positive ints (the message names the size).
        Cost: the whole reservation, ``2 * batch_size * num_kv_heads * max_seq_len * head_size``
        elements, at once.
        """
        raise NotImplementedError(
            "lab 01-03, task 1: implement FlatKVCache.__init__ "
            "(hint: python -m course hint 01-03 1)"
        )

    def append(self, seq_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``n`` new tokens of sequence ``seq_idx`` after the ones already stored.

        Inputs: ``key`` and ``value`` ``[n, num_kv_heads, head_size]`` (token-major, ``n >= 0``)
        in the cache's dtype. Afterwards token ``seq_lens[seq_idx] + t`` of the sequence holds
        ``key[t]`` and ``value[t]`` in its slot, ``seq_lens[seq_idx]`` has grown by ``n``, and
        nothing else changed (other slots, other sequences). A write that fills the sequence
        exactly to ``max_seq_len`` is allowed.

        Errors (ValueError, nothing changed): ``seq_idx`` outside ``[0, batch_size)`` (no
        negative indexing); shapes other than ``[n, num_kv_heads, head_size]`` or ``key`` and
        ``value`` of different shapes; a dtype other than the cache's; more tokens than the room
        left (the message gives the tokens stored, the tokens asked for and ``max_seq_len``).
        Cost: O(n * num_kv_heads * head_size).
        """
        raise NotImplementedError(
            "lab 01-03, task 2: implement FlatKVCache.append (hint: python -m course hint 01-03 2)"
        )

    def keys(self, seq_idx: int) -> torch.Tensor:
        """The stored keys of one sequence, ``[seq_lens[seq_idx], num_kv_heads, head_size]``
        (token-major): a view of the filled slots of ``key_cache`` (no copy: it shares the
        cache's storage), never an empty slot. O(1)."""
        raise NotImplementedError(
            "lab 01-03, task 3: implement FlatKVCache.keys (hint: python -m course hint 01-03 3)"
        )

    def values(self, seq_idx: int) -> torch.Tensor:
        """The stored values of one sequence, like ``keys``."""
        raise NotImplementedError(
            "lab 01-03, task 3: implement FlatKVCache.values (hint: python -m course hint 01-03 3)"
        )

    def reserved_bytes(self) -> int:
        """Bytes the two cache tensors occupy: every slot, used or not (an int)."""
        raise NotImplementedError(
            "lab 01-03, task 6: implement FlatKVCache.reserved_bytes "
            "(hint: python -m course hint 01-03 6)"
        )

    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token: ``sum(seq_lens)`` tokens, each with a key and a
        value of ``num_kv_heads * head_size`` elements (an int; 0 for an empty cache)."""
        raise NotImplementedError(
            "lab 01-03, task 6: implement FlatKVCache.used_bytes "
            "(hint: python -m course hint 01-03 6)"
        )


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
    """One forward step of one sequence: its ``n`` new tokens (a prefill, a chunk, or ``n = 1``
    for a decode step).

    Inputs: ``query`` ``[n, num_heads, head_size]``; ``key`` and ``value`` the new tokens' K/V,
    as for ``append``.

    Afterwards the new K/V are stored (as ``append``). Output: ``[n, num_heads, head_size]`` in
    the query dtype, equal to the last ``n`` rows of causal ``ref_attention`` recomputed over the
    whole sequence so far (every stored token, these included), with the same ``scale`` and
    ``alibi_slopes`` (defaults as ``ref_attention``). ``n = 0`` stores nothing and returns an
    empty ``[0, num_heads, head_size]`` tensor.

    Errors (ValueError, nothing stored): a ``query`` that is not ``[n, num_heads, head_size]``
    with the cache's ``head_size``, ``num_heads`` a multiple of ``num_kv_heads`` and the same
    ``n`` as ``key``; ``alibi_slopes`` that are not ``[num_heads]``; and everything ``append``
    refuses. Cost: O(n * stored tokens * num_heads * head_size).
    """
    raise NotImplementedError(
        "lab 01-03, task 4: implement cached_attention (hint: python -m course hint 01-03 4)"
    )


def decode_step(
    cache: FlatKVCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step for the whole batch at once: one new token per sequence.

    Inputs: ``query`` ``[batch, num_heads, head_size]``, ``key``/``value``
    ``[batch, num_kv_heads, head_size]`` (row ``s`` is sequence ``s``'s new token), ``num_heads``
    a multiple of ``num_kv_heads``; ``scale`` as in lab 01 (``None``: ``head_size ** -0.5``).

    Afterwards every sequence holds its new token (``seq_lens`` all grew by one). Output:
    ``[batch, num_heads, head_size]`` in the query dtype on the cache's device; row ``s`` equals
    causal ``ref_attention`` of the new query over all of sequence ``s``'s stored tokens (a
    sequence that was empty attends to its new token alone).

    How: ONE batched computation over all ``max_seq_len`` slots of every sequence (the flat
    cache's way: no loop over sequences, no per-sequence ``ref_attention``), in float32 (float64
    for float64) and rounded to the query dtype once at the end, with each slot past
    ``seq_lens[s]`` kept out of the result, whatever it holds.

    Errors (ValueError, nothing stored): shapes that do not fit the cache, heads that do not
    divide, and a sequence that is already full (the message names the first full sequence).
    Cost: O(batch * num_heads * max_seq_len * head_size), whatever the sequences' lengths.
    """
    raise NotImplementedError(
        "lab 01-03, task 5: implement decode_step (hint: python -m course hint 01-03 5)"
    )


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
    """Reserved against used KV memory of a flat cache whose sequences end at ``final_lens``.

    One token costs ``2 (K and V) * num_layers * num_kv_heads * head_size * bytes(dtype)``
    (defaults: float16, one layer). Each sequence reserves ``max_seq_len`` tokens and uses its
    final length. Output: ``MemoryReport(reserved, used, reserved - used, waste_fraction)`` with
    ints for the bytes and ``waste_fraction = wasted / reserved`` (1.0 when nothing is used,
    0.0 when every sequence reaches ``max_seq_len``). Nothing is allocated.

    Errors: ValueError for an empty ``final_lens`` or a length outside ``[0, max_seq_len]``.
    Cost: O(len(final_lens)).
    """
    raise NotImplementedError(
        "lab 01-03, task 6: implement memory_report (hint: python -m course hint 01-03 6)"
    )
