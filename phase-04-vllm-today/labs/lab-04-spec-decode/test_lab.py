"""Graded tests of lab 04-04: speculative decoding.

The headline properties: greedy speculative decoding emits, token for token, what plain greedy
decoding emits, in every engine configuration; random speculative decoding emits exactly the
target's distribution (by enumeration of the rejection sampler's cases, and by a chi-square test
over thousands of seeded requests of the whole engine); a proposal is always a continuation the
context holds.

Groups, each using only its task and the ones before it (the engine tests at the end use all):
  1. task 1: the n-gram proposer against worked cases and a brute-force search (Hypothesis)
  2. tasks 2-3: the acceptance test and the recovered distribution
  3. tasks 4-5: the rejection sampler, greedy and random (exact distribution by enumeration,
     the protocol of the random draws)
  4. tasks 6-8: the scheduler's drafts: taken, scheduled, rolled back, counted
  5. the engine with your pieces in place of the reference's (``with_your_pieces``): greedy
     equality under chunked prefill, prefix caching and preemption; the distribution of
     random speculative sampling
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.numerics import chi_square, chi_square_limit, planted_draft_prompt
from course.labs.student_process import beside_the_student
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.model_executor.models.llama import (
    LlamaForCausalLM,
    ModelConfig,
    greedy_reference,
    init_weights,
)
from mini_vllm.outputs import DraftTokenIds, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


# ---------------------------------------------------------------------------------------------
# Task 1: the n-gram proposer
# ---------------------------------------------------------------------------------------------


def brute_force_proposal(tokens, min_n, max_n, k, max_model_len):
    """The rule, spelled out: every (n, j) pair, longest n first, earliest j first."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > total - 1:
            continue
        for j in range(0, total - n):
            if list(tokens[j:j + n]) == list(tokens[total - n:]):
                return list(tokens[j + n:j + n + k])
    return []


@pytest.mark.parametrize("tokens, min_n, max_n, k, want", [
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 2, [4, 1]),         # the longest suffix that recurs
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 9, [4, 1, 2, 3]),   # no further than the sequence goes
    ([5, 9, 7, 5, 8, 7, 5], 1, 3, 2, [8, 7]),         # [8, 7, 5] does not recur, [7, 5] does
    ([5, 9, 7, 5, 8, 7, 5], 3, 3, 2, []),             # only shorter suffixes recur
    ([5, 9, 7, 6, 8, 3, 5], 1, 3, 2, [9, 7]),         # [5] alone: its earliest occurrence
    ([4, 4, 4, 4], 1, 3, 2, [4]),                     # overlapping the suffix is fine
    ([3, 1, 3, 2, 3, 1, 3], 1, 2, 3, [2, 3, 1]),      # [1, 3] recurs at 1 only (earliest)
    ([3, 1, 3, 2, 3, 1, 3], 3, 3, 3, [2, 3, 1]),      # [3, 1, 3] at 0
    ([7, 1, 7, 2, 7], 1, 1, 1, [1]),                   # [7] at 0 and 2: the earliest
    ([7, 1, 7, 2, 7, 1, 7], 1, 2, 2, [2, 7]),          # [1, 7] at 1 only (3 is [2, 7])
])
def test_the_proposer_continues_the_longest_earliest_match(tokens, min_n, max_n, k, want):
    original = list(tokens)
    got = lab.propose_ngram_tokens(tokens, min_n, max_n, k, 100)
    assert got == want, (
        f"propose_ngram_tokens({tokens}, min_n={min_n}, max_n={max_n}, k={k}): want {want}, "
        f"got {got!r}"
    )
    assert tokens == original, "propose_ngram_tokens must not change its input"


def test_nothing_recurs_nothing_is_proposed():
    got = lab.propose_ngram_tokens([4, 5, 6, 4], 1, 3, 2, 100)
    assert got == [5, 6], f"set-up: [4] recurs at 0, so [5, 6]; got {got!r}"
    for tokens in ([1, 2, 3], [7], []):
        got = lab.propose_ngram_tokens(tokens, 1, 3, 2, 100)
        assert got == [], f"{tokens}: no suffix recurs, so no proposal; got {got!r}"


def test_the_proposal_stops_at_max_model_len():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    for max_model_len, want in ((100, [3, 4, 5]), (9, [3, 4]), (8, [3]), (7, []), (5, [])):
        got = lab.propose_ngram_tokens(tokens, 1, 2, 3, max_model_len)
        assert got == want, (
            f"7 tokens, max_model_len {max_model_len}: at most {max(0, max_model_len - 7)} "
            f"drafts, so {want}; got {got!r}"
        )


@given(tokens=st.lists(st.integers(0, 3), max_size=24), min_n=st.integers(1, 3),
       extra=st.integers(0, 2), k=st.integers(1, 5), room=st.integers(-2, 6))
def test_the_proposer_matches_the_rule_on_any_sequence(tokens, min_n, extra, k, room):
    """Few distinct tokens, so matches of every length are common."""
    max_model_len = max(1, len(tokens) + room)
    got = lab.propose_ngram_tokens(list(tokens), min_n, min_n + extra, k, max_model_len)
    want = brute_force_proposal(tokens, min_n, min_n + extra, k, max_model_len)
    assert got == want, (
        f"propose_ngram_tokens({tokens}, min_n={min_n}, max_n={min_n + extra}, k={k}, "
        f"max_model_len={max_model_len}): want {want}, got {got!r}"
    )


def test_the_given_proposer_asks_your_function_for_each_request():
    proposer = lab.NgramProposer(1, 3, 2, 100)
    got = proposer.propose([[1, 2, 3, 4, 1, 2, 3], [1, 2, 3], [9, 9]])
    assert got == [[4, 1], [], [9]], f"one proposal per request: got {got!r}"


# ---------------------------------------------------------------------------------------------
# Tasks 2-3: the acceptance test and the recovered distribution
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, draft, uniform, want", [
    (0.5, 0.5, 0.999, True),   # p = q: always accepted
    (0.9, 0.3, 0.999, True),   # p > q: always accepted
    (0.2, 0.4, 0.49, True),    # p / q = 0.5: accepted when the draw is below it
    (0.2, 0.4, 0.5, True),     # ... and at it
    (0.2, 0.4, 0.51, False),
    (0.0, 0.4, 0.0, True),     # p = 0 and a draw of exactly 0: accepted with probability 0
    (0.0, 0.4, 0.01, False),
    (0.3, 1.0, 0.29, True),    # a proposer without probabilities: q = 1
    (0.3, 1.0, 0.31, False),
    (0.5, 0.0, 0.0, False),    # q = 0 rejects (never divide by zero)
])
def test_accepts_with_probability_min_1_p_over_q(target, draft, uniform, want):
    got = lab.accepts(target, draft, uniform)
    assert type(got) is bool and got == want, (
        f"accepts(target {target}, draft {draft}, uniform {uniform}): accept when uniform <= "
        f"p / q (q > 0), so {want}; got {got!r}"
    )


def test_the_recovered_distribution_is_the_excess_of_p_over_q():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.1, 0.5, 0.2, 0.2])
    p_before, q_before = p.clone(), q.clone()
    got = lab.recovered_distribution(p, q, 1)
    want = torch.tensor([1.0, 0.0, 0.0, 0.0])  # only token 0 has p > q
    assert torch.allclose(got, want), f"max(0, p - q) normalised is {want.tolist()}, got {got}"
    assert torch.equal(p, p_before) and torch.equal(q, q_before), "the inputs must not change"
    q = torch.tensor([0.3, 0.1, 0.1, 0.5])
    got = lab.recovered_distribution(p, q, 3)
    want = torch.tensor([0.1, 0.2, 0.1, 0.0]) / 0.4
    assert torch.allclose(got, want), f"max(0, p - q) normalised is {want.tolist()}, got {got}"


def test_without_draft_probabilities_the_draft_token_is_removed():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    got = lab.recovered_distribution(p, None, 0)
    want = torch.tensor([0.0, 0.5, 1 / 3, 1 / 6])
    assert torch.allclose(got, want), (
        f"q one-hot at the draft token 0: p without it, normalised, {want.tolist()}; got {got}"
    )
    assert torch.equal(p, torch.tensor([0.4, 0.3, 0.2, 0.1])), "the inputs must not change"


def test_nothing_left_falls_back_to_the_target():
    p = torch.tensor([0.25, 0.25, 0.5, 0.0])
    got = lab.recovered_distribution(p, p.clone(), 2)
    assert torch.allclose(got, p), f"p = q leaves nothing: return p normalised, got {got}"
    got = lab.recovered_distribution(torch.tensor([0.0, 2.0, 0.0]), None, 1)
    assert torch.allclose(got, torch.tensor([0.0, 1.0, 0.0])), (
        f"p all on the draft token leaves nothing: p normalised, [0, 1, 0]; got {got}"
    )


# ---------------------------------------------------------------------------------------------
# Tasks 4-5: the rejection sampler
# ---------------------------------------------------------------------------------------------


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("drafts, want", [
    ([2, 0, 1], [2, 0, 1, 9]),   # every draft the argmax: all accepted, then the bonus
    ([2, 3, 1], [2, 0]),         # the second is not: its argmax instead, then stop
    ([1, 0, 1], [2]),            # the first is not
    ([], [9]),                   # nothing to check: the bonus alone
])
def test_greedy_accepts_while_the_draft_is_the_argmax(drafts, want):
    rows = [[0.1, 0.2, 0.6, 0.1], [0.7, 0.1, 0.1, 0.1], [0.2, 0.5, 0.2, 0.1]][:len(drafts)]
    p = _probs(rows) if rows else torch.empty(0, 4)
    out = lab.RejectionSampler()([drafts], p, [9], [True])
    got = lab.RejectionSampler.parse_output(out)
    assert got == [want], f"greedy drafts {drafts}: want {want}, got {got}"


@beside_the_student
def _judge_once(drafts, p, q, seed):
    """One call of your sampler for one random request, with a generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = lab.RejectionSampler()([drafts], p, [99], [False], draft_probs=q, generators=[generator])
    return lab.RejectionSampler.parse_output(out)[0]


def _judge_by_the_protocol(drafts, p, q, seed):
    """What the starter's docstring prescribes, with the same seed: the uniforms first, then
    one multinomial draw at the first rejection."""
    generator = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64)
    out = []
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[i, d])
        if qd > 0 and float(p[i, d]) / qd >= float(uniforms[i]):
            out.append(d)
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0
        else:
            residual = (p[i] - q[i]).clamp_min(0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i] / p[i].sum()
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    return out + [99]


def test_random_draws_follow_the_protocol_so_seeds_reproduce():
    """The uniforms first, one per draft, then one multinomial draw at a rejection: a seeded
    request emits the same tokens as the docstring's protocol, seed for seed."""
    p = _probs([[0.3, 0.3, 0.2, 0.2], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = _probs([[0.1, 0.6, 0.2, 0.1], [0.4, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1]])
    for seed in range(40):
        for drafts, qq in (([1, 1, 0], q), ([0, 1, 2], None)):
            got = _judge_once(drafts, p, qq, seed, beside=lab)
            want = _judge_by_the_protocol(drafts, p, qq, seed)
            assert got == want, (
                f"seed {seed}, drafts {drafts}, {'with' if qq is not None else 'without'} "
                f"draft probabilities: the protocol gives {want}, your sampler {got}"
            )


@beside_the_student
def _first_token_counts(p, q, draft_of, trials, seed):
    """Over ``trials`` calls of your sampler on one draft position: how often each token came
    out first. The draft is drawn from ``q`` (or fixed to ``draft_of`` when q is None)."""
    generator = torch.Generator().manual_seed(seed)
    counts = [0] * p.shape[1]
    sampler = lab.RejectionSampler()
    for _ in range(trials):
        draft = (int(torch.multinomial(q[0], 1, generator=generator)) if q is not None
                 else draft_of)
        out = sampler([[draft]], p, [0], [False], draft_probs=q, generators=[generator])
        counts[sampler.parse_output(out)[0][0]] += 1
    return counts


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "one-hot"])
def test_random_emits_the_targets_distribution(with_q):
    """Chi-square of the first emitted token over 4,000 seeded calls (df 3; 16.27 is the 0.1%
    point; the seed is fixed)."""
    p = _probs([[0.45, 0.3, 0.15, 0.1]])
    q = _probs([[0.1, 0.2, 0.3, 0.4]]) if with_q else None
    trials = 4000
    counts = _first_token_counts(p, q, 0, trials, 1234, beside=lab)
    expected = trials * p[0]  # whatever the draft, the first token's law is the target's
    chi_square = sum((c - float(e)) ** 2 / float(e) for c, e in zip(counts, expected))
    assert chi_square < 16.27, (
        f"the first emitted token must be distributed as the target "
        f"({[round(float(e)) for e in expected]} expected over {trials} calls), got {counts}: "
        f"chi-square {chi_square:.1f}"
    )


def test_all_accepted_emits_the_bonus_and_a_rejection_does_not():
    p = _probs([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = lab.RejectionSampler()([[1, 2]], p, [7], [False], generators=[None])
    assert lab.RejectionSampler.parse_output(out) == [[1, 2, 7]], (
        f"drafts the target gives probability 1 are always accepted, then the bonus token 7: "
        f"got {lab.RejectionSampler.parse_output(out)}"
    )
    out = lab.RejectionSampler()([[0, 2]], p, [7], [False], generators=[None])
    assert lab.RejectionSampler.parse_output(out) == [[1]], (
        f"a draft the target gives probability 0 is rejected, the target's own token (1) is "
        f"emitted and nothing after it, no bonus: got {lab.RejectionSampler.parse_output(out)}"
    )


# ---------------------------------------------------------------------------------------------
# Tasks 6-8: the scheduler's drafts (6: taken and spent, 7: given, 8: rolled back)
# ---------------------------------------------------------------------------------------------

BLOCK = 4


# The scheduler's tasks after task 6; `_scheduler(upto=N)` takes the reference's for the tasks
# after N, so a test of task N needs only your tasks up to N.
LATER_TASKS = {7: ("update_draft_token_ids",), 8: ("_roll_back_rejected",)}


def _scheduler(upto=8, **overrides):
    kw = dict(block_size=BLOCK, num_gpu_blocks=32, max_num_batched_tokens=64, max_model_len=64,
              max_num_seqs=8)
    kw.update(overrides)
    return _scheduler_up_to(upto, SchedulerConfig(**kw), beside=lab)


@beside_the_student
def _scheduler_up_to(upto, config):
    """Built where your code runs (the class is made from yours there)."""
    from mini_vllm.core.sched.scheduler import Scheduler as ReferenceScheduler

    cls = lab.Scheduler
    stand_ins = {name: vars(ReferenceScheduler)[name]
                 for task, names in LATER_TASKS.items() if task > upto for name in names}
    if stand_ins:
        cls = type(f"SchedulerUpToTask{upto}", (lab.Scheduler,), stand_ins)
    return cls(config)


def _request(rid="r", prompt=(1, 2, 3, 4, 5, 6), max_tokens=20):
    return Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   eos_token_id=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def _sampled(out, tokens):
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [list(tokens.get(r, [0])) for r in req_ids])


def _decoding(scheduler, *requests):
    """Requests added and prefilled, each with one sampled token (so num_computed_tokens is
    num_tokens - 1: they decode)."""
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, _sampled(out, {r.request_id: [9] for r in requests}))


def test_take_spec_tokens_names_the_scheduled_drafts_and_spends_them():
    scheduler = _scheduler(upto=6)
    request = _request()
    _decoding(scheduler, request)  # 7 tokens, 6 computed
    request.spec_token_ids = [10, 11, 12]  # as update_draft_token_ids (task 7) would
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 4}, (
        f"the last token and 3 drafts are scheduled (lab 03-01 counts drafts): got "
        f"{out.num_scheduled_tokens}"
    )
    assert out.scheduled_spec_decode_tokens == {"r": [10, 11, 12]}, (
        f"the output names the 3 drafts r checks, got {out.scheduled_spec_decode_tokens}"
    )
    assert request.spec_token_ids == [], (
        f"scheduled drafts are spent: spec_token_ids is empty after schedule(), got "
        f"{request.spec_token_ids!r}"
    )


def test_a_budget_that_cuts_the_drafts_schedules_only_those_it_reaches():
    scheduler = _scheduler(upto=6)
    first, second = _request("a"), _request("b", prompt=(6, 5, 4, 3, 2, 1))
    _decoding(scheduler, first, second)
    scheduler.max_num_scheduled_tokens = 6
    first.spec_token_ids, second.spec_token_ids = [10, 11, 12], [20, 21, 22]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}, (
        f"a budget of 6: a takes 4 (its last token and 3 drafts), b 2; got "
        f"{out.num_scheduled_tokens}"
    )
    assert out.scheduled_spec_decode_tokens == {"a": [10, 11, 12], "b": [20]}, (
        f"b reaches one draft only: {{'a': [10, 11, 12], 'b': [20]}}, got "
        f"{out.scheduled_spec_decode_tokens}"
    )
    scheduler.max_num_scheduled_tokens = 4
    scheduler.update_from_output(out, _sampled(out, {"a": [10, 11, 12, 13], "b": [20, 23]}))
    first.spec_token_ids, second.spec_token_ids = [1, 2, 3], [4, 5]
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}, (
        f"a budget of 4 taken whole by a: b is not scheduled and checks nothing, got "
        f"{out.scheduled_spec_decode_tokens}"
    )
    assert second.spec_token_ids == [4, 5], (
        "b was not scheduled: it keeps its drafts for the next step"
    )


def test_a_request_the_budget_gives_only_its_last_token_checks_no_draft():
    scheduler = _scheduler(upto=6)
    first, second = _request("a"), _request("b", prompt=(6, 5, 4, 3, 2, 1))
    _decoding(scheduler, first, second)
    scheduler.max_num_scheduled_tokens = 5
    first.spec_token_ids, second.spec_token_ids = [10, 11, 12], [20, 21]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 1}, (
        f"a budget of 5: a takes 4, b its last token only; got {out.num_scheduled_tokens}"
    )
    assert out.scheduled_spec_decode_tokens == {"a": [10, 11, 12]}, (
        f"b's step reaches none of its drafts, so b is not named (an entry, even empty, is a "
        f"draft checked and counted); got {out.scheduled_spec_decode_tokens}"
    )


def test_update_draft_token_ids_gives_running_requests_their_drafts():
    scheduler = _scheduler(upto=7)
    request = _request()
    _decoding(scheduler, request)
    drafts = [10, 11, 12]
    scheduler.update_draft_token_ids(DraftTokenIds(["r", "gone"], [drafts, [5]]))
    assert request.spec_token_ids == [10, 11, 12], (
        f"request r gets its drafts as spec_token_ids, got {request.spec_token_ids!r}"
    )
    assert request.num_tokens_with_spec == 10, "num_tokens_with_spec counts them"


def test_drafts_for_a_request_mid_prompt_or_not_running_are_ignored():
    scheduler = _scheduler(upto=7, max_num_batched_tokens=4)
    decoding = _request("decoding", prompt=(1, 2, 3))
    _decoding(scheduler, decoding)
    scheduler.update_draft_token_ids(DraftTokenIds(["decoding"], [[5, 6]]))
    assert decoding.spec_token_ids == [5, 6], (
        f"set-up: a decoding request takes its drafts, got {decoding.spec_token_ids!r}"
    )
    long = _request("long", prompt=range(1, 11))
    scheduler.add_request(long)
    out = scheduler.schedule()  # 4 of its 10 prompt tokens
    scheduler.update_from_output(out, _sampled(out, {"long": []}))
    scheduler.update_draft_token_ids(DraftTokenIds(["long"], [[3]]))
    assert long.spec_token_ids == [], (
        f"a request in the middle of its prompt (4 of 10 computed) takes no drafts, got "
        f"{long.spec_token_ids!r}"
    )
    waiting = _request("waiting", prompt=(7, 8))
    scheduler.add_request(waiting)
    scheduler.update_draft_token_ids(DraftTokenIds(["waiting"], [[3]]))
    assert waiting.spec_token_ids == [] and waiting.status == RequestStatus.WAITING, (
        "a waiting request takes no drafts"
    )


def test_a_request_two_tokens_short_of_its_prompt_takes_no_drafts():
    scheduler = _scheduler(upto=7, max_num_batched_tokens=4)
    request = _request("r", prompt=range(1, 7))
    scheduler.add_request(request)
    out = scheduler.schedule()  # 4 of its 6 prompt tokens: 2 are left
    scheduler.update_from_output(out, _sampled(out, {"r": []}))
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[3]]))
    assert request.spec_token_ids == [], (
        f"a request with 2 prompt tokens still to compute (4 of 6) takes no drafts: drafts "
        f"follow the last token only; got {request.spec_token_ids!r}"
    )
    out = scheduler.schedule()  # the last 2, and it samples
    scheduler.update_from_output(out, _sampled(out, {"r": [9]}))
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[3]]))
    assert request.spec_token_ids == [3], (
        f"once its prompt is computed and it sampled, it takes drafts; got "
        f"{request.spec_token_ids!r}"
    )


def test_rejected_drafts_are_rolled_back_and_never_cached():
    scheduler = _scheduler()
    request = _request()
    _decoding(scheduler, request)
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11, 12]]))
    out = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    assert manager.num_cached_block["r"] == 1, (
        "set-up: tokens 0..3 fill the one block that may be cached; the second holds draft 10"
    )
    outputs = scheduler.update_from_output(out, _sampled(out, {"r": [10, 13]}))
    assert [o.new_token_ids for o in outputs] == [[10, 13]], "the emitted tokens are appended"
    assert request.num_tokens == 9 and request.num_computed_tokens == 8, (
        f"draft 10 accepted, 11 and 12 rejected: 10 positions were computed, 2 of them from "
        f"wrong tokens; num_computed_tokens must step back to 8 (num_tokens 9), got "
        f"{request.num_computed_tokens}"
    )
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1), (
        f"one draft of 3 tokens, 1 accepted, counted in spec_decoding_stats; got "
        f"{stats.num_drafts} drafts, {stats.num_draft_tokens} tokens, "
        f"{stats.num_accepted_tokens} accepted"
    )
    assert manager.num_cached_block["r"] == 1, "no block holding a rejected draft is cached"
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 1}, (
        f"the next step computes the new last token only, got {out.num_scheduled_tokens}"
    )
    assert out.scheduled_cached_reqs.num_computed_tokens == [8], (
        "from position 8, where the rejected drafts' KV gets overwritten"
    )


def test_all_accepted_rolls_back_nothing():
    scheduler = _scheduler()
    request = _request()
    _decoding(scheduler, request)
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11]]))
    out = scheduler.schedule()
    scheduler.update_from_output(out, _sampled(out, {"r": [10, 11, 14]}))
    assert request.num_computed_tokens == request.num_tokens - 1 == 9, (
        f"2 drafts accepted and a bonus token: everything computed but the bonus (9 of 10), "
        f"got {request.num_computed_tokens} of {request.num_tokens}"
    )
    stats = scheduler.spec_decoding_stats
    assert stats.accepted_per_pos == [1, 1] and stats.drafted_per_pos == [1, 1], (
        f"per position: 2 drafted, 2 accepted; got accepted {stats.accepted_per_pos}, "
        f"drafted {stats.drafted_per_pos}"
    )


def test_a_request_preempted_before_its_output_is_not_rolled_back():
    scheduler = _scheduler()
    request = _request()
    _decoding(scheduler, request)
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[10, 11]]))
    out = scheduler.schedule()
    request.num_computed_tokens = 0  # as a preemption between schedule and update would leave it
    scheduler.update_from_output(out, _sampled(out, {"r": [13]}))
    assert request.num_computed_tokens == 0, (
        f"a preempted request has nothing computed to roll back; num_computed_tokens must stay "
        f"0, got {request.num_computed_tokens}"
    )
    assert scheduler.spec_decoding_stats.num_drafts == 1, "the draft is still counted"


# ---------------------------------------------------------------------------------------------
# The engine with your pieces
# ---------------------------------------------------------------------------------------------

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "draft_policy": "always"}


@functools.lru_cache(maxsize=1)
def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(TINY)
    init_weights(model, seed=1, std=0.5)
    return model.eval().requires_grad_(False)


def _target(ids, temperature=1.0):
    with torch.no_grad():
        logits = tiny_model().forward_reference(torch.tensor(ids))[-1].double()
    return (logits / temperature).softmax(-1)


@beside_the_student
def with_your_pieces(prompts, params, engine_kwargs, spec):
    """``LLM.generate`` on the tiny model where your code runs, with your proposer, rejection
    sampler and scheduler in the engine's place (put back afterwards). Returns each request's
    tokens and the run's spec-decoding and preemption counts."""
    from mini_vllm.engine import core
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.spec_decode import ngram_proposer
    from mini_vllm.worker import model_runner

    swaps = [(core, "Scheduler", lab.Scheduler),
             (model_runner, "RejectionSampler", lab.RejectionSampler),
             (ngram_proposer, "propose_ngram_tokens", lab.propose_ngram_tokens)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, mine in swaps:
            setattr(module, name, mine)
        llm = LLM(tiny_model(), speculative_config=spec, **engine_kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.last_stats
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "spec": dataclasses.asdict(stats.spec_decoding),
                "preemptions": stats.num_preemptions, "blocks_left": stats.kv_blocks_in_use}
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _prompts():
    rng = random.Random(7)
    base = [[rng.randrange(TINY.vocab_size) for _ in range(n)] for n in (5, 14, 23, 9)]
    return [*base, base[1] * 2, (base[0] + base[3]) * 2]


@functools.cache
def _reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return greedy_reference(tiny_model(), list(prompt), max_tokens)


ENGINES = {
    "roomy": dict(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=512),
    "chunked-prefill": dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12),
    "no-prefix-cache": dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12,
                            enable_prefix_caching=False),
    "preemption": dict(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_speculative_decoding_is_plain_greedy(engine):
    """Your pieces in the engine: every request's tokens are the no-cache reference's, some
    drafts were accepted and some rejected, and every block is free at the end."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    got = with_your_pieces(prompts, params, ENGINES[engine], NGRAM, beside=lab)
    for i, prompt in enumerate(prompts):
        want = _reference(tuple(prompt), 12)
        assert got["tokens"][i] == want, (
            f"{engine}: prompt {i} (length {len(prompt)}) with speculation gave "
            f"{got['tokens'][i]}, plain greedy gives {want}"
        )
    spec = got["spec"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], (
        f"{engine}: drafts must have been checked, some accepted and some rejected: {spec}"
    )
    assert got["blocks_left"] == 0, f"{engine}: {got['blocks_left']} blocks still held at the end"
    if engine == "preemption":
        assert got["preemptions"] > 0, "set-up: the cache was meant to be small enough to preempt"


def _planted_prompt():
    """``[a, b] + rest`` where ``a`` is the likely next token and, after ``a``, ``b``: prompt
    lookup (n = 1) then drafts ``b`` after a sampled ``a``, accepted often, not always."""
    found = planted_draft_prompt(_target, TINY.vocab_size)
    if found is None:
        pytest.fail("set-up: no prompt with a planted draft found")
    return found


def test_random_speculative_sampling_keeps_the_targets_distribution():
    """2,000 seeded requests of three tokens through your pieces: after ``a`` the engine checks
    the draft ``b``. The token after ``a``, and the one after that (the bonus after an accepted
    ``b``, the next step's after a rejection) follow the target's distributions (summed
    chi-square at the 0.1% level, fixed seeds)."""
    prompt, a, b = _planted_prompt()
    n = 2000
    spec = {**NGRAM, "num_speculative_tokens": 1, "prompt_lookup_max": 1}
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i) for i in range(n)]
    got = with_your_pieces([prompt] * n, params, dict(num_gpu_blocks=1024, max_num_seqs=256,
                                                     max_num_batched_tokens=2048), spec,
                           beside=lab)
    after_a = [t for t in got["tokens"] if t[0] == a]
    assert len(after_a) > n // 4 and got["spec"]["num_drafts"] >= len(after_a), (
        f"set-up: the draft after a={a} was meant to be checked ({len(after_a)} requests, "
        f"{got['spec']['num_drafts']} drafts)"
    )
    second = collections.Counter(t[1] for t in after_a)
    chi, df = chi_square(second, len(after_a) * _target([*prompt, a]))
    for accepted in (True, False):
        third = collections.Counter(t[2] for t in after_a if (t[1] == b) == accepted)
        expected = sum(m * _target([*prompt, a, x]) for x, m in second.items()
                       if (x == b) == accepted)
        c, d = chi_square(third, expected)
        chi, df = chi + c, df + d
    limit = chi_square_limit(df)
    assert chi < limit, (
        f"chi-square {chi:.1f} over {df} degrees of freedom (0.1% limit {limit:.1f}): the "
        "tokens emitted with speculation are not distributed as the target's"
    )

