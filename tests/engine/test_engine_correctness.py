"""Greedy generation through the whole engine equals full recomputation with no cache.

Every configuration below must reproduce the reference tokens exactly: plain, chunked prefill
(a token budget below the longest prompt), prefix caching on and off, and KV caches small enough
to force preemption by recompute and by swap. Each case also checks that the mechanism it names
really happened (otherwise the test would pass without testing anything).
"""

from __future__ import annotations

import pytest

from mini_vllm.attention import cpu_kernels
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import greedy_reference
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)

CASES = {
    "roomy": dict(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=512),
    "chunked-prefill": dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12),
    "no-prefix-cache": dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12,
                            enable_prefix_caching=False),
    "preempt-recompute": dict(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16),
    "preempt-swap": dict(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16,
                         preemption_mode="swap", num_cpu_blocks=64),
}


PATHS = ["pytorch-ops, block 4", "pytorch-ops, block 16", "cpu-kernels, block 16"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The engine's two CPU attention paths: lab 02-04's PyTorch ops (what an engine of a
    student's pieces runs) and the compiled kernels (the default while the reference pieces are
    in place, for block size 16 only)."""
    if request.param.startswith("pytorch-ops"):
        monkeypatch.setenv("MINI_VLLM_DISABLE_CPU_KERNELS", "1")
    elif cpu_kernels.load() is None:
        pytest.skip("no C compiler here: the engine uses the PyTorch ops")
    return request.param


def engine_config(case: str, path: str) -> dict:
    """``CASES[case]`` with blocks of the path's size (about as many slots in all)."""
    config = dict(CASES[case])
    if path.endswith("block 16") and config["block_size"] == 4:
        # (+1: the null block, which never holds tokens, is a quarter of the space at 16)
        config.update(block_size=16, num_gpu_blocks=config["num_gpu_blocks"] // 4 + 1)
    return config


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_engine_equals_full_recomputation(case, path, tiny_model, prompts,
                                                 reference_outputs):
    llm = LLM(tiny_model, **engine_config(case, path))
    uses_kernels = llm.engine.model_runner.attn_backend.cpu_kernels is not None
    assert uses_kernels == path.startswith("cpu-kernels")
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, want) in enumerate(zip(got, reference_outputs)):
        assert g == want, f"{case}: prompt {i} (len {len(prompts[i])}): engine {g} != ref {want}"
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.last_stats
    assert stats.num_generated_tokens == len(prompts) * GREEDY.max_tokens
    assert stats.kv_blocks_in_use == 0, "every block must be free once all requests finished"
    longest = max(len(p) for p in prompts)
    if engine_config(case, path)["max_num_batched_tokens"] < longest:
        # Chunked prefill happened: the longest prompt cannot fit in one step.
        assert stats.num_steps > GREEDY.max_tokens
    if case.startswith("preempt"):
        assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    if case == "preempt-swap":
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    if case == "chunked-prefill":
        # Prompts 5 and 6 share whole blocks with prompt 2: their prefill is partly skipped.
        assert stats.prefix_cache_hits > 0
        assert stats.num_prompt_tokens_computed < stats.num_prompt_tokens
    if case == "no-prefix-cache":
        assert stats.prefix_cache_hits == 0
        assert stats.num_prompt_tokens_computed == stats.num_prompt_tokens


def test_second_generate_reuses_the_prefix_cache(tiny_model, prompts, reference_outputs):
    """Blocks of finished requests stay cached: the same prompts again hit the cache."""
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64)
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs[:3]
    assert llm.last_stats.prefix_cache_hits > 0
    assert llm.last_stats.num_prompt_tokens_computed < llm.last_stats.num_prompt_tokens
    assert outputs[2].metrics["num_cached_tokens"] > 0


# Prompt lookup with short n-grams, so that the random model's drafts are often right and often
# wrong: both acceptance and the rollback of rejected tokens are exercised.
# "always": every proposed token is checked, so the test knows drafts ran (the default policy
# drafts only where the measured costs say it pays; a test below runs it too).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "draft_policy": "always"}
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def spec_prompts(prompts) -> list[list[int]]:
    """The shared prompts, plus two that repeat themselves (where prompt lookup shines)."""
    return [*prompts, prompts[1] * 2, (prompts[0] + prompts[3]) * 3]


@pytest.fixture(scope="module")
def spec_reference(tiny_model, spec_prompts) -> list[list[int]]:
    return [greedy_reference(tiny_model, p, SPEC_GREEDY.max_tokens) for p in spec_prompts]


def _speculate(spec: dict, case: str, path: str, tiny_model, prompts, reference):
    """Greedy generation of ``prompts`` with ``spec`` in engine configuration ``case``: every
    output must be ``reference``'s (the oracle's). Returns the call's statistics."""
    llm = LLM(tiny_model, speculative_config=spec, **engine_config(case, path))
    outputs = llm.generate(prompts, SPEC_GREEDY, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outputs, reference)):
        got = out.outputs[0].token_ids
        assert got == want, f"{case}: prompt {i}: speculative {got} != reference {want}"
    return llm.last_stats


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speculative_decoding_equals_full_recomputation(case, path, tiny_model,
                                                               spec_prompts, spec_reference):
    """With n-gram drafts checked in every step, greedy output is token for token the plain
    oracle's, in every configuration; and the drafts really were checked, some accepted and
    some rejected (so the rollback ran)."""
    stats = _speculate(NGRAM, case, path, tiny_model, spec_prompts, spec_reference)
    spec = stats.spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec
    # Every draft step emits accepted + 1 tokens: fewer steps than tokens.
    assert stats.num_generated_tokens == len(spec_prompts) * SPEC_GREEDY.max_tokens
    assert stats.kv_blocks_in_use == 0, "every block must be free once all requests finished"
    if case.startswith("preempt"):
        assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"


def test_greedy_speculation_with_the_adaptive_draft_policy_equals_full_recomputation(
        tiny_model, spec_prompts, spec_reference):
    """The default policy checks fewer drafts where they do not pay; the tokens stay the same."""
    llm = LLM(tiny_model, speculative_config={**NGRAM, "draft_policy": "adaptive"},
              **CASES["chunked-prefill"])
    outputs = llm.generate(spec_prompts, SPEC_GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == spec_reference


# A draft model that is the target itself guesses exactly what greedy decoding picks, as long as
# its own cache is right: caught up on every accepted token, its drafts written through the
# lookahead slots, and started over when a request's blocks move (preemption, swapping).
DRAFT_IS_TARGET = {"method": "draft_model", "num_speculative_tokens": 3, "draft_policy": "always"}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_the_target_as_its_own_draft_accepts_every_draft(case, path, tiny_model,
                                                                     spec_prompts,
                                                                     spec_reference):
    """Greedy output equals the oracle's, and every draft the target checks is accepted: any
    slip in the draft's positions, catch-up or cache (stale after a preemption or a swap, or
    written outside its blocks) would show as a rejected draft."""
    stats = _speculate({**DRAFT_IS_TARGET, "model": tiny_model}, case, path, tiny_model,
                       spec_prompts, spec_reference)
    spec = stats.spec_decoding
    assert spec.num_draft_tokens > len(spec_prompts), spec
    assert spec.num_accepted_tokens == spec.num_draft_tokens, (
        f"{case}: {spec.num_draft_tokens - spec.num_accepted_tokens} of "
        f"{spec.num_draft_tokens} drafts of a draft identical to the target were rejected")
    assert stats.kv_blocks_in_use == 0, "every block must be free once all requests finished"
    if case.startswith("preempt"):
        assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
