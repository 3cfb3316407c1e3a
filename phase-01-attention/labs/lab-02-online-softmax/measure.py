"""Predict, then measure: the memory of attention block by block, against all scores at once.

`python -m course measure 01-02 --plot memory.png` runs your `blockwise_attention` on a prefill
of n tokens (q_len = kv_len = n, keys cut into blocks of 64) and counts the most bytes of
tensors it held at once (every tensor created during the call, until it is freed; the inputs are
not counted), beside the reference and beside lab 01's `ref_attention`, which holds every score
at once. Answer the README's "Predict, then measure" questions before you look.
"""

from __future__ import annotations

import torch

from course.student.measure import peak_tensor_bytes
from mini_vllm.attention.reference import ref_attention

TITLE = "Peak tensor memory, prefill of n tokens (2 heads of 16, float32)"
X_LABEL = "prompt tokens n"
Y_LABEL = "MiB of tensors held at once"
LOG_X = LOG_Y = True
NUM_HEADS, HEAD_SIZE, BLOCK = 2, 16, 64


def sizes(quick: bool) -> list[int]:
    return [256, 512, 1024] if quick else [256, 512, 1024, 2048, 4096]


def _inputs(n: int):
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=g) for _ in range(3))


def run(impl, n: int) -> float:
    """Your blockwise_attention (or the reference's), blocks of 64 keys: peak MiB."""
    q, k, v = _inputs(n)
    cuts = range(BLOCK, n, BLOCK)
    return peak_tensor_bytes(lambda: impl.blockwise_attention(q, k, v, cuts), (q, k, v)) / 2**20


def all_scores_at_once(n: int) -> float:
    """Lab 01's ref_attention on the same prefill: the [heads, n, n] scores and their softmax."""
    q, k, v = _inputs(n)
    return peak_tensor_bytes(lambda: ref_attention(q, k, v), (q, k, v)) / 2**20


BASELINES = {"ref_attention (lab 01, all scores)": all_scores_at_once}
