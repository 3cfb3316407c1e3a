"""The attention metadata of one mixed batch: which query token belongs to which sequence, where
its KV goes, and which cache blocks each sequence reads.

With chunked prefill a step mixes decodes (one new token each) and prefill chunks (many). The
model sees all new tokens of the step flattened into one ``[num_tokens, ...]`` tensor; the
metadata says how to cut it apart again. For sequence ``i`` (in batch order)::

    |------------ context_lens[i] ------------|---- query_lens[i] ----|
    |  tokens whose KV is already in the cache | tokens of this step   |
    |------------------------ seq_lens[i] -----------------------------|

* ``query_start_loc[i] : query_start_loc[i + 1]`` are sequence ``i``'s rows of the flat batch
  (``query_start_loc[0] == 0``, ``query_start_loc[-1] == num_tokens``);
* ``seq_start_loc`` is the same running sum over ``seq_lens``;
* ``slot_mapping[t]`` is the cache slot (``block_id * block_size + offset``) that the KV of flat
  token ``t`` is written to: the token at position ``p`` of its sequence lands in block
  ``block_table[p // block_size]`` at offset ``p % block_size``;
* ``block_tables[i]`` is sequence ``i``'s block table, padded with 0 (the null block, which no
  request owns) to the longest table in the batch.

Batch order: "decodes first". A sequence is a decode when it has at most ``decode_threshold``
(1) query tokens; decode kernels then see one contiguous head of the batch. The runner keeps a
persistent order from step to step (new requests join at the back) and restores the split with
the fewest swaps (``reorder_batch_to_split_decodes_and_prefills``).

upstream: vllm/v1/attention/backends/utils.py:45 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "compute_query_start_loc",
    "compute_slot_mapping",
    "make_block_table_tensor",
    "reorder_batch_to_split_decodes_and_prefills",
]

# Upstream's default: a sequence with one scheduled token is a decode.
DECODE_THRESHOLD = 1


@dataclass
class AttentionMetadata:
    """Attention metadata of one step; see the module docstring for the meaning of each field.

    Invariants: the first ``num_decodes`` sequences are decodes and the rest prefills;
    ``num_decode_tokens + num_prefill_tokens == num_actual_tokens == query_start_loc[-1]``;
    ``seq_lens == context_lens + query_lens``; ``len(slot_mapping) == num_actual_tokens``.
    Integer tensors are int32 except ``slot_mapping`` and ``positions`` (int64: slot ids of a
    large cache overflow int32).

    upstream: vllm/v1/attention/backends/utils.py:45 @ v0.11.0
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


def reorder_batch_to_split_decodes_and_prefills(
    req_ids: list[str],
    num_scheduled_tokens: Mapping[str, int],
    decode_threshold: int = DECODE_THRESHOLD,
) -> bool:
    """Reorder ``req_ids`` in place so that every decode precedes every prefill; True if changed.

    Uses the fewest swaps: walk the decodes from the back and the prefills from the front, and
    swap a decode that sits past the decode region with the front-most prefill. Decodes tend to
    stay put step after step, and new requests arrive at the back, so few swaps are needed. The
    relative order inside each group is *not* preserved (a swap moves a prefill backwards).

    upstream: vllm/v1/attention/backends/utils.py:774 @ v0.11.0
    """
    decodes = [i for i, r in enumerate(req_ids) if num_scheduled_tokens[r] <= decode_threshold]
    prefills = [i for i, r in enumerate(req_ids) if num_scheduled_tokens[r] > decode_threshold]
    num_decodes = len(decodes)
    modified = False
    for i in range(1, min(num_decodes, len(prefills)) + 1):
        decode_idx = decodes[num_decodes - i]
        if decode_idx < num_decodes:
            break  # every remaining decode is already inside the decode region
        prefill_idx = prefills[i - 1]
        req_ids[prefill_idx], req_ids[decode_idx] = req_ids[decode_idx], req_ids[prefill_idx]
        modified = True
    return modified


def compute_query_start_loc(query_lens: torch.Tensor) -> torch.Tensor:
    """Exclusive running sum with the total appended: ``[0, q0, q0 + q1, ...]`` (int32).

    upstream: vllm/v1/worker/gpu_model_runner.py:923 @ v0.11.0
    """
    out = torch.zeros(query_lens.numel() + 1, dtype=torch.int32, device=query_lens.device)
    torch.cumsum(query_lens, dim=0, out=out[1:])
    return out


def make_block_table_tensor(
    block_tables: Sequence[Sequence[int]], num_cols: int | None = None
) -> torch.Tensor:
    """Stack block tables into an int32 ``[num_seqs, num_cols]`` tensor, padded with 0.

    ``num_cols`` defaults to the longest table; a table longer than ``num_cols`` is an error.

    upstream: vllm/v1/worker/block_table.py:16 @ v0.11.0
    """
    longest = max((len(t) for t in block_tables), default=0)
    cols = longest if num_cols is None else num_cols
    if cols < longest:
        raise ValueError(f"a block table has {longest} blocks, more than num_cols={cols}")
    # One tensor from padded Python rows (one call, not one per row: this runs every step).
    rows = [list(table) + [0] * (cols - len(table)) for table in block_tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(block_tables), cols)


def compute_slot_mapping(
    block_tables: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of each flat token: ``block_tables[req, pos // bs] * bs + pos % bs`` (int64).

    ``req_indices[t]`` is the batch row of flat token ``t`` and ``positions[t]`` its position in
    its sequence.

    upstream: vllm/v1/worker/block_table.py:76 @ v0.11.0
    """
    block_numbers = block_tables[req_indices.long(), positions.long() // block_size].long()
    return block_numbers * block_size + positions.long() % block_size


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

    ``num_scheduled_tokens`` is the step's ``SchedulerOutput.num_scheduled_tokens``;
    ``num_computed_tokens[r]`` is request ``r``'s count *before* the step (the context);
    ``block_tables[r]`` its whole block table, which must cover every position of the step.
    Raises ``ValueError`` for an empty batch, a request listed twice or missing from a mapping,
    a batch that is not decodes-first, or a block table too short for the step's positions.

    upstream: vllm/v1/worker/gpu_model_runner.py:923 @ v0.11.0
    """
    req_ids = list(req_ids)
    if not req_ids:
        raise ValueError("build_attention_metadata: the batch is empty; schedule something first")
    if len(set(req_ids)) != len(req_ids):
        raise ValueError(f"build_attention_metadata: a request is listed twice in {req_ids}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"build_attention_metadata: block_size must be >= 1, got {block_size!r}")
    for name, mapping in (
        ("num_scheduled_tokens", num_scheduled_tokens),
        ("num_computed_tokens", num_computed_tokens),
        ("block_tables", block_tables),
    ):
        missing = [r for r in req_ids if r not in mapping]
        if missing:
            raise ValueError(f"build_attention_metadata: {name} has no entry for {missing}")

    query_list = [int(num_scheduled_tokens[r]) for r in req_ids]
    context_list = [int(num_computed_tokens[r]) for r in req_ids]
    if min(query_list) < 1 or min(context_list) < 0:
        raise ValueError("build_attention_metadata: query lengths must be >= 1, contexts >= 0")
    is_decode = [q <= decode_threshold for q in query_list]
    num_decodes = sum(is_decode)
    if any(is_decode[num_decodes:]):
        raise ValueError(
            "build_attention_metadata: decodes must come first; call "
            "reorder_batch_to_split_decodes_and_prefills on the batch order before building"
        )
    for r, ctx, q in zip(req_ids, context_list, query_list):
        if len(block_tables[r]) * block_size < ctx + q:
            raise ValueError(
                f"build_attention_metadata: request {r!r} needs {ctx + q} slots but its block "
                f"table holds {len(block_tables[r])} block(s) of {block_size}"
            )

    # The lengths as Python ints too: the scalars below come from them, not from tensor ops
    # (each of which costs more than its arithmetic at a decode step's size).
    seq_list = [c + q for c, q in zip(context_list, query_list)]
    query_lens = torch.tensor(query_list, dtype=torch.int32)
    context_lens = torch.tensor(context_list, dtype=torch.int32)
    seq_lens = torch.tensor(seq_list, dtype=torch.int32)
    query_start_loc = compute_query_start_loc(query_lens)
    seq_start_loc = compute_query_start_loc(seq_lens)
    num_tokens = sum(query_list)

    # Flat token t belongs to row req_indices[t], at the position after the row's context and
    # its earlier tokens of this step.
    req_indices = torch.tensor([i for i, q in enumerate(query_list) for _ in range(q)],
                               dtype=torch.int64)
    positions = torch.tensor([c + j for c, q in zip(context_list, query_list) for j in range(q)],
                             dtype=torch.int64)
    table = make_block_table_tensor([block_tables[r] for r in req_ids])
    slot_mapping = compute_slot_mapping(table, req_indices, positions, block_size)

    return AttentionMetadata(
        req_ids=req_ids,
        num_reqs=len(req_ids),
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_prefills=len(req_ids) - num_decodes,
        num_decode_tokens=sum(query_list[:num_decodes]),
        num_prefill_tokens=sum(query_list[num_decodes:]),
        query_start_loc=query_start_loc,
        seq_start_loc=seq_start_loc,
        query_lens=query_lens,
        seq_lens=seq_lens,
        context_lens=context_lens,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=table,
        max_query_len=max(query_list),
        max_seq_len=max(seq_list),
        max_prefill_seq_len=max(seq_list[num_decodes:], default=0),
        max_decode_seq_len=max(seq_list[:num_decodes], default=0),
    )
