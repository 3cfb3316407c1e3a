"""Lab 03-02 starter: chunked prefill and the batch the model sees.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors. How
to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 03-02
N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

``AttentionMetadata``, ``make_block_table_tensor`` and ``gather_paged_kv`` are complete and yours
to use. Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-03-scheduler/labs/lab-02-chunked-prefill -q
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
    """Where each sequence's rows start in the flat batch, and where the batch ends.

    Input: a 1-D integer tensor (int32 or int64) of per-sequence lengths, possibly empty.
    Output: a new int32 tensor of ``len(query_lens) + 1`` entries, ``[0, q0, q0 + q1, ...,
    total]`` (``[4, 6] -> [0, 4, 10]``; ``[] -> [0]``), on ``query_lens``' device; rows
    ``[out[i], out[i + 1])`` are sequence ``i``. The input is not changed. Tensor ops only.
    """
    raise NotImplementedError(
        "lab 03-02, task 1: implement compute_query_start_loc "
        "(hint: python -m course hint 03-02 1)"
    )


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
    """The cache slot each flat token's KV is written to.

    Inputs: ``block_tables`` int32 ``[num_seqs, cols]``; ``req_indices`` and ``positions``,
    integer tensors of one entry per flat token (in any order): token ``t`` sits at position
    ``positions[t]`` of batch row ``req_indices[t]``; ``block_size >= 1``.

    Output: int64 ``[num_tokens]``, ``slot[t] = block_tables[r, p // block_size] * block_size +
    p % block_size`` with ``r, p = req_indices[t], positions[t]``. Slots of a large cache pass
    2**31 (a block id near 10**8 with blocks of 32): compute in int64, not int32. Table entries
    no token's position reaches are never read. Tensor ops only, no Python loop.
    """
    raise NotImplementedError(
        "lab 03-02, task 2: implement compute_slot_mapping (hint: python -m course hint 03-02 2)"
    )


def reorder_batch_to_split_decodes_and_prefills(
    req_ids: list[str],
    num_scheduled_tokens: Mapping[str, int],
    decode_threshold: int = DECODE_THRESHOLD,
) -> bool:
    """Put every decode before every prefill, in place, with the fewest swaps; True when
    anything moved.

    A request is a decode when ``num_scheduled_tokens[r] <= decode_threshold`` (default 1),
    else a prefill; ``num_scheduled_tokens`` may hold other requests too. With ``nd`` decodes,
    afterwards positions ``[0, nd)`` hold the decodes and the rest the prefills, and:

    * a decode already inside ``[0, nd)`` does not move, and neither does a prefill already
      outside it: the order changes by swapping the misplaced pairs only (the fewest moves, so a
      persistent batch stays put from step to step);
    * the pairing is upstream's: the misplaced decodes, taken from the back, go to the places of
      the misplaced prefills, taken from the front (the last decode to the first prefill's
      place, and that prefill to where the decode was).

    ``req_ids`` is the same list object afterwards; nothing else changes. O(len(req_ids)).
    """
    raise NotImplementedError(
        "lab 03-02, task 4: implement reorder_batch_to_split_decodes_and_prefills "
        "(hint: python -m course hint 03-02 4)"
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
    """The metadata of one step's batch, ``req_ids`` in that order (decodes first).

    Inputs: ``num_scheduled_tokens[r]`` (the step's new tokens of request ``r``),
    ``num_computed_tokens[r]`` (its tokens whose KV is already cached, before the step) and
    ``block_tables[r]`` (its whole block table, any sequence of ints); the mappings may hold
    other requests too, which are ignored. Nothing passed in is changed.

    Output, for sequence ``i`` (request ``r = req_ids[i]``) and every field of
    ``AttentionMetadata`` (see the README's table): ``req_ids`` the batch as a list, ``num_reqs``
    its length; ``query_lens[i] = num_scheduled_tokens[r]``, ``context_lens[i] =
    num_computed_tokens[r]``, ``seq_lens = context_lens + query_lens`` (int32);
    ``query_start_loc`` and ``seq_start_loc`` their running sums (task 1); per flat token,
    ``positions`` (``context_len + offset in the query``, int64) and ``slot_mapping`` (task 2,
    int64); ``block_tables`` every table padded with 0 to the longest (``make_block_table_tensor``);
    a decode is a sequence with ``query_len <= decode_threshold``, and ``num_decodes``,
    ``num_prefills``, ``num_decode_tokens``, ``num_prefill_tokens``, ``num_actual_tokens``
    count them; ``max_query_len``, ``max_seq_len``, ``max_prefill_seq_len``,
    ``max_decode_seq_len`` are Python ints, 0 for an empty group.

    Errors (``ValueError``): an empty batch; a request listed twice; a request missing from any
    of the three mappings; a query length < 1 or a context < 0; a ``block_size`` that is not an
    int >= 1; a decode after a prefill (reorder first, task 4); a block table with fewer than
    ``context + query`` slots.
    """
    raise NotImplementedError(
        "lab 03-02, task 3: implement build_attention_metadata "
        "(hint: python -m course hint 03-02 3)"
    )


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

    Inputs: ``query [num_tokens, num_heads, head_size]`` is the flat batch (rows
    ``query_start_loc[s]:query_start_loc[s + 1]`` are sequence ``s``); the x-split caches of
    lab 02-04, which already hold the KV of every position ``< seq_lens[s]`` of every sequence,
    this step's tokens included; ``metadata`` from ``build_attention_metadata``.

    Output: a new ``[num_tokens, num_heads, head_size]`` tensor in ``query.dtype``. Row ``i`` of
    sequence ``s`` sits at position ``p = context_lens[s] + i`` and attends over the keys and
    values at positions ``0 .. p`` of that sequence (the causal mask shifted right by the
    context), read through ``block_tables[s]``: softmax of ``scale * q . k`` (``scale``
    defaults to ``1 / sqrt(head_size)``), with query head ``h`` reading KV head
    ``h // (num_heads // num_kv_heads)``. Scores, softmax and the weighted sum are float32
    (float64 for float64 inputs).

    Junk: slots at positions ``>= seq_lens[s]``, blocks no sequence owns and the padding of
    ``block_tables`` (block 0, the null block) may hold anything, NaN included; the output must
    not depend on them. Errors (``ValueError``): ``query`` not 3-D, a row count other than
    ``num_actual_tokens``, caches that are not x-split ``[blocks, kvh, D // x, bs, x]`` and
    ``[blocks, kvh, D, bs]`` with ``query``'s ``head_size``, ``num_heads`` not a multiple of
    ``num_kv_heads``. Tensor ops; no Python loop over tokens.
    """
    raise NotImplementedError(
        "lab 03-02, task 5: implement chunked_prefill_attention "
        "(hint: python -m course hint 03-02 5)"
    )
