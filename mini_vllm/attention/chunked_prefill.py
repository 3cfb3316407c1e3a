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

The implementation is plain tensor code with no loop over tokens. Sequences with the same shape
(query length and context length) are done together: gather their keys and values from their
block tables, lay their queries out as ``[group, query_len, ...]``, mask by position, softmax.
Grouping by shape rather than padding every sequence to the longest chunk and the longest
context keeps a mixed step with one long chunk and a few short ones from costing as much as if
every sequence were long (the lab's exercise pads; the work is the same when shapes agree).
Scores and softmax run in float32 (float64 for float64 inputs).

upstream: vllm/attention/ops/chunked_prefill_paged_decode.py:227 @ v0.11.0
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

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

    group = num_heads // num_kv_heads
    dev = query.device
    q_lens = metadata.query_lens.tolist()
    ctx_lens = metadata.context_lens.tolist()
    starts = metadata.query_start_loc.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for s, shape in enumerate(zip(q_lens, ctx_lens)):
        groups.setdefault(shape, []).append(s)

    block_size = key_cache.shape[3]
    out = torch.empty(num_tokens, num_heads, head_size, dtype=query.dtype, device=query.device)
    for (q_len, ctx), seqs in groups.items():
        seq_len = ctx + q_len
        n_blk = -(-seq_len // block_size)
        rows = torch.tensor(seqs, dtype=torch.long)
        keys, values = gather_paged_kv(key_cache, value_cache,
                                       metadata.block_tables[rows, :n_blk])
        keys = keys[:, :seq_len].to(acc).transpose(1, 2)  # [g, KVH, seq_len, D]
        values = values[:, :seq_len].to(acc).transpose(1, 2)
        flat = torch.cat([torch.arange(starts[s], starts[s] + q_len, device=dev) for s in seqs])
        q = query[flat].to(acc).view(len(seqs), q_len, num_heads, head_size).transpose(1, 2)
        # Query row i is at position ctx + i; key j is visible iff j <= it.
        q_pos = ctx + torch.arange(q_len, device=dev)
        visible = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                           enable_gqa=group > 1)  # [g, H, q_len, D]
        out[flat] = o.transpose(1, 2).reshape(-1, num_heads, head_size).to(query.dtype)
    return out
