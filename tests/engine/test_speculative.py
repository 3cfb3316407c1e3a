"""Speculative decoding in the engine: the scheduler's bookkeeping, and the distribution it keeps.

* The scheduler counts drafts in the token budget, names the ones it schedules, steps
  ``num_computed_tokens`` back over the rejected ones and never caches a block that holds a draft.
* Random sampling with speculation emits exactly the target's distribution: a chi-square test over
  thousands of seeded requests of the whole engine, on a prompt built so that the n-gram draft is
  accepted about three times in four (both branches of the rejection sampler run often).
* Greedy equality with plain decoding, in every engine configuration, is in
  ``test_engine_correctness.py``; the rejection sampler and proposer alone in
  ``tests/test_spec_decode.py``.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from course.labs.numerics import chi_square, chi_square_limit, planted_draft_prompt
from mini_vllm.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.metrics.stats import EngineStats
from mini_vllm.outputs import DraftTokenIds, ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.metrics import SpecDecodingStats

# ----------------------------------------------------------------------------- the scheduler

BLOCK = 4


def _scheduler() -> tuple[Scheduler, Request]:
    """A scheduler holding one request of 6 prompt tokens whose prefill has run and sampled one
    token (7 tokens, 6 computed)."""
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=32,
                                          max_num_batched_tokens=64, max_model_len=64))
    request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=20),
                      eos_token_id=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 6}
    scheduler.update_from_output(out, _sampled([[9]]))
    return scheduler, request


def _sampled(tokens: list[list[int]]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=tokens)


def test_drafts_are_scheduled_checked_and_the_rejected_ones_rolled_back():
    scheduler, request = _scheduler()
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11, 12]]))
    assert request.num_tokens_with_spec == 10 and request.num_tokens == 7
    out = scheduler.schedule()
    # The last token and the three drafts: positions 6..9, in three blocks.
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_spec_decode_tokens == {"r": [10, 11, 12]}
    assert request.spec_token_ids == [], "scheduled drafts are spent; the proposer sends anew"
    manager = scheduler.kv_cache_manager
    assert len(manager.req_to_blocks["r"]) == 3
    # Blocks are cached up to num_tokens (7): only the first; the second will hold draft 10.
    assert manager.num_cached_block["r"] == 1
    # The target accepted draft 10, rejected 11 and emitted 13 in its place.
    outputs = scheduler.update_from_output(out, _sampled([[10, 13]]))
    assert outputs[0].new_token_ids == [10, 13]
    assert request.num_tokens == 9 and request.num_computed_tokens == 8, (
        "the two rejected drafts' KV must be computed again: num_computed_tokens steps back")
    assert manager.num_cached_block["r"] == 1
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_pos == [1, 0, 0] and stats.drafted_per_pos == [1, 1, 1]
    # The next step computes the new last token only, from position 8.
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 1} and out.scheduled_spec_decode_tokens == {}
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert manager.num_cached_block["r"] == 2  # tokens 4..7 are all real now


def test_the_budget_cuts_drafts_short_and_the_rest_are_dropped():
    scheduler, request = _scheduler()
    scheduler.max_num_scheduled_tokens = 3
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11, 12]]))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 3}
    assert out.scheduled_spec_decode_tokens == {"r": [10, 11]}
    # All accepted: the bonus token follows, nothing rolls back.
    scheduler.update_from_output(out, _sampled([[10, 11, 14]]))
    assert request.num_computed_tokens == request.num_tokens - 1 == 9


def test_drafts_for_a_request_mid_prefill_gone_or_finished_are_ignored():
    scheduler, request = _scheduler()
    request.num_computed_tokens = 3  # as if its prompt were still being computed
    scheduler.update_draft_token_ids(DraftTokenIds(["r", "gone"], [[10], [11]]))
    assert request.spec_token_ids == []
    request.num_computed_tokens = 6
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10]]))
    assert request.spec_token_ids == [10]


def test_a_preempted_request_forgets_its_drafts():
    scheduler, request = _scheduler()
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11]]))
    scheduler.kv_cache_manager.block_pool.get_new_blocks(
        scheduler.kv_cache_manager.block_pool.get_num_free_blocks())  # the cache is full
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["r"] and request.spec_token_ids == []


# ----------------------------------------------------------------------------- settings, stats


def test_speculative_config_takes_upstreams_defaults_and_refuses_bad_values():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(prompt_lookup_max=3).prompt_lookup_min == 3
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == (
        SpeculativeConfig(num_speculative_tokens=2))
    for bad, match in (({"method": "eagle"}, "method"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(**bad)
    with pytest.raises(TypeError, match="speculative_config"):
        EngineConfig(speculative_config="ngram")


def test_stats_add_up_and_say_the_acceptance():
    a, b = SpecDecodingStats(), SpecDecodingStats()
    a.observe_draft(3, 2)
    b.observe_draft(4, 0)
    total = EngineStats(spec_decoding=a)
    total.add(EngineStats(spec_decoding=b))
    spec = total.spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 7, 2)
    assert spec.accepted_per_pos == [1, 1, 0, 0] and spec.drafted_per_pos == [2, 2, 2, 1]
    assert spec.mean_acceptance_length == 2.0 and spec.acceptance_rate == 2 / 7
    assert "mean acceptance length 2.00" in total.summary()
    assert spec.minus(a) == b
    with pytest.raises(ValueError, match="impossible"):
        a.observe_draft(2, 3)


# ----------------------------------------------------------------------------- the distribution

N_REQUESTS = 3000
# The sampling settings under test: temperature and top-k both shape the target distribution.
TEMPERATURE, TOP_K = 0.8, 24


def _target(model, ids: list[int]) -> torch.Tensor:
    """The distribution the engine must sample the token after ``ids`` from: the model's
    logits by full recomputation, divided by the temperature, cut to the top k, softmax."""
    with torch.no_grad():
        logits = model.forward_reference(torch.tensor(ids))[-1].double() / TEMPERATURE
    kept = torch.full_like(logits, float("-inf"))
    top = logits.topk(TOP_K)
    kept[top.indices] = top.values
    return kept.softmax(-1)


@pytest.fixture(scope="module")
def planted_prompt(tiny_model) -> tuple[list[int], int, int]:
    """A prompt ``[a, b] + R`` whose most likely next token is ``a``, and after ``a`` is ``b``
    (:func:`course.labs.numerics.planted_draft_prompt`)."""
    found = planted_draft_prompt(functools.partial(_target, tiny_model),
                                 tiny_model.config.vocab_size)
    if found is None:
        pytest.fail("no prompt with a planted draft found; widen the search")
    return found


@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "sampled_draft"])
def test_random_speculative_sampling_emits_the_targets_distribution(proposer, tiny_model,
                                                                    planted_prompt):
    """3,000 seeded requests of three tokens: after ``a`` the engine checks the draft ``b``
    (prompt lookup finds it after ``a`` in the prompt; a draft model that is the target
    guesses the target's most likely token, ``b``; a one-layer draft whose drafts are sampled
    proposes anything, with its own distribution ``q`` for the rejection sampler, so the
    recovered tokens come from ``max(0, p - q)``). The second token given ``a`` must follow
    the target's distribution after ``a``; the third, after an accepted ``b`` (the bonus token)
    and after a rejection (drawn by the next step), the target's distribution after the two
    before it (summed chi-square at the 0.1% level; the seeds are fixed)."""
    prompt, a, b = planted_prompt
    # (The draft model writes the sampled token's K/V before it guesses: blocks of 64 leave the
    # 32-token prompt's block room for it right after the prefill, which claims no lookahead.)
    spec, blocks = {
        "ngram": ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1},
                  dict(num_gpu_blocks=2048)),
        "draft_model": ({"method": "draft_model", "model": tiny_model},
                        dict(num_gpu_blocks=512, block_size=64)),
        "sampled_draft": ({"method": "draft_model", "num_draft_layers": 1,
                           "draft_sample_method": "probabilistic"},
                          dict(num_gpu_blocks=512, block_size=64)),
    }[proposer]
    llm = LLM(tiny_model, speculative_config={**spec, "num_speculative_tokens": 1,
                                              "draft_policy": "always"},
              max_num_seqs=256, max_num_batched_tokens=4096, **blocks)
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, seed=i)
              for i in range(N_REQUESTS)]
    outputs = [o.outputs[0].token_ids for o in llm.generate([prompt] * N_REQUESTS, params,
                                                            use_tqdm=False)]
    spec = llm.last_stats.spec_decoding
    after_a = [o for o in outputs if o[0] == a]
    assert spec.num_drafts >= len(after_a) > N_REQUESTS // 3, "the draft was meant to be checked"
    accepted = sum(o[1] == b for o in after_a) / len(after_a)
    assert 0.4 < accepted < 0.95, f"acceptance {accepted:.2f}: both branches must run often"

    second = collections.Counter(o[1] for o in after_a)
    third = {accepted: collections.Counter(o[2] for o in after_a if (o[1] == b) == accepted)
             for accepted in (True, False)}
    expected = {True: second[b] * _target(tiny_model, [*prompt, a, b]),
                False: sum(n * _target(tiny_model, [*prompt, a, x])
                           for x, n in second.items() if x != b)}
    stat_sum, df = chi_square(second, len(after_a) * _target(tiny_model, [*prompt, a]))
    for accepted in (True, False):
        stat, dof = chi_square(third[accepted], expected[accepted])
        stat_sum, df = stat_sum + stat, df + dof
    assert df >= 15
    limit = chi_square_limit(df)
    assert stat_sum < limit, (
        f"chi-square {stat_sum:.1f} over {df} degrees of freedom (0.1% limit {limit:.1f}): "
        "speculative sampling does not emit the target's distribution")


def test_a_seeded_speculative_request_reproduces_whatever_shares_its_batch(tiny_model,
                                                                          planted_prompt):
    prompt = planted_prompt[0]
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
             "draft_policy": "always"}
    llm = LLM(tiny_model, speculative_config=ngram)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([prompt[:9], prompt, prompt[3:]],
                         [SamplingParams(temperature=1.0, max_tokens=12), seeded,
                          SamplingParams(temperature=0.8, max_tokens=12)],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    assert llm.last_stats.spec_decoding.num_drafts > 0


def test_a_seeded_speculative_request_reproduces_across_engines_with_the_adaptive_policy():
    """The adaptive draft policy picks draft lengths from measured step times, and a sampled
    request's tokens depend on how many drafts it checks (each draws from its generator): a
    seeded request checks its whole proposal, so three engines give it the same tokens."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    seeded = SamplingParams(temperature=1.0, seed=9, max_tokens=33)
    outputs = []
    for _ in range(3):
        llm = LLM(speculative_config=ngram, enforce_eager=True)
        outputs.append(llm.generate(["KING"], seeded, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.last_stats.spec_decoding.num_drafts > 0
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
