"""The cache-aware router (``mini_vllm.entrypoints.router``) in front of ``dp_size`` engines.

The policy, on token ids alone: prompts sharing a system prompt stay together, a match is a
prefix match of the engine cache's hash chain (never equal tokens at another position), load
balance overrides affinity past the threshold, and each engine's remembered hashes are bounded.
End to end, two engines each in a process of their own give the same greedy tokens as one
``LLM``, and leave no process behind, also when the ``with`` block is left by Ctrl-C.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest

from mini_vllm.core.kv_cache_utils import hash_block_tokens, sha256
from mini_vllm.entrypoints import router as router_module
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.router import (
    PrefixRouter,
    RoundRobinRouter,
    RoutedEngines,
    prompt_block_hashes,
)
from mini_vllm.sampling_params import SamplingParams

BLOCK = 4


def block(fill: int) -> list[int]:
    return [fill] * BLOCK


def router(**kwargs) -> PrefixRouter:
    return PrefixRouter(2, **{"block_size": BLOCK, "num_blocks": 64,
                              "balance_abs_threshold": 8, **kwargs})


# ---------------------------------------------------------------------------- the policy


def test_round_robin_cycles_and_counts_load():
    rr = RoundRobinRouter(2)
    assert [rr.route([1, 2, 3]) for _ in range(4)] == [0, 1, 0, 1]
    assert rr.loads == [2, 2]
    rr.finished(1)
    assert rr.loads == [2, 1]
    with pytest.raises(ValueError, match="no outstanding"):
        RoundRobinRouter(2).finished(0)


def test_hashes_are_the_engine_caches_chain():
    ids = block(1) + block(2) + [3, 3]  # two full blocks; the partial one is never hashed
    first = hash_block_tokens(sha256, None, block(1))
    assert prompt_block_hashes(ids, BLOCK) == [first, hash_block_tokens(sha256, first, block(2))]


def test_prompts_sharing_a_system_prompt_go_to_the_same_engine():
    r = router()
    system_a = block(1) + block(2) + block(3)
    system_b = block(4) + block(5) + block(6)
    a = [r.route(system_a + [10 + i] * 5) for i in range(3)]
    b = [r.route(system_b + [20 + i] * 5) for i in range(3)]
    assert len(set(a)) == 1 and len(set(b)) == 1 and a[0] != b[0]
    # Affinity outweighs a small imbalance: system A's engine takes more than its share.
    r.finished(b[0])
    assert r.route(system_a + [99] * 6) == a[0]
    assert r.loads[a[0]] == 4 and r.loads[b[0]] == 2


def _route_after(prompt: list[int], later: list[int]) -> tuple[PrefixRouter, int]:
    """Engine 0 holds ``prompt`` (still running, so engine 1 is the least loaded); where does
    ``later`` go?"""
    r = router()
    assert r.route(prompt) == 0
    return r, r.route(later)


@pytest.mark.parametrize("later", [
    block(9) + block(2) + block(3),  # the first block differs, the later tokens are equal
    block(2) + block(3),             # the same tokens, at other positions
], ids=["first-block-differs", "shifted"])
def test_a_match_is_a_prefix_match_not_equal_tokens_elsewhere(later):
    prompt = block(1) + block(2) + block(3)
    r, index = _route_after(prompt, later)
    assert index == 1, "no block of `later` is cached under the same prefix on engine 0"
    assert not set(prompt_block_hashes(later, BLOCK)) & set(r.caches[0])


def test_a_router_hashing_each_blocks_tokens_alone_is_caught(monkeypatch):
    """The planted bug: per-block token hashes (no parent) match the shifted prompt."""

    def per_block(ids, size):
        return [sha256(tuple(ids[i:i + size])) for i in range(0, len(ids) - size + 1, size)]

    monkeypatch.setattr(router_module, "prompt_block_hashes", per_block)
    prompt = block(1) + block(2) + block(3)
    r, index = _route_after(prompt, block(2) + block(3))
    assert index == 0  # wrongly follows tokens that hold different KV there
    r, _ = _route_after(prompt, block(9) + block(2) + block(3))
    assert set(per_block(block(9) + block(2) + block(3), BLOCK)) & set(r.caches[0])


def test_load_balance_overrides_affinity_past_the_threshold():
    r = router(balance_abs_threshold=2)
    system = block(1) + block(2)
    # Engine 0 may lead by 2 outstanding requests; the next one goes to the idle engine.
    assert [r.route(system + [i]) for i in range(4)] == [0, 0, 0, 1]
    assert r.loads == [3, 1]
    # Both now hold the prefix: a tie on blocks goes to the least loaded.
    assert r.route(system + [7]) == 1
    for _ in range(3):
        r.finished(0)
    assert r.route(system + [8]) == 0


def test_a_prompt_nobody_holds_goes_to_the_least_loaded_engine():
    r = router()
    r.route(block(1) + block(2))
    assert r.route(block(5) + block(6)) == 1
    assert r.route([7, 7]) == 0  # shorter than a block: nothing to match; all ties: engine 0


def test_the_remembered_blocks_are_bounded_lru_and_the_prefix_outlives_its_suffix():
    r = PrefixRouter(1, block_size=BLOCK, num_blocks=4)
    first = block(1) + block(2) + block(3)
    r.route(first)
    r.route(block(4) + block(5) + block(6))
    assert len(r.caches[0]) == 4
    # The older prompt lost its tail, not its head (the engine frees tail blocks first).
    assert r.matched_blocks(0, prompt_block_hashes(first, BLOCK)) == 1
    r.route(block(7) + block(8) + block(9) + block(10))
    assert r.matched_blocks(0, prompt_block_hashes(first, BLOCK)) == 0


def test_an_evicted_prefix_no_longer_attracts_its_prompts():
    r = PrefixRouter(2, block_size=BLOCK, num_blocks=2, balance_abs_threshold=8)
    assert r.route(block(1) + block(2)) == 0
    r.finished(0)
    assert r.route(block(3) + block(4)) == 1  # nothing matches: engine 1 holds less
    r.finished(1)
    r.route(block(5) + block(6))  # matches nowhere, tie on load and size: engine 0, evicting
    r.finished(0)
    assert r.matched_blocks(0, prompt_block_hashes(block(1) + block(2), BLOCK)) == 0


# ---------------------------------------------------------------------------- end to end

SYSTEM = "You are the Chorus. Speak in blank verse, in the manner of the plays. "  # 4+ blocks
PROMPTS = [SYSTEM + q for q in ("Who is the king?", "Where is the ghost?", "What of the queen?")]
PROMPTS += ["Something is rotten in the state of Denmark, said " + w for w in ("he", "she")]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_two_engines_give_one_engines_tokens_and_leave_no_process():
    reference = LLM(num_gpu_blocks=48, max_model_len=256)
    expected = [list(o.outputs[0].token_ids)
                for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def run(engines: RoutedEngines) -> list[list[int]]:
        async def one(prompt: str) -> list[int]:
            tokens: list[int] = []
            async for out in engines.generate(prompt, GREEDY):
                tokens += out.outputs[0].token_ids
            return tokens

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    pids = []
    with pytest.raises(KeyboardInterrupt):
        with RoutedEngines(dp_size=2, num_gpu_blocks=48, max_model_len=256) as engines:
            pids = [e.core_client.process.pid for e in engines.engines]
            assert len(set(pids)) == 2
            assert asyncio.run(run(engines)) == expected
            assert engines.router.loads == [0, 0]
            # The shared system prompt's requests went to one engine, and hit its cache.
            chorus = {engines.router.matched_blocks(e, prompt_block_hashes(
                engines.tokenizer.encode(SYSTEM), 16)) > 0 for e in (0, 1)}
            assert chorus == {True, False}
            stats = engines.prefix_cache_stats()
            assert sum(s["hits"] for s in stats) >= 2 * 4 * 16
            raise KeyboardInterrupt  # Ctrl-C inside the block: the engines still stop
    assert mp.active_children() == []
    assert not any(_alive(p) for p in pids), "an engine's core process outlived the block"


def _alive(pid: int) -> bool:
    """Whether ``pid`` names a process (``active_children`` above has reaped ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
