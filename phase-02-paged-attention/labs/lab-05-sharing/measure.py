"""Predict, then measure: the KV memory that fork and copy-on-write save for n parallel samples.

`python -m course measure 02-05 --plot sharing.png` runs parallel sampling with your manager
(your fork, copy-on-write and append_slots) and with the reference: one 100-token prompt is
prefilled once, forked into n samples, and every sample decodes 60 tokens of its own. At every
decode step it counts the blocks really held (a shared block once) against the blocks the same
tables would hold without sharing (the sum of their lengths); the saving is the share of those
block-steps that sharing removes. Beside it: the same n samples as n separate requests that only
share through prefix caching (lab 02-03's manager), as vLLM v1 does. A second table counts the
prompt tokens each approach computes (its KV written by a forward pass rather than shared or
found in the cache).

A third table does the same on real beams: the engine's beam search (the shipped model, width
k = n, 60 steps) grows a beam tree once per width; your manager replays it with fork and
copy-on-write (``replay_fork_cow`` of ``benchmarks/sharing.py``: a beam continues as its first
child and is forked for each further one, a beam with no child is freed), and the prefix-caching
line is the engine's own count of the blocks held inside each step. Answer the README's
"Predict, then measure" questions before you look.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

TITLE = ("KV memory saved by sharing: n samples of one 100-token prompt (60 tokens each); "
         "real beams of width k = n (60 steps)")
X_LABEL = "parallel samples n / beam width k"
Y_LABEL = "% of KV block-steps saved by sharing"
LOG_X = True
METRICS = {"saved": Y_LABEL, "computed": "prompt tokens computed (all n samples)",
           "beams": "% of KV block-steps saved on real beams (shipped model, width k)"}
BLOCK_SIZE = 16
PROMPT = [(7 * i) % 50 + 1 for i in range(100)]
OUTPUT_TOKENS = 60
BEAM_PROMPT = "Ham.\nTo be, or not to be"
REPO_ROOT = Path(__file__).resolve().parents[3]


def sizes(quick: bool) -> list[int]:
    return [1, 2, 4, 16] if quick else [1, 2, 3, 4, 6, 8, 16, 32]


def _num_blocks(n: int) -> int:
    per_sample = -(-(len(PROMPT) + OUTPUT_TOKENS + 1) // BLOCK_SIZE)
    return n * per_sample + 2


def _request(rid: str, tokens: list[int]):
    from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
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


def _bench():
    from course.labs.loader import load_script

    return load_script("sharing_benchmark", REPO_ROOT / "benchmarks" / "sharing.py")


@cache
def _real_beams(k: int) -> tuple[list[int], list, int, int]:
    """The reference engine's beam search of width ``k``: the prompt's ids, the beam history,
    the blocks held without sharing and the engine's own in-step count (prefix caching), both
    summed over the steps. Made once per width: every series replays the same tree."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import BeamSearchParams

    bench = _bench()
    llm = LLM(block_size=BLOCK_SIZE, num_gpu_blocks=64 * k + 16)
    [out] = llm.beam_search([BEAM_PROMPT], BeamSearchParams(beam_width=k,
                                                            max_tokens=OUTPUT_TOKENS))
    best = out.sequences[0]
    ids = best.tokens[:len(best.tokens) - len(best.logprobs)]
    steps = bench.search_steps(ids, out.beam_history)
    unshared = sum(bench.unshared_blocks(b, BLOCK_SIZE) for b in steps)
    return ids, out.beam_history, unshared, llm.last_stats.num_kv_block_steps


def _beams_saved(impl, k: int) -> float:
    """Your manager (fork, copy-on-write, free) replaying the real beam tree of width k."""
    ids, history, _, _ = _real_beams(k)
    per_beam = -(-(len(ids) + OUTPUT_TOKENS + 1) // BLOCK_SIZE) + 1
    manager = impl.KVCacheManager(2 * k * per_beam + 2, BLOCK_SIZE, 4096)
    replay = _bench().replay_fork_cow(manager, ids, history)
    return 100.0 * (1 - replay.held / replay.unshared)


def run(impl, n: int) -> float:
    """Your fork and append_slots: n samples forked from one prefilled prompt, and the real
    beam tree of width n replayed."""
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
    return {"saved": _decode(manager, seqs, step), "computed": len(PROMPT),
            "beams": _beams_saved(impl, n)}


def prefix_caching_only(n: int) -> float:
    """The reference's lab 02-03 manager: n separate requests with the same prompt, each looked
    up in the prefix cache when it arrives (what vLLM v1 does for parallel sampling); for the
    real beams, the engine's count while every beam runs as a new one-token request."""
    from mini_vllm.core.kv_cache_manager import KVCacheManager

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
    _, _, unshared, engine_held = _real_beams(n)  # every beam a new request, as v1 runs them
    return {"saved": saved, "computed": computed, "beams": 100.0 * (1 - engine_held / unshared)}


BASELINES = {"prefix caching only (n requests, no fork)": prefix_caching_only}
