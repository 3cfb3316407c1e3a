"""Speculative decoding's first pieces (issue 46): the n-gram proposer and the rejection sampler.

The proposer is held to what it promises (it only proposes continuations the context holds, the
longest match and the earliest occurrence of it), by properties over random token sequences and
by worked examples. The sampler is held to the distribution: every emitted token is distributed
as the target alone would sample it, checked exactly on small vocabularies (the acceptance test
over a grid of uniform draws, the recovered distribution as computed) and by a chi-square test
of the whole sampler.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.catalog import REPO_ROOT
from mini_vllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    accepts,
    recovered_distribution,
)
from mini_vllm.spec_decode.draft_policy import REMEASURE, DraftPolicy
from mini_vllm.spec_decode.ngram_proposer import NgramProposer, propose_ngram_tokens

# --- the n-gram proposer -------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, min_n, max_n, k, want", [
    ([5, 6, 7, 8, 5, 6, 7], 2, 2, 3, [8, 5, 6]),   # "6 7" seen before: what followed it
    ([5, 6, 7, 8, 5, 6, 7], 2, 2, 2, [8, 5]),      # at most k
    ([5, 6, 7, 8, 5, 6, 7], 1, 3, 9, [8, 5, 6, 7]),  # "5 6 7" is the longest; stops at the end
    ([5, 6, 7, 8, 5, 6, 9], 2, 2, 2, []),          # "6 9" never seen
    ([1, 4, 9, 2, 4, 3, 1, 2, 4], 1, 1, 2, [9, 2]),  # "4" seen twice: the earliest wins
    ([1, 4, 9, 2, 4, 3, 1, 2, 4], 2, 2, 3, [3, 1, 2]),  # "2 4" seen once
    ([3, 3, 3, 3], 1, 2, 5, [3, 3]),               # an occurrence may overlap the suffix
    ([7], 1, 1, 4, []),                            # nothing before the suffix
])
def test_the_proposer_continues_the_longest_earliest_match(tokens, min_n, max_n, k, want):
    assert propose_ngram_tokens(tokens, min_n, max_n, k, max_model_len=1024) == want


def test_the_proposal_never_runs_past_max_model_len():
    tokens = [5, 6, 7, 8, 5, 6, 7]
    assert propose_ngram_tokens(tokens, 2, 2, 3, max_model_len=9) == [8, 5]
    assert propose_ngram_tokens(tokens, 2, 2, 3, max_model_len=7) == []


def _matches(tokens: list[int], min_n: int, max_n: int) -> list[tuple[int, int]]:
    """Every (n, j): the last n tokens also occur starting at j, ending before the last token."""
    total = len(tokens)
    return [(n, j) for n in range(min_n, max_n + 1) for j in range(total)
            if n < total and j + n <= total - 1 and tokens[j:j + n] == tokens[total - n:]]


@given(tokens=st.lists(st.integers(0, 3), max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6), room=st.integers(0, 8))
def test_every_proposal_is_a_continuation_the_context_holds(tokens, min_n, extra, k, room):
    max_n = min_n + extra
    max_model_len = len(tokens) + room
    proposal = propose_ngram_tokens(tokens, min_n, max_n, k, max_model_len)
    matches = _matches(tokens, min_n, max_n)
    if not matches or room == 0:
        assert proposal == []
        return
    # The longest n that matches, then its earliest occurrence; the tokens that followed it.
    n, j = max(matches, key=lambda m: (m[0], -m[1]))
    start = j + n
    assert proposal == tokens[start:start + min(k, room)]
    assert 1 <= len(proposal) <= k and len(tokens) + len(proposal) <= max_model_len
    # What it proposes followed the same n-token ending, earlier in the sequence.
    assert tokens[j:j + n] == tokens[len(tokens) - n:]


def test_the_proposer_proposes_per_request_and_refuses_bad_settings():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=2,
                             max_model_len=64)
    assert proposer.propose([[5, 6, 5], [1, 2, 3], []]) == [[6, 5], [], []]
    for bad in ({"prompt_lookup_min": 0}, {"prompt_lookup_min": 4},
                {"num_speculative_tokens": 0}, {"max_model_len": True}):
        settings = dict(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=2,
                        max_model_len=64) | bad
        with pytest.raises(ValueError, match="NgramProposer: "):
            NgramProposer(**settings)


# --- the rejection sampler -----------------------------------------------------------------------

GRID = 4000  # uniform draws at the midpoints of 4000 equal steps: exact to 1/4000


def _acceptance(target_prob: float, draft_prob: float) -> float:
    """The share of uniform draws (a fine grid) for which the sampler accepts."""
    return sum(accepts(target_prob, draft_prob, (i + 0.5) / GRID) for i in range(GRID)) / GRID


def _emitted_distribution(p: torch.Tensor, q: torch.Tensor | None, draft: int | None = None):
    """The distribution of the first token emitted, from the sampler's own acceptance test and
    recovered distribution: over drafts drawn from q, or for one fixed draft (q is None)."""
    vocab = p.numel()
    drafts = [(draft, 1.0)] if q is None else [(d, float(q[d])) for d in range(vocab)]
    out = torch.zeros(vocab, dtype=torch.float64)
    for d, weight in drafts:
        accept = _acceptance(float(p[d]), 1.0 if q is None else float(q[d]))
        out[d] += weight * accept
        out += weight * (1 - accept) * recovered_distribution(p, q, d).double()
    return out


@pytest.mark.parametrize("seed", range(4))
def test_with_draft_probabilities_each_token_is_distributed_as_the_target(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(5, generator=g, dtype=torch.float64).pow(3)
    q = torch.rand(5, generator=g, dtype=torch.float64).pow(3)
    p, q = p / p.sum(), q / q.sum()
    assert torch.allclose(_emitted_distribution(p, q), p, atol=2 / GRID)


@pytest.mark.parametrize("draft", range(4))
def test_without_draft_probabilities_each_token_is_distributed_as_the_target(draft):
    """The n-gram proposer's tokens come with no distribution: q is one-hot at the draft."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    assert torch.allclose(_emitted_distribution(p, None, draft), p, atol=2 / GRID)


def test_the_recovered_distribution_is_the_normalised_excess_of_p_over_q():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(recovered_distribution(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(recovered_distribution(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    # p == q: a rejection cannot happen in exact arithmetic; if rounding makes one, draw from p.
    assert torch.allclose(recovered_distribution(p, p.clone(), 0), p)
    assert not accepts(0.3, 0.0, 0.0)  # a zero draft probability rejects instead of dividing


def test_the_whole_sampler_emits_the_targets_distribution():
    """Chi-square of the first emitted token over 6,000 seeded steps of the real sampler, drafts
    drawn from q (df = 3; 16.27 is the 0.1% point, so an honest sampler fails once in 1,000
    seeds, and this seed is fixed)."""
    p = torch.tensor([[0.45, 0.3, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    sampler, g = RejectionSampler(), torch.Generator().manual_seed(1234)
    counts = torch.zeros(4)
    lengths = []
    trials = 6000
    for _ in range(trials):
        drafts = [[int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]]
        out = sampler(drafts, p, [3], [False], draft_probs=q, generators=[g])
        (emitted,) = sampler.parse_output(out)
        counts[emitted[0]] += 1
        lengths.append(len(emitted))
    expected = trials * p[0]
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 16.27, (counts.tolist(), expected.tolist())
    # Accepting the first draft has probability sum(min(p, q)) = 0.55: then 2 or 3 tokens.
    assert abs(sum(n > 1 for n in lengths) / trials - 0.55) < 0.03
    assert set(lengths) == {1, 2, 3}


def test_greedy_accepts_while_the_draft_is_the_argmax_then_emits_the_argmax():
    p = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6],   # request 0: 3 drafts
                      [0.1, 0.1, 0.8]])                                     # request 1: 1 draft
    out = RejectionSampler()([[1, 0, 1], [2]], p, [9, 7], [True, True])
    assert out.tolist() == [[1, 0, 2, PLACEHOLDER_TOKEN_ID], [2, 7, PLACEHOLDER_TOKEN_ID,
                                                              PLACEHOLDER_TOKEN_ID]]
    assert RejectionSampler.parse_output(out) == [[1, 0, 2], [2, 7]]
    # No drafts: only the bonus token.
    assert RejectionSampler.parse_output(
        RejectionSampler()([[]], torch.zeros(0, 3), [4], [True])) == [[4]]


def test_a_seeded_request_emits_the_same_tokens_whatever_shares_its_batch():
    p = torch.tensor([[0.3, 0.3, 0.4], [0.5, 0.25, 0.25], [0.2, 0.5, 0.3]])
    alone = RejectionSampler()([[2, 0]], p[:2], [1], [False],
                               generators=[torch.Generator().manual_seed(7)])
    for others, greedy in itertools.product((0, 1), (True, False)):
        batch = [[1]] * others + [[2, 0]]
        rows = torch.cat([p[2:3]] * others + [p[:2]])
        out = RejectionSampler()(batch, rows, [0] * others + [1], [greedy] * others + [False],
                                 generators=[None] * others + [torch.Generator().manual_seed(7)])
        assert out[-1].tolist() == alone[0].tolist()


def test_bad_shapes_are_refused():
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match="one row per draft token"):
        sampler([[1, 2]], torch.zeros(1, 3), [0], [True])
    with pytest.raises(ValueError, match="draft_probs must have"):
        sampler([[1]], torch.zeros(1, 3), [0], [False], draft_probs=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="one bonus token"):
        sampler([[1]], torch.zeros(1, 3), [], [False])


# --- vLLM's own test of the matcher, read from the release at run time ---------------------------


def test_vllms_own_matcher_test_passes_against_ours(upstream_release, monkeypatch):
    """0.33's tests/v1/spec_decode/test_ngram.py checks the matcher with its own examples; its
    first test calls only the matcher, so it runs unchanged against propose_ngram_tokens (the
    second reaches into the numba proposer's buffers and thread counts, which mini_vllm has not).
    The file is read from the fetched release (CI fetches it; `python -m course refs --fetch`)."""
    _, src = upstream_release

    def matcher(origin_tokens, min_ngram, max_ngram, max_model_len, k):
        return np.array(propose_ngram_tokens([int(t) for t in origin_tokens], min_ngram,
                                             max_ngram, k, max_model_len), dtype=np.int64)

    def left_out(*args, **kwargs):
        raise NotImplementedError("mini_vllm has no VllmConfig-built proposer")

    fakes = {"vllm": {}, "vllm.v1": {}, "vllm.v1.spec_decode": {},
             "vllm.config": {"ModelConfig": left_out, "SpeculativeConfig": left_out,
                             "VllmConfig": left_out},
             "vllm.v1.spec_decode.ngram_proposer": {
                 "NgramProposer": left_out,
                 "_find_longest_matched_ngram_and_propose_tokens": matcher}}
    for name, attrs in fakes.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that its submodules import
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    path = src / "tests" / "v1" / "spec_decode" / "test_ngram.py"
    spec = importlib.util.spec_from_file_location("vllm_test_ngram", path)
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    upstream.test_find_longest_matched_ngram_and_propose_tokens()


# ----------------------------------------------------------------------------- the draft policy


def _policy(costs: dict[int, float], max_drafts: int = 4) -> DraftPolicy:
    policy = DraftPolicy(max_drafts)
    for rows, seconds in costs.items():
        policy.observe_step(rows, seconds)
    return policy


def test_the_policy_measures_a_plain_step_before_drafting_then_tries_the_longest_draft():
    policy = DraftPolicy(4)
    assert policy.num_drafts("r", 1) == 0, "the cost to beat is unknown: no drafts yet"
    policy.observe_step(1, 0.010)
    assert policy.num_drafts("r", 1) == 4, "longer steps not measured: assumed no dearer"
    assert policy.seconds(3) == 0.010 and policy.seconds(0) is None


def test_the_policy_drafts_where_acceptance_pays_for_the_extra_rows():
    # A CPU-like cost: each extra row adds 20% to the step.
    costs = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8}
    copying, writing = _policy(costs), _policy(costs)
    for _ in range(6):
        copying.observe_draft("r", 4, 4)  # every draft accepted
        writing.observe_draft("r", 4, 0)  # every draft rejected at once
    assert copying.num_drafts("r", 1) == 4
    assert writing.num_drafts("r", 1) == 0
    # A middling acceptance buys a middling draft: 3 of 5 accepted (with the prior, a = 3.5 / 6),
    # and 1 + a + ... + a^j over 1 + 0.2 j is best at j = 2 (1.32, 1.37, 1.33 for j = 1, 2, 3).
    middling = _policy(costs)
    for accepted in (1, 1, 1, 0, 0):
        middling.observe_draft("r", 1, accepted)
    assert middling.num_drafts("r", 1) == 2


def test_a_step_whose_extra_rows_cost_as_much_as_the_tokens_gain_drafts_nothing():
    # A quantized kernel with a fast one-row path: two rows cost twice one.
    policy = _policy({1: 1.0, 2: 2.0, 3: 2.1, 4: 2.2, 5: 2.3})
    for _ in range(6):
        policy.observe_draft("r", 4, 1)
    assert policy.num_drafts("r", 1) == 0


def test_a_request_that_stopped_drafting_tries_again_as_its_history_fades():
    policy = _policy({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4})
    for _ in range(4):
        policy.observe_draft("r", 4, 0)
    assert policy.num_drafts("r", 1) == 0
    for _ in range(15):  # steps without drafts
        policy.observe_step(1, 1.0)
    assert policy.num_drafts("r", 1) > 0
    policy.retain(set())
    assert policy.acceptance("r") == 0.5, "a finished request's history is forgotten"
    with pytest.raises(ValueError, match="max_drafts"):
        DraftPolicy(0)


def test_the_policy_measures_the_plain_step_again_while_it_drafts():
    """A plain step measured while the machine was busy makes drafting look cheap; a batch that
    drafts never runs the step that would correct it, so the policy runs one now and then."""
    policy = _policy({1: 3.0, 2: 1.3, 3: 1.6, 4: 1.9, 5: 2.2})  # the 3.0: a busy moment
    drafted = []
    for _ in range(2 * REMEASURE):
        n = policy.num_drafts("r", 1)
        drafted.append(n)
        policy.observe_step(1 + n, 1.0 + 0.3 * n)
        policy.observe_draft("r", n, 0) if n else None
    assert drafted[0] > 0 and 0 in drafted, drafted
    # Once measured again at its real cost, the plain step wins over drafts that fail.
    assert drafted[-1] == 0 and policy.seconds(1) < 2.0


def test_the_benchmark_runs_and_records_its_command(tmp_path, monkeypatch):
    """``benchmarks/spec_decode.py --quick`` (the shipped model): every speculating contender
    makes plain decoding's tokens (the script stops otherwise), and the JSON says how to rerun."""
    import json

    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from benchmarks import spec_decode

    out = tmp_path / "spec.json"
    assert spec_decode.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/spec_decode.py --quick")
    fp32 = dict(result["results"]["fp32"])
    costs = fp32.pop("step_ms_by_rows")
    assert sorted(int(rows) for rows in costs) == [1, 2, 3, 4, 5]
    assert all(ms > 0 for ms in costs.values())
    for task in fp32.values():
        assert set(task["contenders"]) == {"plain", "ngram (always)", "ngram (adaptive)",
                                           "draft model (always)", "draft model (adaptive)"}
