"""Predict, then measure: the cost of attention as the sequence grows, prefill against decode.

`python -m course measure 01-01 --plot prefill.png` times your `ref_attention` on a prefill of n
tokens (q_len = kv_len = n), beside the reference, and beside one decode step at the same length
(q_len = 1, kv_len = n: the last token of the sequence attending to all n). Answer the README's
"Predict, then measure" questions before you look.

On a loaded machine one timing says little. The sweep runs ROUNDS times, interleaved, each point
keeps its fastest run, and torch computes on one thread (several threads fighting other
processes for 2 cores make the times jump); the command then prints each curve's fitted log-log
slope (the k of a cost growing like n^k), the decode step's share of the prefill, and the
reference's peak tensor memory at the largest n (the scores dominate it).
"""

from __future__ import annotations

import torch

from course.student.measure import best_of, peak_tensor_bytes

TITLE = "A prefill of n tokens against one decode step (8 heads of 64)"
X_LABEL = "prompt tokens n"
Y_LABEL = "ms per call (fastest of 9: 3 runs x 3 rounds)"
LOG_X = LOG_Y = True
ROUNDS = 3
NUM_HEADS, HEAD_SIZE = 8, 64
torch.set_num_threads(1)  # the measurement's own process: one thread times steadily


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


def summary(values: dict[str, dict[int, float | None]]) -> list[str]:
    """The numbers the README's questions ask for, at the largest n measured."""
    from mini_vllm.attention.reference import ref_attention

    ref = values["reference"]
    decode = values["one decode step at n (reference)"]
    n = max(ref)
    lines = []
    if ref[n] and decode[n]:
        lines.append(f"At n = {n:,}: one decode step takes {decode[n] / ref[n]:.1%} of the "
                     f"prefill's time (1/{ref[n] / decode[n]:.0f}).")
    q, k, v = _inputs(n)
    peak = peak_tensor_bytes(lambda: ref_attention(q, k, v), existing=(q, k, v))
    scores = NUM_HEADS * n * n * 4
    lines.append(f"The reference's peak tensor memory at n = {n:,}: {peak / 2**20:,.0f} MiB; the "
                 f"scores alone, [{NUM_HEADS}, {n:,}, {n:,}] in float32, are "
                 f"{scores / 2**20:,.0f} MiB.")
    return lines
