"""Predict, then measure: how much of your flat cache holds a token, as the context limit grows.

`python -m course measure 01-03 --plot flat_cache.png` fills your `FlatKVCache` with one
realistic batch (48 requests whose final lengths follow a long-tailed distribution, median
about 380 tokens, the phase notebook's batch) for several values of `max_seq_len`, and reports
`used_bytes() / reserved_bytes()` from your cache, beside the reference and beside what a paged
cache with blocks of 16 tokens (phase 02) would hold; then how many such requests 24 GiB of KV
memory holds for a Llama-8B-like model, flat and paged. Answer the README's "Predict, then
measure" questions before you look.
"""

from __future__ import annotations

import math

import torch

TITLE = "48 requests (median ~380 tokens) in a flat KV cache"
X_LABEL = "max_seq_len (tokens reserved per sequence)"
Y_LABEL = "% of the reserved KV memory that holds a token"
LOG_X = True
NUM_SEQS, BLOCK_SIZE = 48, 16
# A small cache is enough: the fraction does not depend on heads, head size or layers.
NUM_KV_HEADS, HEAD_SIZE, DTYPE = 1, 8, torch.float16


def sizes(quick: bool) -> list[int]:
    return [1024, 4096, 16384] if quick else [1024, 2048, 4096, 8192, 16384]


def final_lengths(max_seq_len: int) -> list[int]:
    """Prompt plus output of each request, log-normal like chat traffic (the notebook's
    batch), cut at max_seq_len (a request cannot outgrow its reservation)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.exp(torch.randn(NUM_SEQS, generator=g) * 0.8 + 5.5)  # median ~250 tokens
    output = torch.exp(torch.randn(NUM_SEQS, generator=g) * 0.9 + 5.0)  # median ~150 tokens
    return (prompt + output).round().clamp(1, max_seq_len).long().tolist()


def run(impl, max_seq_len: int) -> float:
    """Your FlatKVCache holding the batch: 100 * used_bytes() / reserved_bytes()."""
    cache = impl.FlatKVCache(NUM_SEQS, NUM_KV_HEADS, max_seq_len, HEAD_SIZE, dtype=DTYPE)
    for s, n in enumerate(final_lengths(max_seq_len)):
        kv = torch.ones(n, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE)
        cache.append(s, kv, kv)
    return 100.0 * cache.used_bytes() / cache.reserved_bytes()


def paged(max_seq_len: int) -> float:
    """The same batch in blocks of 16 tokens handed out as sequences grow (phase 02): only
    each sequence's last, partly filled block holds empty slots."""
    lens = final_lengths(max_seq_len)
    held = sum(math.ceil(n / BLOCK_SIZE) * BLOCK_SIZE for n in lens)
    return 100.0 * sum(lens) / held


BASELINES = {"paged, blocks of 16 (phase 02)": paged}


KV_PER_TOKEN = 128 * 1024  # Llama-8B-like: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
KV_MEMORY = 24 * 2**30


def summary(values: dict[str, dict[int, float | None]]) -> list[str]:
    """Requests of this batch that fit in 24 GiB, flat (each reserves max_seq_len tokens) and
    paged (each holds its tokens rounded up to blocks of 16): the README's question 2."""
    lines = ["Requests that fit in 24 GiB of KV memory (128 KiB per token):"]
    for max_seq_len in sorted(values["reference"]):
        flat = KV_MEMORY // (max_seq_len * KV_PER_TOKEN)
        lens = final_lengths(max_seq_len)
        held = sum(math.ceil(n / BLOCK_SIZE) * BLOCK_SIZE for n in lens) / len(lens)
        lines.append(f"  max_seq_len {max_seq_len:,}: flat {flat:,}; paged, blocks of "
                     f"{BLOCK_SIZE}, about {KV_MEMORY / (held * KV_PER_TOKEN):,.0f}")
    return lines
