"""Synthetic request traces shaped like ShareGPT, generated here, seeded (nothing is downloaded).

``vllm bench serve`` replays real conversations (the ShareGPT dump) by default. We cannot ship
or download it, and only its *lengths* matter for memory and latency, so a request here is a
prompt of random token ids and an output length, both drawn from log-normal distributions (the
long right tail of chat traffic: most requests short, a few very long).

Where the shape comes from: the PagedAttention paper (Kwon et al., SOSP 2023), Figure 11a,
reports ShareGPT's mean input length as about 161 tokens and its mean output as about 338
(outputs longer than inputs, both spread over two orders of magnitude). A log-normal with
median ``m`` and log-sigma ``s`` has mean ``m * exp(s^2 / 2)``; the medians and sigmas below
give those means (98 * e^0.5 = 161.6, 225 * e^0.405 = 337). Lab 02-02's ``chat`` trace uses
the same distributions. ``scale`` shrinks every length by one factor, so that the tiny CPU
model serves the same *shape* in seconds (with ``max_model_len`` shrunk by the same factor, the
ratio of the maximum length to the mean length, which sets what reserving the maximum wastes,
is the paper's).

upstream: none (course-only; upstream's counterpart reads ShareGPT's JSON in
vllm/benchmarks/datasets.py, class ShareGPTDataset)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["SHAREGPT_INPUT", "SHAREGPT_OUTPUT", "SampleRequest", "sharegpt_like_requests"]

# (median, log-sigma) in tokens, at full scale; see the module docstring for their source.
SHAREGPT_INPUT = (98.0, 1.0)
SHAREGPT_OUTPUT = (225.0, 0.9)


@dataclass(frozen=True)
class SampleRequest:
    """One request of a trace: its prompt (token ids) and how many tokens it must generate.

    upstream: none (upstream's SampleRequest also carries the prompt text; ours is token ids)
    """

    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def sharegpt_like_requests(
    num_requests: int,
    *,
    seed: int = 0,
    scale: float = 0.25,
    max_model_len: int = 512,
    token_ids: range = range(32, 127),
) -> list[SampleRequest]:
    """``num_requests`` requests with ShareGPT-shaped lengths times ``scale``; the same
    arguments always give the same requests.

    Every prompt has at least 1 token and every output at least 1; prompt plus output never
    exceeds ``max_model_len`` (a long pair keeps its prompt, at most half the model length, and
    has its output cut). Prompt tokens are drawn uniformly from ``token_ids`` (printable bytes
    for the byte tokenizer). ``ValueError`` for ``num_requests < 1``, ``scale <= 0`` or
    ``max_model_len < 2``.

    upstream: none (see the module docstring)
    """
    if num_requests < 1 or scale <= 0 or max_model_len < 2:
        raise ValueError(
            f"sharegpt_like_requests: need num_requests >= 1, scale > 0, max_model_len >= 2; "
            f"got {num_requests}, {scale}, {max_model_len}"
        )
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = _lognormal(rng, SHAREGPT_INPUT[0] * scale, SHAREGPT_INPUT[1], 1,
                                max_model_len // 2)
        output_len = _lognormal(rng, SHAREGPT_OUTPUT[0] * scale, SHAREGPT_OUTPUT[1], 1,
                                max_model_len - prompt_len)
        prompt = tuple(rng.choices(token_ids, k=prompt_len))
        out.append(SampleRequest(prompt, output_len))
    return out
