"""Attention for a mixed batch over the paged cache: many query tokens per sequence.

Decode kernels take one query per sequence. Chunked prefill needs more: a chunk of ``q`` new
tokens of a sequence whose first ``c`` tokens already sit in the cache attends to all ``c + q``
keys, and query ``i`` of the chunk sits at absolute position ``c + i``, so the causal mask is the
usual lower triangle *shifted right by the context*::

    keys ->   0 ... c-1 | c  c+1 ... c+q-1
    query 0   1 ...  1  | 1   0  ...   0
    query 1   1 ...  1  | 1   1  ...   0
    ...
    query q-1 1 ...  1  | 1   1  ...   1

The new tokens' KV must already be written to the cache (``reshape_and_cache`` with the step's
``slot_mapping``) before this runs: the chunk reads its own keys from the cache like any other.

The implementation is plain tensor code with no loop over sequences or tokens: gather each
sequence's keys and values from its block table into a padded ``[num_seqs, max_seq_len, ...]``
tensor, lay the queries out as ``[num_seqs, max_query_len, ...]``, and mask by position.
Scores and softmax run in float32 (float64 for float64 inputs).

upstream: vllm/attention/ops/chunked_prefill_paged_decode.py:227 @ v0.11.0
"""

from __future__ import annotations

import math

import torch

from mini_vllm.attention.metadata import AttentionMetadata

__all__ = ["chunked_prefill_attention", "gather_paged_kv"]


def gather_paged_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values, token-major: two ``[num_seqs, max_blocks * bs, KVH, D]``.

    ``key_cache [num_blocks, KVH, D // x, bs, x]`` and ``value_cache [num_blocks, KVH, D, bs]``;
    position ``p`` of sequence ``s`` comes from block ``block_tables[s, p // bs]``. Positions past
    a sequence's length read padding (the null block) and must be masked by the caller.

    upstream: none (the Triton kernel reads blocks in place; a tensor version gathers them)
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

    ``query [num_tokens, num_heads, head_size]`` is the flat batch (rows of sequence ``s`` are
    ``query_start_loc[s]:query_start_loc[s + 1]``). Query ``i`` of sequence ``s`` sees the keys
    at positions ``0 .. context_lens[s] + i``. Returns ``[num_tokens, num_heads, head_size]`` in
    ``query.dtype``. Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. Raises ``ValueError`` on shapes that do not agree.

    upstream: vllm/attention/ops/chunked_prefill_paged_decode.py:227 @ v0.11.0
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    num_tokens, num_heads, head_size = query.shape
    if num_tokens != metadata.num_actual_tokens:
        raise ValueError(
            f"query has {num_tokens} rows but the metadata describes "
            f"{metadata.num_actual_tokens} tokens"
        )
    if key_cache.dim() != 5 or value_cache.dim() != 4 or value_cache.shape[2] != head_size:
        raise ValueError(
            "key_cache must be [blocks, KVH, D // x, bs, x] and value_cache [blocks, KVH, D, bs] "
            f"with D={head_size}; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32

    keys, values = gather_paged_kv(key_cache, value_cache, metadata.block_tables)
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2).to(acc)  # [S, K, H, D]
    values = values.repeat_interleave(group, dim=2).to(acc)

    # Scatter the flat queries into [S, Qmax, H, D]; padded query rows stay zero.
    num_seqs = metadata.num_reqs
    q_lens = metadata.query_lens.long()
    starts = metadata.query_start_loc[:-1].long()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    row_in_seq = torch.arange(num_tokens) - starts[seq_of_token]
    q_pad = query.new_zeros((num_seqs, metadata.max_query_len, num_heads, head_size), dtype=acc)
    q_pad[seq_of_token, row_in_seq] = query.to(acc)

    scores = torch.einsum("sqhd,skhd->shqk", q_pad, keys) * scale
    # Query row i of sequence s is at position context_lens[s] + i; key j is visible iff j <= it.
    q_pos = metadata.context_lens.long()[:, None] + torch.arange(metadata.max_query_len)[None]
    k_pos = torch.arange(keys.shape[1])
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Qmax, K]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out_pad = torch.einsum("shqk,skhd->sqhd", weights, values)
    return out_pad[seq_of_token, row_in_seq].to(query.dtype)
