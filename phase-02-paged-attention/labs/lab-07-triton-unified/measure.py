"""Predict, then measure: what the kernel's grid costs where every program runs one after
another (Triton's interpreter on a CPU), as the decode context grows.

`python -m course measure 02-07 --plot grid.png` runs this on your starter.py and on the
reference. Answer the README's "Predict, then measure" questions before you look.

One decode step of 2 sequences of n tokens, float32, head size 16, blocks of 16 tokens scattered
over the cache, in three launches of the same kernel: 8 query heads on 1 KV head (one program
per sequence reads each K/V tile once for all 8 heads), 8 query heads on 8 KV heads (8 programs
per sequence, each reading its own tiles), and the first again split in 4 segments (4 times the
programs, plus the reduce). Only the kernel call is timed (best of 3).
"""

from __future__ import annotations

import torch

from course.student.measure import best_of

TITLE = "One decode step in Triton's interpreter: GQA packing and split KV"
X_LABEL = "context length (tokens per sequence)"
Y_LABEL = "milliseconds per decode step (best of 3)"
LOG_X = LOG_Y = True

NUM_SEQS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 8, 16, 16
REPEATS = 3


def sizes(quick: bool) -> list[int]:
    return [64, 256] if quick else [32, 64, 128, 256, 512]


def _case(n: int, num_kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-n // BLOCK_SIZE)
    num_blocks = NUM_SEQS * blocks + 1
    x = 4  # float32
    key_cache = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE // x, BLOCK_SIZE, x,
                            generator=gen)
    value_cache = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: NUM_SEQS * blocks].view(NUM_SEQS, blocks)
    query = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_SIZE, generator=gen)
    starts = torch.arange(NUM_SEQS + 1, dtype=torch.int32)
    seq_lens = torch.full((NUM_SEQS,), n, dtype=torch.int32)
    return query, key_cache, value_cache, starts, seq_lens, table.to(torch.int32)


def run(impl, n: int) -> dict:
    """Milliseconds per call of your kernel (or the reference's) in the three launches;
    "-": not written yet."""
    results: dict[str, float | None] = {}
    for name, kv_heads, segments in (("8 heads on 1 KV head", 1, 1),
                                     ("8 heads on 8 KV heads", 8, 1),
                                     ("8 on 1, split in 4", 1, 4)):
        args = _case(n, kv_heads)
        try:
            results[name] = best_of(lambda args=args, segments=segments: impl.unified_attention(
                *args, HEAD_SIZE ** -0.5, num_segments=segments), REPEATS) * 1e3
        except NotImplementedError:
            results[name] = None
    return results
