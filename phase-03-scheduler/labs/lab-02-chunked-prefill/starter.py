"""Lab 03-02 starter: chunked prefill and the batch the model sees.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
``AttentionMetadata``, ``make_block_table_tensor`` and ``gather_paged_kv`` are complete.

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-02-chunked-prefill -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "chunked_prefill_attention",
    "compute_query_start_loc",
    "compute_slot_mapping",
    "gather_paged_kv",
    "make_block_table_tensor",
    "reorder_batch_to_split_decodes_and_prefills",
]

DECODE_THRESHOLD = 1


@dataclass
class AttentionMetadata:
    """Attention metadata of one step (see the README for every field).

    Invariants: the first ``num_decodes`` sequences are decodes and the rest prefills;
    ``num_decode_tokens + num_prefill_tokens == num_actual_tokens == query_start_loc[-1]``;
    ``seq_lens == context_lens + query_lens``; ``len(slot_mapping) == num_actual_tokens``.
    Integer tensors are int32 except ``slot_mapping`` and ``positions`` (int64).
    """

    req_ids: list[str]
    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    query_start_loc: torch.Tensor
    seq_start_loc: torch.Tensor
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    max_prefill_seq_len: int
    max_decode_seq_len: int


def compute_query_start_loc(query_lens: torch.Tensor) -> torch.Tensor:
    """Exclusive running sum with the total appended: ``[0, q0, q0 + q1, ...]``, int32,
    ``len(query_lens) + 1`` entries (``[4, 6] -> [0, 4, 10]``)."""
    raise NotImplementedError("lab 03-02, task 1: implement compute_query_start_loc")


def make_block_table_tensor(
    block_tables: Sequence[Sequence[int]], num_cols: int | None = None
) -> torch.Tensor:
    """Stack block tables into an int32 ``[num_seqs, num_cols]`` tensor, padded with 0 (the null
    block). ``num_cols`` defaults to the longest table."""
    longest = max((len(t) for t in block_tables), default=0)
    cols = longest if num_cols is None else num_cols
    if cols < longest:
        raise ValueError(f"a block table has {longest} blocks, more than num_cols={cols}")
    out = torch.zeros((len(block_tables), cols), dtype=torch.int32)
    for i, table in enumerate(block_tables):
        if len(table):
            out[i, : len(table)] = torch.as_tensor(list(table), dtype=torch.int32)
    return out


def compute_slot_mapping(
    block_tables: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of each flat token ``t`` (int64): the token at position ``p =
    positions[t]`` of batch row ``r = req_indices[t]`` lives in block ``block_tables[r, p //
    block_size]`` at offset ``p % block_size``; its slot is ``block * block_size + offset``.
    Use tensor indexing, no Python loop."""
    raise NotImplementedError("lab 03-02, task 2: implement compute_slot_mapping")


def reorder_batch_to_split_decodes_and_prefills(
    req_ids: list[str],
    num_scheduled_tokens: Mapping[str, int],
    decode_threshold: int = DECODE_THRESHOLD,
) -> bool:
    """Reorder ``req_ids`` in place so that every decode (``<= decode_threshold`` scheduled
    tokens) precedes every prefill; return True if anything moved.

    Use upstream's fewest-swaps walk: collect the decode indices and the prefill indices (both
    ascending); for ``i = 1, 2, ...`` take the ``i``-th decode from the back; if it already sits
    inside the decode region (index < number of decodes) stop; otherwise swap it with the
    ``i``-th prefill from the front."""
    raise NotImplementedError(
        "lab 03-02, task 4: implement reorder_batch_to_split_decodes_and_prefills"
    )


def build_attention_metadata(
    req_ids: Sequence[str],
    num_scheduled_tokens: Mapping[str, int],
    num_computed_tokens: Mapping[str, int],
    block_tables: Mapping[str, Sequence[int]],
    block_size: int,
    *,
    decode_threshold: int = DECODE_THRESHOLD,
) -> AttentionMetadata:
    """Build the metadata of the batch ``req_ids`` (in that order, decodes first).

    For request ``r``: ``query_lens = num_scheduled_tokens[r]``, ``context_lens =
    num_computed_tokens[r]`` (before the step), ``seq_lens = context + query``; ``positions`` and
    ``slot_mapping`` have one entry per flat token; ``block_tables`` is padded with
    ``make_block_table_tensor``. A decode has ``query_len <= decode_threshold``. The ``max_*``
    fields are 0 when their group is empty.

    Raise ``ValueError`` for an empty batch, a request listed twice or missing from a mapping,
    a query length < 1, a batch that is not decodes-first, or a block table with fewer than
    ``context + query`` slots.
    """
    raise NotImplementedError("lab 03-02, task 3: implement build_attention_metadata")


def gather_paged_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values, token-major: two ``[num_seqs, max_blocks * bs, KVH, D]``.

    ``key_cache [num_blocks, KVH, D // x, bs, x]`` and ``value_cache [num_blocks, KVH, D, bs]``;
    position ``p`` of sequence ``s`` comes from block ``block_tables[s, p // bs]``. Positions past
    a sequence's length read padding and must be masked by the caller.
    """
    _, num_kv_heads, _, block_size, _ = key_cache.shape
    head_size = value_cache.shape[2]
    ids = block_tables.long().to(key_cache.device)
    num_seqs, max_blocks = ids.shape
    # Pick the blocks first, then reorder only them: [S, MB, KVH, D//x, bs, x] -> token-major.
    keys = key_cache[ids].permute(0, 1, 4, 2, 3, 5)
    keys = keys.reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    values = value_cache[ids].permute(0, 1, 4, 2, 3)  # [S, MB, KVH, D, bs] -> [S, MB, bs, KVH, D]
    values = values.reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    return keys, values


def chunked_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of every query token of the batch over its sequence's paged KV.

    ``query [num_tokens, num_heads, head_size]`` is the flat batch. Query ``i`` of sequence ``s``
    sits at position ``context_lens[s] + i`` and sees the keys at positions ``0 ..`` that
    position (the causal mask shifted by the context). ``scale`` defaults to
    ``1 / sqrt(head_size)``; scores and softmax in float32 (float64 for float64); grouped-query
    heads read KV head ``h // (num_heads // num_kv_heads)``. Returns ``[num_tokens, num_heads,
    head_size]`` in ``query.dtype``. No Python loop over sequences or tokens: gather with
    ``gather_paged_kv``, pad the queries to ``[num_seqs, max_query_len, ...]``, mask by position.
    Raise ``ValueError`` when ``query`` does not match the metadata or the caches.
    """
    raise NotImplementedError("lab 03-02, task 5: implement chunked_prefill_attention")
