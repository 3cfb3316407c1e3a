"""Lab 01-03 solution: decoding with a contiguous (flat) KV cache, and what it wastes.

The flat cache is the baseline that phase 02 replaces, not part of the engine, so it lives here
as lab material. Attention itself is lab 01's reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mini_vllm.attention.reference import ref_attention

__all__ = [
    "FlatKVCache",
    "MemoryReport",
    "cached_attention",
    "decode_step",
    "memory_report",
]


class FlatKVCache:
    """Keys and values of ``batch_size`` sequences, each with room for ``max_seq_len`` tokens.

    Invariants:

    * ``key_cache`` and ``value_cache`` are ``[batch_size, num_kv_heads, max_seq_len, head_size]``,
      allocated once (zeros) and never resized: every sequence owns ``max_seq_len`` slots from
      the start, whatever its final length.
    * ``seq_lens[s]`` tokens of sequence ``s`` are stored, in slots ``0 .. seq_lens[s] - 1``;
      token ``t`` sits in slot ``t``. Slots at or past ``seq_lens[s]`` may hold anything (NaN
      included) and never change a result.
    * A rejected ``append`` changes nothing.
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
        for name, v in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_seq_len", max_seq_len),
            ("head_size", head_size),
        ):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"FlatKVCache: {name} must be a positive int, got {v!r}")
        shape = (batch_size, num_kv_heads, max_seq_len, head_size)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long)
        self.max_seq_len = max_seq_len

    def append(self, seq_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``n`` new tokens' ``key``/``value`` (``[n, num_kv_heads, head_size]``) after the
        ``seq_lens[seq_idx]`` already stored; ValueError (and no change) if they do not fit."""
        _, num_kv_heads, _, head_size = self.key_cache.shape
        if not 0 <= seq_idx < self.key_cache.shape[0]:
            raise ValueError(f"append: seq_idx {seq_idx} is not in [0, {self.key_cache.shape[0]})")
        if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_size):
            raise ValueError(
                f"append: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                f"[n, {num_kv_heads}, {head_size}]"
            )
        if key.dtype != self.key_cache.dtype or value.dtype != self.key_cache.dtype:
            raise ValueError(f"append: dtype must be the cache's {self.key_cache.dtype}")
        start, n = int(self.seq_lens[seq_idx]), key.shape[0]
        if start + n > self.max_seq_len:
            raise ValueError(
                f"append: sequence {seq_idx} holds {start} tokens; {n} more exceed "
                f"max_seq_len={self.max_seq_len} (a flat cache cannot grow)"
            )
        # The cache is head-major per sequence; the incoming tokens are token-major.
        self.key_cache[seq_idx, :, start : start + n] = key.transpose(0, 1)
        self.value_cache[seq_idx, :, start : start + n] = value.transpose(0, 1)
        self.seq_lens[seq_idx] = start + n

    def keys(self, seq_idx: int) -> torch.Tensor:
        """The stored keys of one sequence, ``[seq_lens[seq_idx], num_kv_heads, head_size]``
        (a view, no copy)."""
        n = int(self.seq_lens[seq_idx])
        return self.key_cache[seq_idx, :, :n].transpose(0, 1)

    def values(self, seq_idx: int) -> torch.Tensor:
        """The stored values of one sequence, like :meth:`keys`."""
        n = int(self.seq_lens[seq_idx])
        return self.value_cache[seq_idx, :, :n].transpose(0, 1)

    def reserved_bytes(self) -> int:
        """Bytes the two cache tensors occupy (all slots, used or not)."""
        return self.key_cache.nbytes + self.value_cache.nbytes

    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token (``sum(seq_lens)`` tokens, keys and values)."""
        _, num_kv_heads, _, head_size = self.key_cache.shape
        per_token = 2 * num_kv_heads * head_size * self.key_cache.element_size()
        return int(self.seq_lens.sum()) * per_token


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
    """One forward step of one sequence: store the new tokens' K/V, attend over everything stored.

    ``query`` ``[n, num_heads, head_size]`` are the new tokens (``n`` = prompt length for the
    prefill, 1 for a decode step); the result equals rows ``-n:`` of causal attention recomputed
    over the whole sequence.
    """
    _, num_kv_heads, _, head_size = cache.key_cache.shape
    if (
        query.dim() != 3
        or query.shape[0] != key.shape[0]
        or query.shape[2] != head_size
        or query.shape[1] % num_kv_heads != 0
    ):
        raise ValueError(
            f"cached_attention: query {tuple(query.shape)} must be [n, num_heads, {head_size}] "
            f"with num_heads a multiple of {num_kv_heads} and the same n as key "
            f"{tuple(key.shape)}"
        )
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (query.shape[1],):
        raise ValueError(
            f"cached_attention: alibi_slopes {tuple(alibi_slopes.shape)} must be [{query.shape[1]}]"
        )
    cache.append(seq_idx, key, value)
    return ref_attention(
        query,
        cache.keys(seq_idx),
        cache.values(seq_idx),
        scale=scale,
        alibi_slopes=alibi_slopes,
    )


def decode_step(
    cache: FlatKVCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step for every sequence of the batch at once, over the padded flat cache.

    ``query`` ``[batch, num_heads, head_size]``, ``key``/``value`` ``[batch, num_kv_heads,
    head_size]``: one new token per sequence. The new K/V are stored, then attention runs as one
    batched computation over all ``max_seq_len`` slots with the slots past each sequence's length
    masked out, which is how a flat cache is used (and why it also computes on its padding).
    Returns ``[batch, num_heads, head_size]``. If any sequence is full, nothing is stored.

    upstream: csrc/attention/attention_kernels.cuh:415 @ v0.11.0
    """
    batch, num_kv_heads, max_seq_len, head_size = cache.key_cache.shape
    if query.dim() != 3 or query.shape[0] != batch or query.shape[2] != head_size:
        raise ValueError(f"decode_step: query must be [{batch}, num_heads, {head_size}]")
    if key.shape != (batch, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(f"decode_step: key/value must be [{batch}, {num_kv_heads}, {head_size}]")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"decode_step: {num_heads} heads over {num_kv_heads} KV heads")
    full = (cache.seq_lens >= max_seq_len).nonzero().flatten().tolist()
    if full:
        raise ValueError(
            f"decode_step: sequence {full[0]} already holds max_seq_len={max_seq_len} tokens; "
            "nothing was stored"
        )
    for s in range(batch):
        cache.append(s, key[s : s + 1], value[s : s + 1])

    scale = head_size**-0.5 if scale is None else scale
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    group = num_heads // num_kv_heads
    k = cache.key_cache.to(dtype).repeat_interleave(group, dim=1)  # [B, H, max_seq_len, D]
    v = cache.value_cache.to(dtype).repeat_interleave(group, dim=1)
    scores = scale * torch.einsum("bhd,bhtd->bht", query.to(dtype), k)
    positions = torch.arange(max_seq_len, device=scores.device)
    visible = positions[None, :] < cache.seq_lens.to(scores.device)[:, None]  # [B, max_seq_len]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    # A masked slot gets weight 0, but 0 * NaN is NaN: empty slots may hold anything, so their
    # values are zeroed too (upstream's decode kernel does the same for its last block).
    v = v.masked_fill(~visible[:, None, :, None], 0.0)
    out = torch.einsum("bht,bhtd->bhd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype)


class MemoryReport(NamedTuple):
    """KV memory of a flat cache for a batch of sequences (all layers, keys and values)."""

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
    """What a flat cache reserves for sequences that end at ``final_lens`` tokens, against what
    they use. Every sequence reserves ``max_seq_len`` slots; it uses its final length."""
    lens = [int(n) for n in final_lens]
    if not lens:
        raise ValueError("memory_report: need at least one sequence")
    if any(n < 0 or n > max_seq_len for n in lens):
        raise ValueError(f"memory_report: every final length must be in [0, {max_seq_len}]")
    per_token = (
        2 * num_layers * num_kv_heads * head_size * torch.empty(0, dtype=dtype).element_size()
    )
    reserved = len(lens) * max_seq_len * per_token
    used = sum(lens) * per_token
    return MemoryReport(reserved, used, reserved - used, (reserved - used) / reserved)
