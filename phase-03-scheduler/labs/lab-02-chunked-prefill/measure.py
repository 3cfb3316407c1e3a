"""Predict, then measure: what a mixed prefill/decode batch costs your chunked_prefill_attention.

`python -m course measure 03-02 --plot mixed.png` runs this on your starter.py and on the
reference. Answer the README's "Predict, then measure" questions before you look.

One step of a server: 16 decodes (one new token each, 512 tokens of context each) and one
prefill chunk of n tokens (a new prompt, no context), 8 query heads on 2 KV heads of 64, float32,
blocks of 16. Timed three ways, best of 5, each with its own metadata: the mixed batch in one
call; the same work as two calls (the 16 decodes, then the chunk); and the 16 decodes alone.
"""

from __future__ import annotations

import torch

from course.student.measure import best_of
from mini_vllm.attention.metadata import build_attention_metadata

TITLE = "16 decodes and one prefill chunk in one step"
X_LABEL = "prefill chunk length (tokens)"
Y_LABEL = "milliseconds per step (best of 5)"
LOG_X = LOG_Y = True

NUM_DECODES, CONTEXT = 16, 512
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16
REPEATS = 5


def sizes(quick: bool) -> list[int]:
    return [16, 128, 512] if quick else [8, 32, 128, 256, 512, 1024]


def _step(chunk: int, seed: int = 0):
    """Caches holding every request's KV, and the requests: name -> (context, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    requests = {f"d{i}": (CONTEXT, 1) for i in range(NUM_DECODES)}
    requests["prefill"] = (0, chunk)
    tables, next_block = {}, 1  # block 0 is the null block
    for name, (ctx, q) in requests.items():
        n = -(-(ctx + q) // BLOCK_SIZE)
        tables[name] = list(range(next_block, next_block + n))
        next_block += n
    x = 4
    key_cache = torch.randn(next_block, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x, generator=gen)
    value_cache = torch.randn(next_block, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, generator=gen)
    return requests, tables, key_cache, value_cache, gen


def _batch(names, requests, tables, gen):
    md = build_attention_metadata(
        names,
        {r: requests[r][1] for r in names},
        {r: requests[r][0] for r in names},
        tables,
        BLOCK_SIZE,
    )
    query = torch.randn(md.num_actual_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)
    return query, md


def _best_ms(fn) -> float:
    return best_of(fn, REPEATS) * 1e3


def run(impl, chunk: int) -> dict:
    """Milliseconds for your chunked_prefill_attention (or the reference's): the mixed batch in
    one call, the same two groups in two calls, and the decodes alone."""
    requests, tables, kc, vc, gen = _step(chunk)
    decodes = [r for r in requests if r != "prefill"]
    mixed = _batch(decodes + ["prefill"], requests, tables, gen)
    only_decodes = _batch(decodes, requests, tables, gen)
    only_chunk = _batch(["prefill"], requests, tables, gen)

    def attend(batch):
        query, md = batch
        return impl.chunked_prefill_attention(query, kc, vc, md)

    results: dict[str, float | None] = {}
    for name, fn in (
        ("mixed, 1 call", lambda: attend(mixed)),
        ("split, 2 calls", lambda: (attend(only_decodes), attend(only_chunk))),
        ("decodes only", lambda: attend(only_decodes)),
    ):
        try:
            results[name] = _best_ms(fn)
        except NotImplementedError:
            results[name] = None
    return results
