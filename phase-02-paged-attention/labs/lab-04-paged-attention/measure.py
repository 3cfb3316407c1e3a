"""Predict, then measure: one decode step with your v1 and your v2 as the context grows, and
your v1 again over the same cache laid out token-major in memory (no x split).

`python -m course measure 02-04 --plot decode.png` runs this on your starter.py and on the
reference. Answer the README's "Predict, then measure" questions before you look.

One decode step: 2 sequences of n tokens each, 16 query heads on 4 KV heads of 64, float32,
blocks of 16 tokens scattered over the cache. Only the attention call is timed (best of 5), not
building the cache. The third series runs your v1 unchanged on caches whose *memory* is the
flash layout ([blocks, block_size, kv_heads, head_size], each key contiguous) seen through a
strided view with the x-split shape: same numbers, same code, only the memory order differs.
"""

from __future__ import annotations

import torch

from course.student.measure import best_of

TITLE = "One decode step: v1, v2, and v1 over token-major memory"
X_LABEL = "context length (tokens per sequence)"
Y_LABEL = "milliseconds per decode step (best of 5)"
LOG_X = LOG_Y = True

NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 16, 4, 64, 16
PARTITION_SIZE = 512
REPEATS = 5


def sizes(quick: bool) -> list[int]:
    return [512, 2048, 8192] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]


def _case(n: int, seed: int = 0):
    """Caches holding NUM_SEQS sequences of n tokens in shuffled blocks, one decode query each."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-n // BLOCK_SIZE)
    num_blocks = NUM_SEQS * blocks + 1
    x = 16 // 4
    key_cache = torch.randn(num_blocks, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x, generator=gen)
    value_cache = torch.randn(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: NUM_SEQS * blocks].view(NUM_SEQS, blocks)
    query = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_SIZE, generator=gen)
    seq_lens = torch.full((NUM_SEQS,), n, dtype=torch.int32)
    return query, key_cache, value_cache, table.to(torch.int32), seq_lens


def token_major(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The same caches stored token-major (the flash layout), viewed with the paged shapes:
    element [b, h, c, o, l] of the key view is the key of the token at offset o, element
    c * x + l, exactly as before, but a key's head_size numbers now sit next to each other."""
    keys = key_cache.permute(0, 3, 1, 2, 4).contiguous()  # [blocks, bs, kvh, D // x, x]
    values = value_cache.permute(0, 3, 1, 2).contiguous()  # [blocks, bs, kvh, D]
    return keys.permute(0, 2, 3, 1, 4), values.permute(0, 2, 3, 1)


def _best_ms(fn) -> float:
    return best_of(fn, REPEATS) * 1e3


def run(impl, n: int) -> dict:
    """Milliseconds per call of your paged_attention_v1, your paged_attention_v2 and your v1
    over token-major memory (or the reference's), on one batch. "-": not written yet (or it
    failed on the strided view: v1 must not assume a contiguous cache)."""
    query, key_cache, value_cache, table, seq_lens = _case(n)
    keys_tm, values_tm = token_major(key_cache, value_cache)
    scale = HEAD_SIZE**-0.5
    out = torch.empty_like(query)
    parts = -(-n // PARTITION_SIZE)
    exp_sums = torch.empty(NUM_SEQS, NUM_HEADS, parts)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(NUM_SEQS, NUM_HEADS, parts, HEAD_SIZE)
    rest = (NUM_KV_HEADS, scale, table, seq_lens, BLOCK_SIZE, n)
    results: dict[str, float | None] = {}
    for name, call in (
        ("v1", lambda: impl.paged_attention_v1(out, query, key_cache, value_cache, *rest)),
        (
            "v2",
            lambda: impl.paged_attention_v2(
                out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, *rest
            ),
        ),
        (
            "v1, token-major memory",
            lambda: impl.paged_attention_v1(out, query, keys_tm, values_tm, *rest),
        ),
    ):
        try:
            results[name] = _best_ms(call)
        except (NotImplementedError, RuntimeError):
            results[name] = None
    return results
