"""Predict, then measure: the cost of attention as the sequence grows, prefill against decode.

`python -m course measure 01-01 --plot prefill.png` times your `ref_attention` on a prefill of n
tokens (q_len = kv_len = n), beside the reference, and beside one decode step at the same length
(q_len = 1, kv_len = n: the last token of the sequence attending to all n). Answer the README's
"Predict, then measure" questions before you look.
"""

from __future__ import annotations

import torch

from course.student.measure import best_of

TITLE = "A prefill of n tokens against one decode step (8 heads of 64)"
X_LABEL = "prompt tokens n"
Y_LABEL = "milliseconds per call (best of 3)"
LOG_X = LOG_Y = True
NUM_HEADS, HEAD_SIZE = 8, 64


def sizes(quick: bool) -> list[int]:
    return [128, 512, 1024] if quick else [128, 256, 512, 1024, 2048]


def _inputs(n: int):
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=g) for _ in range(3))


def run(impl, n: int) -> float:
    """Your ref_attention (or the reference's) on one prefill of n tokens, in milliseconds."""
    q, k, v = _inputs(n)
    return best_of(lambda: impl.ref_attention(q, k, v), repeats=3) * 1e3


def decode_step(n: int) -> float:
    """The reference's ref_attention for ONE query (the newest token) over the same n keys."""
    from mini_vllm.attention.reference import ref_attention

    q, k, v = _inputs(n)
    return best_of(lambda: ref_attention(q[-1:], k, v), repeats=3) * 1e3


BASELINES = {"one decode step at n (reference)": decode_step}
