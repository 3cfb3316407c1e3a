"""Predict, then measure: how much prefill a shared system prompt saves, with your manager.

`python -m course measure 02-03 --plot prefix_hits.png` runs this on your starter.py (your
hasher and your KVCacheManager) and on the reference. Sixteen requests arrive one after the
other; each is the same system prompt followed by its own 32-token question, is prefilled,
decodes 8 tokens, and finishes a few requests later (at most 4 run at once). The plot shows the
share of prompt tokens the prefix cache served (the prefill it saved), beside what caching
every shared token would save if the cache were not made of whole blocks. Answer the README's
"Predict, then measure" questions before you look.
"""

from __future__ import annotations

import random

TITLE = "Prefix caching with a shared system prompt (16 requests, block size 16)"
X_LABEL = "tokens in the shared system prompt"
Y_LABEL = "% of prompt tokens served from the cache"
NUM_REQUESTS = 16
QUESTION_TOKENS = 32
DECODE_TOKENS = 8
MAX_RUNNING = 4
BLOCK_SIZE = 16


def sizes(quick: bool) -> list[int]:
    return [0, 10, 40, 100, 400] if quick else [0, 10, 16, 40, 64, 100, 200, 400, 1000]


def _prompts(system_len: int) -> list[list[int]]:
    rng = random.Random(system_len)
    system = [rng.randrange(1000, 30000) for _ in range(system_len)]
    return [
        system + [rng.randrange(30000, 60000) for _ in range(QUESTION_TOKENS)]
        for _ in range(NUM_REQUESTS)
    ]


def run(impl, system_len: int) -> float:
    """Percent of all prompt tokens that get_computed_blocks served from the cache, over the
    sixteen requests (each request's lookup happens when it arrives)."""
    prompts = _prompts(system_len)
    per_request = -(-(system_len + QUESTION_TOKENS + DECODE_TOKENS) // BLOCK_SIZE)
    manager = impl.KVCacheManager(
        num_blocks=NUM_REQUESTS * per_request + 1,
        block_size=BLOCK_SIZE,
        max_model_len=system_len + QUESTION_TOKENS + DECODE_TOKENS,
    )
    hasher = impl.get_request_block_hasher(BLOCK_SIZE, impl.sha256)
    running, hit_tokens, prompt_tokens = [], 0, 0
    for i, prompt in enumerate(prompts):
        req = impl.Request(f"req-{i}", prompt, impl.SamplingParams(max_tokens=DECODE_TOKENS), None,
                           block_hasher=hasher)
        hit, num_hit = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is None:
            raise RuntimeError("the pool is sized for every request: allocate_slots refused")
        req.num_computed_tokens = req.num_tokens
        hit_tokens += num_hit
        prompt_tokens += len(prompt)
        for t in range(DECODE_TOKENS):
            req.append_output_token_ids(7 + t)
            manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        running.append(req)
        if len(running) > MAX_RUNNING:
            manager.free(running.pop(0))
    for req in running:
        manager.free(req)
    return 100.0 * hit_tokens / prompt_tokens


def every_shared_token(system_len: int) -> float:
    """What caching every token of the system prompt would give: all requests but the first
    reuse all of it (no rounding down to whole blocks)."""
    total = NUM_REQUESTS * (system_len + QUESTION_TOKENS)
    return 100.0 * (NUM_REQUESTS - 1) * system_len / total


BASELINES = {"every shared token (no whole blocks)": every_shared_token}
