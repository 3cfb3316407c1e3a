"""Predict, then measure: the KV memory that fork and copy-on-write save for n parallel samples.

`python -m course measure 02-05 --plot sharing.png` runs parallel sampling with your manager
(your fork, copy-on-write and append_slots) and with the reference: one 100-token prompt is
prefilled once, forked into n samples, and every sample decodes 60 tokens of its own. At every
decode step it counts the blocks really held (a shared block once) against the blocks the same
tables would hold without sharing (the sum of their lengths); the saving is the share of those
block-steps that sharing removes. Beside it: the same n samples as n separate requests that only
share through prefix caching (lab 02-03's manager), as vLLM v1 does. A second table counts the
prompt tokens each approach computes (its KV written by a forward pass rather than shared or
found in the cache). Answer the README's "Predict, then measure" questions before you look.
"""

from __future__ import annotations

TITLE = "KV memory saved by sharing, n samples of one 100-token prompt (60 tokens each)"
X_LABEL = "parallel samples n"
Y_LABEL = "% of KV block-steps saved by sharing"
LOG_X = True
METRICS = {"saved": Y_LABEL, "computed": "prompt tokens computed (all n samples)"}
BLOCK_SIZE = 16
PROMPT = [(7 * i) % 50 + 1 for i in range(100)]
OUTPUT_TOKENS = 60


def sizes(quick: bool) -> list[int]:
    return [1, 2, 4, 16] if quick else [1, 2, 3, 4, 6, 8, 16, 32]


def _num_blocks(n: int) -> int:
    per_sample = -(-(len(PROMPT) + OUTPUT_TOKENS + 1) // BLOCK_SIZE)
    return n * per_sample + 2


def _request(rid: str, tokens: list[int]):
    from mini_vllm.kv_cache_utils import get_request_block_hasher, sha256
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    return Request(rid, list(tokens), SamplingParams(), None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def _decode(manager, seqs: list, step_fn) -> float:
    held = unshared = 0
    usable = manager.block_pool.num_gpu_blocks - 1
    for step in range(OUTPUT_TOKENS):
        for i, req in enumerate(seqs):
            step_fn(req)
            req.num_computed_tokens += 1
            req.append_output_token_ids(1000 + 100 * i + step)
        held += usable - manager.block_pool.get_num_free_blocks()
        unshared += sum(len(manager.req_to_blocks[r.request_id]) for r in seqs)
    return 100.0 * (1 - held / unshared)


def run(impl, n: int) -> float:
    """Your fork and append_slots: n samples forked from one prefilled prompt."""
    manager = impl.KVCacheManager(_num_blocks(n), BLOCK_SIZE, 4096)
    parent = _request("sample-0", PROMPT)
    if manager.allocate_slots(parent, len(PROMPT)) is None:
        raise RuntimeError("the pool is sized for every sample: allocate_slots refused")
    parent.num_computed_tokens = len(PROMPT)
    parent.append_output_token_ids(999)
    seqs = [parent]
    for i in range(1, n):
        child = _request(f"sample-{i}", PROMPT)
        child.append_output_token_ids(999 - i)
        child.num_computed_tokens = len(PROMPT)
        manager.fork(parent, child)
        seqs.append(child)

    def step(req):
        if manager.append_slots(req, 1) is None:
            raise RuntimeError("the pool is sized for every sample: append_slots refused")

    # The parent's prefill computed the whole prompt; a forked child computes none of it.
    return {"saved": _decode(manager, seqs, step), "computed": len(PROMPT)}


def prefix_caching_only(n: int) -> float:
    """The reference's lab 02-03 manager: n separate requests with the same prompt, each looked
    up in the prefix cache when it arrives (what vLLM v1 does for parallel sampling)."""
    from mini_vllm.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(_num_blocks(n), BLOCK_SIZE, 4096)
    seqs = []
    computed = 0
    for i in range(n):
        req = _request(f"sample-{i}", PROMPT)
        hit, num_hit = manager.get_computed_blocks(req)
        manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
        computed += req.num_tokens - num_hit  # the prompt past the cached full blocks
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(999 - i)
        seqs.append(req)
    saved = _decode(manager, seqs, lambda req: manager.allocate_slots(req, 1))
    return {"saved": saved, "computed": computed}


BASELINES = {"prefix caching only (n requests, no fork)": prefix_caching_only}
