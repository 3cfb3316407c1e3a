"""Lab 02-04: PagedAttention in PyTorch. Fill in every function that raises NotImplementedError.

Layouts (``x = 16 // element_size``: 4 for float32, 8 for float16/bfloat16)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size,      block_size]
    flash       [num_blocks, block_size, num_kv_heads, head_size]        (keys and values alike)

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; a slot is ``block * block_size + offset``. Read the lab README for the
formulas and the order of the tasks; run ``LAB_IMPL=starter pytest <this folder> -q``.

Rules: use tensor operations (no Python loop over tokens; a loop over v2's partitions is fine),
and do not import from ``mini_vllm.attention.paged_attn`` or ``cache_ops`` (that is the answer).
The input checks in ``mini_vllm.attention.paged_checks`` are yours to use: call them first, so
that a bad call raises ``ValueError`` before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.attention.paged_checks import (  # noqa: F401  (helpers for you to call)
    CACHE_DTYPES,
    check_copy,
    check_decode_inputs,
    check_flash_caches,
    check_out,
    check_paged_caches,
    check_slots,
    check_swap,
    check_v2_buffers,
)

__all__ = [
    "PARTITION_SIZE",
    "kv_cache_x",
    "get_kv_cache_shape",
    "split_kv_cache",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_v2_reduce",
    "use_v1",
    "forward_decode",
    "copy_blocks",
    "swap_blocks",
]

# Tokens per v2 partition (upstream's value). Every block size divides it.
PARTITION_SIZE = 512


def _num_partitions(max_seq_len: int) -> int:
    """Partitions of PARTITION_SIZE tokens needed for ``max_seq_len`` tokens (at least 1)."""
    return max(1, -(-int(max_seq_len) // PARTITION_SIZE))


# ------------------------------------------------------------------------------------------
# Task 1: layouts
# ------------------------------------------------------------------------------------------


def kv_cache_x(dtype: torch.dtype) -> int:
    """How many elements of ``dtype`` fill one 16-byte vector: 4 for float32, 8 for 16-bit types.

    Raise ValueError for a dtype outside ``CACHE_DTYPES``.
    """
    raise NotImplementedError("lab 02-04, task 1: implement kv_cache_x")


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int]:
    """``(2, num_blocks, block_size * num_kv_heads * head_size)``: keys in [0], values in [1].

    Raise ValueError unless every argument is a positive int.
    """
    raise NotImplementedError("lab 02-04, task 1: implement get_kv_cache_shape")


def split_kv_cache(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """View ``kv_cache`` (from ``get_kv_cache_shape``) as ``(key_cache, value_cache)``.

    Use ``.view`` so writes go through to ``kv_cache``; let the block size be inferred (-1).
    Raise ValueError if ``kv_cache`` is not ``(2, num_blocks, n)``, if ``head_size`` is not a
    multiple of x, or if ``n`` is not a multiple of ``num_kv_heads * head_size``.
    """
    raise NotImplementedError("lab 02-04, task 1: implement split_kv_cache")


# ------------------------------------------------------------------------------------------
# Task 2: writing the cache
# ------------------------------------------------------------------------------------------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[i]``/``value[i]`` into slot ``slot_mapping[i]``; skip negative slots.

    Afterwards ``key_cache[b, h, d // x, o, d % x] == key[i, h, d]`` and
    ``value_cache[b, h, d, o] == value[i, h, d]`` with ``b, o = divmod(slot, block_size)``.
    Only the first ``len(slot_mapping)`` tokens are written (``key`` may be longer).
    Hint: ``num_blocks, block_size = check_paged_caches(...)``, then
    ``slots = check_slots(slot_mapping, key.shape[0], num_blocks * block_size, device)``; one
    advanced-indexing assignment per cache does the rest.
    """
    raise NotImplementedError("lab 02-04, task 2: implement reshape_and_cache")


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same as ``reshape_and_cache`` for the flash layout ``[num_blocks, block_size, kvh, D]``.

    Hint: ``check_flash_caches`` then ``check_slots``.
    """
    raise NotImplementedError("lab 02-04, task 2: implement reshape_and_cache_flash")


# ------------------------------------------------------------------------------------------
# Task 3: paged_attention_v1
# ------------------------------------------------------------------------------------------


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Decode attention over the paged cache, written into ``out [num_seqs, num_heads, D]``.

    Sequence ``s`` attends over its ``seq_lens[s]`` tokens; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``; the logit of key position ``t`` is
    ``scale * q . k_t + alibi_slopes[h] * (t - (seq_len - 1))`` (no ALiBi term when None).
    Work in float32 and cast on the final ``out.copy_``.

    Steps: ``longest = check_decode_inputs(...)`` and ``check_out(out, query)``; gather the
    first ``ceil(longest / block_size)`` table columns for all sequences at once
    (``key_cache[table]``), permute/reshape keys to ``[seqs, kvh, tokens, D]`` (undo the x
    split) and values likewise; mask positions ``>= seq_len`` with -inf before the softmax.
    Table entries past a sequence's blocks are padding: replace them by 0 before indexing.
    """
    raise NotImplementedError("lab 02-04, task 3: implement paged_attention_v1")


# ------------------------------------------------------------------------------------------
# Task 4: paged_attention_v2 and its reduce
# ------------------------------------------------------------------------------------------


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """v1's result, computed per partition of PARTITION_SIZE tokens and then merged.

    For partition ``p`` of sequence ``s``, head ``h``: ``max_logits[s, h, p]`` is its largest
    logit ``m_p``, ``exp_sums[s, h, p]`` is ``sum(exp(logit - m_p))`` and ``tmp_out[s, h, p]``
    its own softmax-weighted sum of values. A partition that starts at or past ``seq_len``
    gets ``m_p = -inf``, exp sum 0, zeros. Then call ``paged_attention_v2_reduce``.

    Checks: ``check_decode_inputs``, ``check_out``, ``block_size`` must divide PARTITION_SIZE
    (ValueError), and ``check_v2_buffers(out, exp_sums, max_logits, tmp_out,
    _num_partitions(max_seq_len))``.
    """
    raise NotImplementedError("lab 02-04, task 4: implement paged_attention_v2")


def paged_attention_v2_reduce(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Merge the partitions: with ``M = max_p m_p``, partition ``p`` weighs
    ``exp_sums[p] * exp(m_p - M)``; ``out`` is the weighted mean of ``tmp_out`` over ``p``.

    Read only the first ``ceil(seq_len / PARTITION_SIZE)`` partitions of each sequence: the
    rest may hold anything.
    """
    raise NotImplementedError("lab 02-04, task 4: implement paged_attention_v2_reduce")


# ------------------------------------------------------------------------------------------
# Task 5: choosing v1 or v2
# ------------------------------------------------------------------------------------------


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """v0.11.0's rule: v1 when ``max_seq_len <= 8192`` and either the context fits one
    partition or ``num_seqs * num_heads > 512``; v2 otherwise."""
    raise NotImplementedError("lab 02-04, task 5: implement use_v1")


def forward_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_kv_heads: int,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Allocate the output (and v2's buffers), pick v1 or v2 with ``use_v1`` and run it.

    Complete: it works once tasks 3 to 5 do.
    """
    if query.dim() != 3 or value_cache.dim() != 4:
        raise ValueError(
            "query must be [num_seqs, num_heads, head_size] and value_cache "
            "[num_blocks, num_kv_heads, head_size, block_size]"
        )
    out = torch.empty_like(query)
    num_seqs, num_heads, head_size = query.shape
    block_size = value_cache.shape[-1]
    if use_v1(max_seq_len, num_seqs, num_heads):
        paged_attention_v1(
            out,
            query,
            key_cache,
            value_cache,
            num_kv_heads,
            scale,
            block_tables,
            seq_lens,
            block_size,
            max_seq_len,
            alibi_slopes,
        )
        return out
    parts = _num_partitions(max_seq_len)
    exp_sums = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(
        num_seqs, num_heads, parts, head_size, dtype=query.dtype, device=query.device
    )
    paged_attention_v2(
        out,
        exp_sums,
        max_logits,
        tmp_out,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
    )
    return out


# ------------------------------------------------------------------------------------------
# Task 6: moving blocks
# ------------------------------------------------------------------------------------------


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every ``(src, dst)`` row of ``block_mapping``, copy block src over block dst in every
    layer's key and value cache. Start with ``src, dst = check_copy(...)``."""
    raise NotImplementedError("lab 02-04, task 6: implement copy_blocks")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block ``m[i, 0]`` of ``src`` into block ``m[i, 1]`` of ``dst``; the two may be on
    different devices. Start with ``src_ids, dst_ids = check_swap(...)``."""
    raise NotImplementedError("lab 02-04, task 6: implement swap_blocks")
