"""Graded tests of lab 03-04: the model runner's step and the engine step loop.

The model is a tiny randomly initialised Llama (two layers, 32 wide) with a large weight scale,
so its greedy choices are far from ties and the engine must reproduce, token for token, what a
plain full recomputation with no cache produces.

Groups, each using only its task and the ones before it:
  1. task 1: applying the scheduler's diff (new, cached, resumed, finished requests)
  2. task 2: batch order (kept from step to step, decodes first), input ids, positions, slots
  3. task 3: which requests sample, from which logits row, with which generator and bans
  4. task 4: your runner driven by hand with the reference scheduler: whole generations
     against the no-cache reference (chunked prefill, prefix caching, preemption by recompute
     and by swap), a step that schedules nothing, the output in batch order
  5. task 5: your EngineCore.step: the same generations through step(), seeded sampling,
     min_tokens, statistics, an idle step
  6. task 6: the beam score (length penalty over the whole sequence, a final EOS not counted)
     and the key that ranks beams by it
  7. task 7: the beam step and the final ranking on synthetic log-probability tables, against
     the brute-force search of course.engine.exam (with its own score, so these tests need
     only task 7)
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from course.engine.exam import beam_score, brute_force_beam_search
from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student
from mini_vllm.config import SchedulerConfig, SpeculativeConfig
from mini_vllm.core.sched.scheduler import Scheduler as ReferenceScheduler
from mini_vllm.model_executor.models.llama import (
    LlamaForCausalLM,
    ModelConfig,
    greedy_reference,
    init_weights,
)
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
)
MAX_TOKENS = 8


@functools.lru_cache(maxsize=1)
def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(TINY)
    init_weights(model, seed=1, std=0.5)
    return model.eval().requires_grad_(False)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    out = [[rng.randrange(TINY.vocab_size) for _ in range(n)] for n in (3, 14, 23, 9)]
    out.append(out[2][:16] + [5, 6])  # shares four 4-token blocks with prompt 2
    return out


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    return greedy_reference(tiny_model(), list(prompt), max_tokens)


def step_until_done(engine, max_steps=2000):
    """Step until every request finished; a runner that never lets them finish fails the test
    (instead of hanging it)."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    pytest.fail(f"the engine did not finish within {max_steps} steps; does step() progress?")


# The lab's engines and runners are made where the lab's code runs, on the tiny model: the
# model is the test's own object there too (that process is a fork of this one), where a model
# handed across would be a handle whose every forward pass runs back here.


@beside_the_student
def _new_engine(config):
    return lab.EngineCore(tiny_model(), lab.SchedulerConfig(**config), eos_token_id=None)


@beside_the_student
def _make_runner(kw):
    return lab.ModelRunner(tiny_model(), **kw)


def new_engine(**config):
    """A fresh ``lab.EngineCore`` on the tiny model, no EOS."""
    return _new_engine(config, beside=lab)


def make_runner(**kw):
    """A fresh ``lab.ModelRunner`` on the tiny model (blocks of 4, 32 of them unless told)."""
    kw.setdefault("num_gpu_blocks", 32)
    kw.setdefault("block_size", 4)
    return _make_runner(kw, beside=lab)


def run_engine(prompt_list, params, max_steps=2000, **config):
    """Add every prompt to a fresh ``lab.EngineCore`` and step until all finish."""
    engine = new_engine(**config)
    reqs = []
    for i, p in enumerate(prompt_list):
        p_i = params[i] if isinstance(params, list) else params
        reqs.append(engine.make_request(f"r{i}", p, p_i))
        engine.add_request(reqs[-1])
    step_until_done(engine, max_steps)
    return engine, [list(r.output_token_ids) for r in reqs]


@beside_the_student
def _append_token(runner, req_id, token):
    """Append ``token`` to the runner's record of ``req_id`` (a sample of an earlier step), in
    the record itself: a list read from the lab's objects is a copy."""
    runner.requests[req_id].token_ids.append(token)


def append_token(runner, req_id, token):
    _append_token(runner, req_id, token, beside=lab)


def run_by_hand(prompt_list, params, spec=None, **config):
    """Your runner with the reference scheduler, the engine loop written out (no step()); with
    ``spec`` (a SpeculativeConfig), the drafts your runner proposes go to the scheduler after
    each step, as the engine's post_step hands them over."""
    config = SchedulerConfig(**config)
    scheduler = ReferenceScheduler(config)
    spec_kw = {} if spec is None else {"speculative_config": spec,
                                       "max_model_len": config.max_model_len}
    runner = make_runner(block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks,
                         num_cpu_blocks=config.num_cpu_blocks, **spec_kw)
    requests = []
    from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
    from mini_vllm.request import Request

    hasher = get_request_block_hasher(config.block_size, sha256)
    for i, p in enumerate(prompt_list):
        requests.append(Request(f"r{i}", list(p), params, None, block_hasher=hasher))
        scheduler.add_request(requests[-1])
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        mro = runner.execute_model(so)
        assert mro.req_ids == runner.batch_req_ids or so.total_num_scheduled_tokens == 0, (
            f"execute_model's output lists requests {mro.req_ids}, the runner's batch is "
            f"{runner.batch_req_ids}: the output follows the batch order"
        )
        scheduler.update_from_output(so, mro)
        drafts = runner.take_draft_token_ids() if spec is not None else None
        if drafts is not None:
            scheduler.update_draft_token_ids(drafts)
    else:
        pytest.fail("the run did not finish within 2000 steps")
    return scheduler, runner, [list(r.output_token_ids) for r in requests]


def sched_output(new=(), cached=None, num_scheduled=None, finished=()):
    cached = cached or lab.CachedRequestData.make_empty()
    num_scheduled = dict(num_scheduled or {})
    return lab.SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        num_common_prefix_blocks=[0],
        finished_req_ids=set(finished),
    )


def new_req(rid, tokens, blocks, computed=0):
    return lab.NewRequestData(
        req_id=rid, prompt_token_ids=list(tokens),
        sampling_params=lab.SamplingParams(temperature=0.0), block_ids=(list(blocks),),
        num_computed_tokens=computed,
    )


def cached_reqs(*entries):
    """entries: (req_id, resumed, new_block_ids or None, num_computed_tokens)."""
    data = lab.CachedRequestData.make_empty()
    for rid, resumed, blocks, computed in entries:
        data.req_ids.append(rid)
        data.resumed_from_preemption.append(resumed)
        data.new_token_ids.append([])
        data.new_block_ids.append(None if blocks is None else (list(blocks),))
        data.num_computed_tokens.append(computed)
    return data


# ----------------------------------------------------------------------------- task 1


def test_update_states_tracks_new_cached_resumed_and_finished_requests():
    runner = make_runner()
    runner._update_states(sched_output(new=[new_req("a", range(1, 7), [1, 2])]))
    a = runner.requests["a"]  # read again after each step: a record read is a copy
    assert a.token_ids == [1, 2, 3, 4, 5, 6] and a.block_ids == [1, 2], (
        f"new request a: want tokens [1..6], blocks [1, 2], got {a.token_ids}, {a.block_ids}: "
        "give each scheduled_new_reqs entry self._new_request_state(new)")
    assert a.num_computed_tokens == 0, (
        f"new request a: num_computed_tokens is the scheduler's 0, got {a.num_computed_tokens}")

    runner._update_states(sched_output(cached=cached_reqs(("a", False, [3], 6))))
    a = runner.requests["a"]
    assert a.block_ids == [1, 2, 3], "new block ids of a running request are appended"
    assert a.num_computed_tokens == 6, "take num_computed_tokens from the scheduler each step"

    runner._update_states(sched_output(cached=cached_reqs(("a", False, None, 7))))
    a = runner.requests["a"]
    assert a.block_ids == [1, 2, 3] and a.num_computed_tokens == 7, (
        "new_block_ids None means no new block: want blocks [1, 2, 3], computed 7, got "
        f"{a.block_ids}, {a.num_computed_tokens}")

    runner._update_states(sched_output(cached=cached_reqs(("a", True, [9, 8], 0))))
    a = runner.requests["a"]
    assert a.block_ids == [9, 8], "a request resumed after preemption gets a new table"
    assert a.num_computed_tokens == 0, (
        "a resumed request takes the scheduler's num_computed_tokens (0), got "
        f"{a.num_computed_tokens}")

    runner._update_states(sched_output(finished=["a"]))
    assert "a" not in runner.requests, "finished requests must be forgotten"


def test_update_states_edge_cases():
    """An unknown finished id is ignored; a new request starts from its prefix-cache hit; a
    resumed request without blocks gets an empty table; the runner's own tokens are kept."""
    runner = make_runner()
    runner._update_states(sched_output(
        new=[new_req("a", range(1, 10), [1, 2, 3], computed=8), new_req("b", [4, 5], [4])],
        finished=["never-seen"],
    ))
    assert runner.requests["a"].num_computed_tokens == 8, (
        "a new request starts at its prefix-cache hit: num_computed_tokens 8, got "
        f"{runner.requests['a'].num_computed_tokens}: take it from the NewRequestData")
    append_token(runner, "b", 33)
    runner._update_states(sched_output(
        cached=cached_reqs(("b", True, None, 0), ("a", False, [5], 9)), finished=["ghost"],
    ))
    assert runner.requests["b"].block_ids == [] and runner.requests["b"].num_computed_tokens == 0, (
        "b resumed with new_block_ids None: want an empty table and 0 computed, got "
        f"{runner.requests['b'].block_ids}, {runner.requests['b'].num_computed_tokens}")
    assert runner.requests["b"].token_ids == [4, 5, 33], "the runner's samples are kept"
    assert runner.requests["a"].block_ids == [1, 2, 3, 5], (
        "a running request's new block ids [5] are appended: want [1, 2, 3, 5], got "
        f"{runner.requests['a'].block_ids}")
    assert runner.requests["a"].num_computed_tokens == 9, (
        "take num_computed_tokens from the scheduler (9), got "
        f"{runner.requests['a'].num_computed_tokens}")
    # finished and new in one step: the old record goes, the new one is the new request's
    runner._update_states(sched_output(new=[new_req("c", [7], [6])], finished=["a", "b"]))
    assert sorted(runner.requests) == ["c"], (
        "finished a, b must go and new c come in the same step: want ['c'], got "
        f"{sorted(runner.requests)}")


# ----------------------------------------------------------------------------- task 2


def test_prepare_inputs_orders_decodes_first_and_slices_each_request():
    runner = make_runner()
    runner._update_states(sched_output(new=[new_req("a", [10, 11, 12, 13, 14, 15], [1, 2])]))
    append_token(runner, "a", 16)  # "a" has sampled one token: now it decodes
    runner._update_states(sched_output(
        new=[new_req("b", [20, 21, 22, 23, 24], [5, 6])],
        cached=cached_reqs(("a", False, None, 6)),
    ))
    so = sched_output(
        new=[new_req("b", [20, 21, 22, 23, 24], [5, 6])],
        cached=cached_reqs(("a", False, None, 6)),
        num_scheduled={"b": 3, "a": 1},
    )
    input_ids, meta = runner._prepare_inputs(so)
    assert meta.req_ids == ["a", "b"], "decodes first"
    assert runner.batch_req_ids == ["a", "b"], (
        "self.batch_req_ids must be this step's batch order ['a', 'b'], got "
        f"{runner.batch_req_ids}")
    assert input_ids.dtype == torch.long, (
        f"input_ids must be int64 (torch.long), got {input_ids.dtype}")
    assert input_ids.tolist() == [16, 20, 21, 22], (
        "input_ids: a's 1 token from its num_computed_tokens (16), then b's first 3: want "
        f"[16, 20, 21, 22], got {input_ids.tolist()}")
    assert meta.positions.tolist() == [6, 0, 1, 2], (
        f"positions: want [6, 0, 1, 2], got {meta.positions.tolist()}: pass each record's "
        "num_computed_tokens to build_attention_metadata")
    # a: position 6 -> block table [1, 2], block 1 (id 2), offset 2 -> slot 10.
    assert meta.slot_mapping.tolist() == [10, 20, 21, 22], (
        f"slot_mapping: want [10, 20, 21, 22], got {meta.slot_mapping.tolist()}: pass each "
        "record's block_ids to build_attention_metadata")

    # Next step: b continues its prefill at position 3 (the chunk after the first three).
    runner._update_states(sched_output(cached=cached_reqs(("b", False, None, 3))))
    so = sched_output(cached=cached_reqs(("b", False, None, 3)), num_scheduled={"b": 2})
    input_ids, meta = runner._prepare_inputs(so)
    assert input_ids.tolist() == [23, 24], (
        "b's second chunk starts at its num_computed_tokens 3: want input_ids [23, 24], got "
        f"{input_ids.tolist()}")
    assert meta.positions.tolist() == [3, 4], (
        f"b's second chunk: want positions [3, 4], got {meta.positions.tolist()}")
    assert meta.context_lens.tolist() == [3], (
        f"b's second chunk: want context_lens [3], got {meta.context_lens.tolist()}")
    assert runner.batch_req_ids == ["b"], "only the scheduled requests"


def test_batch_order_is_kept_from_the_previous_step_then_made_decodes_first():
    """The previous batch was ["c", "x", "a"]; now "a" and "b" decode, "c" and "d" prefill,
    "x" is not scheduled. Kept order first, then newcomers in scheduled order: [c, a, d, b];
    then decodes first with the fewest moves: "b" swaps places with "c": [b, a, d, c]."""
    runner = make_runner()
    runner._update_states(sched_output(new=[
        new_req("a", [1, 2, 3, 4], [1, 2]), new_req("c", [5, 6, 7, 8, 9, 10], [3, 4]),
        new_req("x", [11], [5]),
    ]))
    append_token(runner, "a", 40)  # "a" decodes position 4
    runner.batch_req_ids = ["c", "x", "a"]
    new = [new_req("d", [12, 13], [6]), new_req("b", [14], [7])]
    cached = cached_reqs(("a", False, None, 4), ("c", False, None, 3))
    runner._update_states(sched_output(new=new, cached=cached))
    so = sched_output(new=new, cached=cached, num_scheduled={"a": 1, "b": 1, "c": 3, "d": 2})
    assert so.scheduled_req_ids == ["d", "b", "a", "c"], (
        "test premise: SchedulerOutput.scheduled_req_ids should be new then cached, got "
        f"{so.scheduled_req_ids}")
    input_ids, meta = runner._prepare_inputs(so)
    assert meta.req_ids == ["b", "a", "d", "c"], (
        "want batch ['b', 'a', 'd', 'c'] (kept order c, a, newcomers d, b, then "
        f"reorder_batch_to_split_decodes_and_prefills), got {meta.req_ids}")
    assert runner.batch_req_ids == ["b", "a", "d", "c"], (
        "self.batch_req_ids must be the reordered batch ['b', 'a', 'd', 'c'], got "
        f"{runner.batch_req_ids}")
    assert input_ids.tolist() == [14, 40, 12, 13, 8, 9, 10], (
        "input_ids in batch order [b, a, d, c], each from its num_computed_tokens: want "
        f"[14, 40, 12, 13, 8, 9, 10], got {input_ids.tolist()}")
    assert meta.positions.tolist() == [0, 4, 0, 1, 3, 4, 5], (
        f"positions in batch order: want [0, 4, 0, 1, 3, 4, 5], got {meta.positions.tolist()}")
    assert runner.requests["a"].token_ids == [1, 2, 3, 4, 40], "preparing changes no record"


# ----------------------------------------------------------------------------- task 3


def test_sample_uses_the_last_row_and_skips_requests_mid_prefill():
    runner = make_runner()
    runner._update_states(sched_output(new=[
        new_req("a", [1, 2, 3], [1]), new_req("b", [4, 5, 6, 7, 8], [2, 3]),
        new_req("c", [9, 10, 11, 12], [4]),
    ]))
    # a and c finish their prompts this step; b computes 3 of its 5 tokens.
    meta = lab.build_attention_metadata(
        ["a", "b", "c"], {"a": 3, "b": 3, "c": 4}, {"a": 0, "b": 0, "c": 0},
        {"a": [1], "b": [2, 3], "c": [4]}, 4,
    )
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, TINY.hidden_size, generator=gen)
    sampled = runner._sample(hidden, meta)
    logits = tiny_model().compute_logits(hidden)
    want_a, want_c = int(logits[2].argmax()), int(logits[9].argmax())
    assert sampled == [[want_a], [], [want_c]], (
        f"want [[{want_a}], [], [{want_c}]] (a and c from their last rows 2 and 9, b "
        f"mid-prefill samples nothing), got {sampled}")
    assert runner.requests["a"].token_ids == [1, 2, 3, want_a], (
        f"a's sampled token is appended to its record: want [1, 2, 3, {want_a}], got "
        f"{runner.requests['a'].token_ids}")
    assert runner.requests["b"].token_ids == [4, 5, 6, 7, 8], "no token mid-prefill"
    assert runner.requests["c"].token_ids == [9, 10, 11, 12, want_c], (
        f"c's sampled token is appended to its record: want [9, 10, 11, 12, {want_c}], got "
        f"{runner.requests['c'].token_ids}")


def test_sample_hands_its_rows_to_the_given_logprob_gathering():
    """Request "c" asks for 2 log-probabilities, "a" for none, "b" is mid-prefill: only "c" gets
    a row, with its sampled token first and the log_softmax of its own logits row."""
    runner = make_runner()
    runner._update_states(sched_output(new=[
        new_req("a", [1, 2, 3], [1]), new_req("b", [4, 5, 6, 7, 8], [2, 3]),
        _seeded("c", [9, 10, 11, 12], [4], temperature=0.0, logprobs=2),
    ]))
    meta = lab.build_attention_metadata(
        ["a", "b", "c"], {"a": 3, "b": 3, "c": 4}, {"a": 0, "b": 0, "c": 0},
        {"a": [1], "b": [2, 3], "c": [4]}, 4,
    )
    hidden = torch.randn(10, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    sampled = runner._sample(hidden, meta)
    assert list(runner.step_logprobs) == ["c"], (
        "only \"c\" asks for logprobs: after drawing, pass the sampling rows' logits, their "
        "states and the drawn tokens to self._gather_sample_logprobs(logits, states, tokens)")
    want = torch.log_softmax(tiny_model().compute_logits(hidden[9:10]).double(), -1)[0]
    (ids,), (values,), _ = runner.step_logprobs["c"]
    assert ids[0] == sampled[2][0] and ids[1:] == want.topk(2).indices.tolist(), (
        f"c's logprob ids {ids}: want its drawn token {sampled[2]} then the top 2 "
        f"{want.topk(2).indices.tolist()} of its last row (9): pass the sampling rows' logits")
    assert values == pytest.approx(want[ids].tolist(), abs=1e-4), (
        f"c's log-probabilities {[round(v, 4) for v in values]} are not the log_softmax of "
        "its own logits row (row 9): pass _gather_sample_logprobs the sampling rows' logits")


def test_sample_logprobs_are_the_drawn_tokens_not_the_likeliest():
    """A hot, seeded request draws a token other than the most likely one: the log-probability
    recorded first is the drawn token's (greedy requests cannot tell the two apart)."""
    runner = make_runner()
    runner._update_states(sched_output(new=[
        _seeded("h", [9, 10, 11, 12], [4], temperature=5.0, seed=3, logprobs=1)]))
    meta = lab.build_attention_metadata(["h"], {"h": 4}, {"h": 0}, {"h": [4]}, 4)
    hidden = torch.randn(4, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    sampled = runner._sample(hidden, meta)
    want = torch.log_softmax(tiny_model().compute_logits(hidden[3:4]).double(), -1)[0]
    token = sampled[0][0]
    assert token != int(want.argmax()), "this seed must draw a token other than the argmax"
    (ids,), (values,), _ = runner.step_logprobs["h"]
    assert ids[0] == token, (
        f"the first log-probability is of token {ids[0]}, but the request drew {token}: pass "
        "the sampler's drawn tokens to self._gather_sample_logprobs, not the likeliest ones")
    assert values[0] == pytest.approx(float(want[token]), abs=1e-4), (
        f"drawn token {token}: log-probability {values[0]:.4f}, want {float(want[token]):.4f}, "
        "the log_softmax of its last row's raw logits (row 3, before temperature)")


def _seeded(rid, tokens, blocks, **params):
    return lab.NewRequestData(
        req_id=rid, prompt_token_ids=list(tokens),
        sampling_params=lab.SamplingParams(**params), block_ids=(list(blocks),),
        num_computed_tokens=0,
    )


def test_a_seeded_request_draws_from_its_own_generator_only_when_it_samples():
    """Runner A sees the seeded request "s" in two chunks, beside another random request;
    runner B sees it in one step, alone. Its token comes from its own generator, and the chunk
    that samples nothing draws nothing: A and B sample the same token."""
    params = dict(temperature=1.0, seed=1234)
    hidden = torch.randn(8, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    a = make_runner()
    a._update_states(sched_output(new=[
        new_req("o", [1, 2], [1]), _seeded("s", [3, 4, 5, 6, 7], [2, 3], **params),
    ]))
    a.requests["o"].sampling_params = lab.SamplingParams(temperature=1.0)
    meta = lab.build_attention_metadata(["o", "s"], {"o": 2, "s": 3}, {"o": 0, "s": 0},
                                        {"o": [1], "s": [2, 3]}, 4)
    assert a._sample(hidden[:5], meta)[1] == [], (
        "s computes 3 of its 5 prompt tokens: it samples nothing ([]) in this step")
    a.requests["s"].num_computed_tokens = 3
    meta = lab.build_attention_metadata(["s"], {"s": 2}, {"s": 3}, {"s": [2, 3]}, 4)
    token_a = a._sample(hidden[5:7], meta)
    b = make_runner()
    b._update_states(sched_output(new=[_seeded("s", [3, 4, 5, 6, 7], [2, 3], **params)]))
    meta = lab.build_attention_metadata(["s"], {"s": 5}, {"s": 0}, {"s": [2, 3]}, 4)
    rows = torch.cat([hidden[:3], hidden[5:7]])
    token_b = b._sample(rows, meta)
    assert token_a == token_b, (
        f"seeded s drew {token_a} in two chunks beside another request, {token_b} alone: sample "
        "only when it reaches its last token, from that row, with its own state.generator")


def test_min_tokens_bans_the_stop_tokens_while_it_holds():
    """Greedy: the row's best token is a stop token, and the request has fewer output tokens
    than min_tokens, so it gets the second best; once min_tokens is reached, the best."""
    hidden = torch.randn(1, TINY.hidden_size, generator=torch.Generator().manual_seed(5))
    order = tiny_model().compute_logits(hidden)[0].argsort(descending=True).tolist()
    best, second = order[0], order[1]
    runner = make_runner()
    runner._update_states(sched_output(new=[_seeded(
        "r", [9], [1], temperature=0.0, min_tokens=2, stop_token_ids=[best])]))
    meta = lab.build_attention_metadata(["r"], {"r": 1}, {"r": 0}, {"r": [1]}, 4)
    assert runner._sample(hidden, meta) == [[second]], (
        f"min_tokens 2 not reached: stop token {best} must be banned, want [[{second}]]: pass "
        "self._stop_token_ids(state) as the banned tokens")
    assert runner.requests["r"].token_ids == [9, second], (
        f"the sampled token is appended to the record: want [9, {second}], got "
        f"{runner.requests['r'].token_ids}")
    append_token(runner, "r", second)  # 2 output tokens: min_tokens is reached
    meta = lab.build_attention_metadata(["r"], {"r": 1}, {"r": 2}, {"r": [1]}, 4)
    assert runner._sample(hidden, meta) == [[best]], (
        f"min_tokens reached: stop token {best} is allowed again, want [[{best}]]: ban "
        "self._stop_token_ids(state) of this step, not the stop tokens always")


# ----------------------------------------------------------------------------- task 4

CONFIGS = {
    "roomy": dict(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=256),
    "chunked-prefill": dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=10),
    "preempt-recompute": dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=12),
    "preempt-swap": dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=12,
                         preemption_mode="swap", num_cpu_blocks=48),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_your_runner_with_the_reference_loop_equals_full_recomputation(name):
    """The engine loop written out (schedule, your execute_model, update): greedy output equals
    a plain recomputation with no cache, in every configuration."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    scheduler, runner, outputs = run_by_hand(prompts(), params, **CONFIGS[name])
    for i, (got, p) in enumerate(zip(outputs, prompts())):
        want = reference(tuple(p))
        assert got == want, f"{name}: prompt {i} (length {len(p)}): got {got}, want {want}"
    if name.startswith("preempt"):
        assert scheduler.stats.num_preemptions > 0, "this configuration is meant to preempt"
    if name == "preempt-swap":
        assert runner.stats.num_blocks_swapped_in > 0, (
            f"{name}: the runner swapped no block back in: does execute_model call "
            "self._execute_block_ops(scheduler_output)?")
    assert runner.stats.num_forward_passes == scheduler.stats.num_steps, (
        f"{name}: {runner.stats.num_forward_passes} forward passes over "
        f"{scheduler.stats.num_steps} scheduler steps: one model run, one self._account(meta) each")
    assert runner.stats.num_tokens_computed > 0, (
        f"{name}: no token counted as computed: call self._account(meta) when the model runs")


def test_your_runner_checks_drafts_and_proposes_the_next_ones():
    """Speculative decoding (phase 04) through your execute_model, with the given
    _stage_drafts, _sample_with_drafts and _propose_drafts in their places: greedy output still
    equals full recomputation, and the drafts were proposed and checked, some accepted, some
    rejected."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             draft_policy="always")
    # A prompt, its own greedy continuation, the prompt again: prompt lookup then proposes
    # that continuation, which the model partly repeats.
    repeating = [p + reference(tuple(p)) + p for p in prompts()[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    scheduler, runner, outputs = run_by_hand(repeating, params, spec=spec, block_size=4,
                                             num_gpu_blocks=128, max_num_batched_tokens=24)
    for i, (got, p) in enumerate(zip(outputs, repeating)):
        want = reference(tuple(p), 12)
        assert got == want, f"prompt {i} (length {len(p)}) with drafts: got {got}, want {want}"
    stats = scheduler.spec_decoding_stats
    assert stats.num_drafts > 0, (
        "no draft was ever checked: does execute_model call self._stage_drafts(scheduler_output) "
        "before _prepare_inputs, and self._propose_drafts(meta, sampled, drafts) after sampling?")
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (
        f"drafts checked, but {stats.num_accepted_tokens} of {stats.num_draft_tokens} accepted: "
        "with drafts, sample with self._sample_with_drafts(hidden, meta, drafts)")


def test_a_step_that_schedules_nothing_still_applies_the_diff_and_the_copies():
    """No token is scheduled, but a request finished and another is swapped out: the runner
    forgets the first, copies the second's blocks to the CPU, runs no model, returns nothing."""
    runner = make_runner(num_cpu_blocks=4)
    runner._update_states(sched_output(new=[new_req("a", [1, 2, 3], [1]),
                                            new_req("b", [4, 5, 6, 7, 8], [2, 3])]))
    key, value = runner.kv_caches[0]
    key[2].fill_(1.5)
    value[3].fill_(-2.0)
    so = sched_output(finished=["a"])
    so.blocks_to_swap_out = [(2, 1), (3, 2)]
    out = runner.execute_model(so)
    assert out.req_ids == [] and out.sampled_token_ids == [] and out.req_id_to_index == {}, (
        "a step with no token scheduled returns an empty ModelRunnerOutput, got ids "
        f"{out.req_ids}, tokens {out.sampled_token_ids}, index {out.req_id_to_index}")
    assert "a" not in runner.requests and "b" in runner.requests, (
        "with no token scheduled the diff still applies: want a gone, b kept, got "
        f"{sorted(runner.requests)}")
    cpu_key, cpu_value = runner.cpu_kv_caches[0]
    assert torch.equal(cpu_key[1], key[2]) and torch.equal(cpu_value[2], value[3]), (
        "b's blocks 2, 3 were not swapped out to CPU blocks 1, 2: call "
        "self._execute_block_ops(so) also when nothing is scheduled")
    assert runner.stats.num_forward_passes == 0 and runner.stats.num_blocks_swapped_out == 2, (
        "want 0 forward passes and 2 blocks swapped out, got "
        f"{runner.stats.num_forward_passes} and {runner.stats.num_blocks_swapped_out}")


def test_execute_model_answers_in_batch_order():
    runner = make_runner()
    new = [new_req("p", list(range(1, 8)), [1, 2]), new_req("q", [9], [3])]
    so = sched_output(new=new, num_scheduled={"p": 7, "q": 1})
    out = runner.execute_model(so)
    assert out.req_ids == ["q", "p"] == runner.batch_req_ids, "decodes (one token) first"
    assert out.req_id_to_index == {"q": 0, "p": 1}, (
        f"req_id_to_index maps each id to its batch position: want {{'q': 0, 'p': 1}}, got "
        f"{out.req_id_to_index}")
    assert [len(t) for t in out.sampled_token_ids] == [1, 1], (
        "q and p both finish their prompts and sample one token each, got "
        f"{out.sampled_token_ids}")
    assert runner.requests["p"].token_ids[-1] == out.sampled_token_ids[1][0], (
        f"p's record ends with {runner.requests['p'].token_ids[-1:]}, the output says "
        f"{out.sampled_token_ids[1]}: append each sampled token to its record")
    assert out.sampled_token_ids[1] == [reference(tuple(range(1, 8)), 1)[0]], (
        f"p's token: want {[reference(tuple(range(1, 8)), 1)[0]]} (greedy after its 7-token "
        f"prompt), got {out.sampled_token_ids[1]}: sample p from its last token's row")
    assert runner.stats.num_forward_passes == 1 and runner.stats.num_tokens_computed == 8, (
        "one step over 8 tokens: want 1 forward pass and 8 tokens, got "
        f"{runner.stats.num_forward_passes} and {runner.stats.num_tokens_computed}")


def test_execute_model_attaches_the_steps_logprobs():
    """A request asking for logprobs and prompt_logprobs gets both in the output, through the
    given self._with_logprobs, and they wait in the runner for LLM (take_logprobs)."""
    runner = make_runner()
    prompt = list(range(1, 8))
    new = [_seeded("p", prompt, [1, 2], temperature=0.0, logprobs=3, prompt_logprobs=1),
           new_req("q", [9], [3])]
    out = runner.execute_model(sched_output(new=new, num_scheduled={"p": 7, "q": 1}))
    assert sorted(out.logprobs) == ["p"] and sorted(out.prompt_logprobs_dict) == ["p"], (
        "return self._with_logprobs(output, hidden, meta) from execute_model")
    want = torch.log_softmax(tiny_model().forward_reference(torch.tensor(prompt)).double(), -1)
    (ids,), (values,), _ = out.logprobs["p"]
    assert ids[0] == out.sampled_token_ids[1][0] and len(ids) == 4, (
        f"p asked for 3 logprobs: want its drawn token {out.sampled_token_ids[1]} then 3 more, "
        f"got ids {ids}")
    assert values == pytest.approx(want[-1, ids].tolist(), abs=1e-4), (
        f"p's log-probabilities {[round(v, 4) for v in values]} are not the log_softmax of "
        "its last prompt row's logits")
    first, rows = out.prompt_logprobs_dict["p"]
    assert first == 1 and [r[0] for r in rows.logprob_token_ids] == prompt[1:], (
        f"p's prompt logprobs: want first position 1 and tokens {prompt[1:]}, got {first}, "
        f"{[r[0] for r in rows.logprob_token_ids]}: pass the whole hidden and meta")
    sample, prompt_rows = runner.take_logprobs()
    assert list(sample) == ["p"] and list(prompt_rows) == ["p"], (
        f"take_logprobs() gave ids {list(sample)}, {list(prompt_rows)}, want ['p'] each: "
        "return self._with_logprobs(output, hidden, meta) from execute_model")


# ----------------------------------------------------------------------------- task 5


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_equals_full_recomputation(name):
    params = lab.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine, outputs = run_engine(prompts(), params, **CONFIGS[name])
    for i, (got, p) in enumerate(zip(outputs, prompts())):
        want = reference(tuple(p))
        assert got == want, f"{name}: prompt {i} (length {len(p)}): got {got}, want {want}"
    stats = engine.scheduler.stats
    if name.startswith("preempt"):
        assert stats.num_preemptions > 0, "this configuration is meant to preempt"
    if name == "preempt-swap":
        assert stats.num_blocks_swapped_in > 0, (
            "preempt-swap: the scheduler swapped no block back in "
            f"({stats.num_blocks_swapped_in}); this configuration is meant to swap out and back in")
    if name == "chunked-prefill":
        assert engine.prefix_cache_hits > 0, "call self._record_stats() in step()"


def test_finished_requests_leave_the_runner():
    params = lab.SamplingParams(temperature=0.0, max_tokens=3)
    engine = new_engine(block_size=4, num_gpu_blocks=32)
    first = engine.make_request("first", prompts()[0], params)
    engine.add_request(first)
    step_until_done(engine)
    second = engine.make_request("second", prompts()[1], params)
    engine.add_request(second)
    step_until_done(engine)
    assert list(second.output_token_ids) == reference(tuple(prompts()[1]), 3), (
        f"second request after the first finished: got {list(second.output_token_ids)}, want "
        f"{reference(tuple(prompts()[1]), 3)}")
    assert "first" not in engine.model_runner.requests, (
        "the finished request 'first' is still in the runner: _update_states must drop "
        "every id of finished_req_ids")


def test_step_without_requests_does_nothing():
    engine = new_engine(block_size=4, num_gpu_blocks=8)
    assert engine.step() == [], (
        "step() with no unfinished request must return [] and do nothing else")
    assert engine.scheduler.stats.num_steps == 0, (
        "an idle step must not call schedule(): the scheduler counted "
        f"{engine.scheduler.stats.num_steps} steps")
    assert engine.model_runner.stats.num_forward_passes == 0, (
        f"an idle step runs no model: got {engine.model_runner.stats.num_forward_passes} "
        "forward passes")


def test_step_returns_the_news_and_records_the_statistics():
    """One step per call: it returns update_from_output's outputs (the new tokens, and which
    requests finished), and the engine's counters follow (prefix-cache hits, peak blocks)."""
    params = lab.SamplingParams(temperature=0.0, max_tokens=2)
    engine = new_engine(block_size=4, num_gpu_blocks=32)
    p = prompts()[2]
    engine.add_request(engine.make_request("a", p, params))
    want = reference(tuple(p), 2)
    outputs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs] == [("a", want[:1],
                                                                                False)], (
        f"first step: want [('a', {want[:1]}, False)], got "
        f"{[(o.request_id, o.new_token_ids, o.finished) for o in outputs]}: return "
        "update_from_output's outputs")
    assert engine.scheduler.stats.num_steps == 1, (
        "one step() calls schedule() once, the scheduler counted "
        f"{engine.scheduler.stats.num_steps} steps")
    assert engine.model_runner.stats.num_forward_passes == 1, (
        f"one step() runs the model once, got {engine.model_runner.stats.num_forward_passes} "
        "forward passes")
    assert engine.peak_blocks_in_use == 6, (  # 23 prompt tokens + 1 = 6 blocks of 4
        "peak_blocks_in_use should be 6 (24 tokens in blocks of 4), got "
        f"{engine.peak_blocks_in_use}: does step() call self._record_stats()?")
    outputs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs] == [("a", want[1:],
                                                                                True)], (
        f"second step: want [('a', {want[1:]}, True)], got "
        f"{[(o.request_id, o.new_token_ids, o.finished) for o in outputs]}: return "
        "update_from_output's outputs")
    engine.add_request(engine.make_request("b", p, params))  # the same prompt: 5 blocks hit
    engine.step()
    assert engine.prefix_cache_hits == 20, (
        f"the same prompt again hits 5 full blocks (20 tokens), got {engine.prefix_cache_hits}"
        ": does step() call self._record_stats() after every step?")
    assert engine.prefix_cache_queries == 2 * 23, (
        "two 23-token prompts make 46 prefix-cache queries, got "
        f"{engine.prefix_cache_queries}: does step() call self._record_stats() once per step?")


def test_seeded_sampling_does_not_depend_on_the_batch():
    """A seeded request draws from its own generator: alone, in a batch, or preempted, it
    produces the same tokens."""
    seeded = lab.SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=MAX_TOKENS)
    other = lab.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    p = prompts()
    _, alone = run_engine([p[1]], seeded, block_size=4, num_gpu_blocks=64)
    _, batched = run_engine(p, [other, seeded, other, other, other],
                            block_size=4, num_gpu_blocks=12, max_num_batched_tokens=12)
    assert batched[1] == alone[0], (
        f"seeded r1 alone drew {alone[0]}, in a batch with preemption {batched[1]}: it must "
        "draw from its own state.generator only")
    # And the seed matters: a different seed gives a different sequence here.
    _, other_seed = run_engine([p[1]], lab.SamplingParams(
        temperature=1.0, top_k=20, seed=99, max_tokens=MAX_TOKENS), block_size=4,
        num_gpu_blocks=64)
    assert other_seed[0] != alone[0], (
        f"seeds 1234 and 99 drew the same tokens {alone[0]}: the seeded request must draw "
        "from its own generator")


def test_min_tokens_holds_back_stop_tokens():
    p = prompts()[3]
    first = reference(tuple(p), 1)[0]
    stop_now = lab.SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first])
    _, out = run_engine([p], stop_now, block_size=4, num_gpu_blocks=32)
    assert out[0] == [first], "the stop token ends the request at once"
    held = lab.SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3,
                              stop_token_ids=[first])
    _, out = run_engine([p], held, block_size=4, num_gpu_blocks=32)
    assert len(out[0]) >= 3 and first not in out[0][:3], "no stop token before min_tokens"


# ----------------------------------------------------------------------------- task 6


def test_beam_score_divides_by_the_whole_length_without_a_final_eos():
    score = lab.get_beam_search_score
    assert score([5, 6, 7, 8], -2.0, 9) == pytest.approx(-0.5), "length_penalty defaults to 1"
    assert score([5, 6, 7, 9], -3.0, 9, 1.0) == pytest.approx(-1.0), (
        "a final EOS is not counted in the length (3 tokens here, not 4)")
    assert score([5, 9, 7], -3.0, 9, 1.0) == pytest.approx(-1.0), "an EOS inside counts"
    assert score([5, 6, 7, 9], -3.0, None, 1.0) == pytest.approx(-0.75), "no EOS id: all count"
    assert score([1, 2, 3, 9], -3.0, 9, 0.0) == pytest.approx(-3.0), "penalty 0: the sum alone"
    assert score([1, 2, 9], -4.0, 9, 2.0) == pytest.approx(-1.0), "length ** length_penalty"
    assert score([1, 2, 3, 4], -2.0, 9, -1.0) == pytest.approx(-8.0), (
        f"length_penalty -1: -2.0 / 4 ** -1 = -8.0, got {score([1, 2, 3, 4], -2.0, 9, -1.0)}")


def test_the_sort_key_scores_the_whole_sequence_prompt_included():
    """A beam of a 3-token prompt and 2 generated tokens has length 5, not 2."""
    beam = lab.BeamSearchSequence(tokens=[1, 2, 3, 4, 5], logprobs=[{}, {}], cum_logprob=-5.0)
    assert lab.create_sort_beams_key_function(9, 1.0)(beam) == pytest.approx(-1.0), (
        "the length counts the prompt too: 5 tokens here, not the 2 generated")
    ended = lab.BeamSearchSequence(tokens=[1, 2, 3, 4, 9], logprobs=[{}, {}], cum_logprob=-2.0)
    assert lab.create_sort_beams_key_function(9, 1.0)(ended) == pytest.approx(-0.5), (
        "a final EOS is not counted: -2.0 / 4 = -0.5, got "
        f"{lab.create_sort_beams_key_function(9, 1.0)(ended)}")
    assert lab.create_sort_beams_key_function(9, 2.0)(beam) == pytest.approx(-0.2), (
        "length_penalty 2: -5.0 / 5 ** 2 = -0.2, got "
        f"{lab.create_sort_beams_key_function(9, 2.0)(beam)}: is length_penalty passed on?")
    assert lab.create_sort_beams_key_function(None, 1.0)(ended) == pytest.approx(-0.4), (
        "eos_token_id None: every token counts, -2.0 / 5 = -0.4, got "
        f"{lab.create_sort_beams_key_function(None, 1.0)(ended)}")


# ----------------------------------------------------------------------------- task 7

BEAM_VOCAB = 10
BEAM_EOS = 3


def table_logprobs(sequences: list[list[int]]) -> torch.Tensor:
    """A synthetic model: each sequence's next-token log-probabilities, drawn from a generator
    seeded by the sequence itself (so a recomputation gives the same row), EOS made likely."""
    rows = []
    for seq in sequences:
        rng = random.Random(repr(seq))
        logits = [rng.gauss(0.0, 1.5) for _ in range(BEAM_VOCAB)]
        logits[BEAM_EOS] += 1.0
        norm = math.log(sum(math.exp(x) for x in logits))
        rows.append([x - norm for x in logits])
    return torch.tensor(rows, dtype=torch.float64)


def answer(row: torch.Tensor, k: int) -> dict:
    """What the engine answers a beam: its top ``k`` tokens, best first, as ``Logprob``s."""
    top = row.topk(k)
    return {t: lab.Logprob(v, rank) for rank, (t, v) in
            enumerate(zip(top.indices.tolist(), top.values.tolist()), 1)}


def oracle_key(eos, length_penalty):
    return lambda beam: beam_score(beam.tokens, beam.cum_logprob, eos, length_penalty)


def beam_search_on_table(prompts, width, max_tokens, *, ignore_eos, length_penalty):
    """Your expand_beams and finish_beams driven as LLM.beam_search drives them."""
    key = oracle_key(BEAM_EOS, length_penalty)
    instances = [lab.BeamSearchInstance(list(p)) for p in prompts]
    for _ in range(max_tokens):
        for inst in instances:
            if inst.beams:
                rows = table_logprobs([b.tokens for b in inst.beams])
                lab.expand_beams(inst, [answer(r, 2 * width) for r in rows], width, BEAM_EOS,
                                 ignore_eos, key)
    return [lab.finish_beams(inst, width, key) for inst in instances]


def lp(value):
    return lab.Logprob(value)


def test_expand_beams_makes_each_beams_children_and_completes_eos():
    """Three live beams of prompt [7]; the third's request was aborted (no answer): though it
    scores best, it makes no child and does not live on. Width 2."""
    inst = lab.BeamSearchInstance([7])
    a = lab.BeamSearchSequence([7, 1], [{}], -0.5)
    b = lab.BeamSearchSequence([7, 2], [{}], -1.0)
    c = lab.BeamSearchSequence([7, 5], [{}], -0.1)
    inst.beams = [a, b, c]
    ans_a = {4: lp(-0.1), BEAM_EOS: lp(-0.3), 5: lp(-2.0)}
    ans_b = {4: lp(-0.2), BEAM_EOS: lp(-0.4), 6: lp(-0.9)}
    lab.expand_beams(inst, [ans_a, ans_b, None], 2, BEAM_EOS, False, oracle_key(BEAM_EOS, 1.0))
    got = [(x.tokens, x.cum_logprob) for x in inst.beams]
    assert got == [([7, 1, 4], pytest.approx(-0.6)), ([7, 2, 4], pytest.approx(-1.2))], (
        "each beam is extended by its own answer only, and the best two non-EOS children live; "
        "a beam whose answer is None (its request was aborted) is dropped, not kept")
    assert [(x.tokens, x.cum_logprob) for x in inst.completed] == [
        ([7, 1, BEAM_EOS], pytest.approx(-0.8)), ([7, 2, BEAM_EOS], pytest.approx(-1.4))], (
        "a child ending in EOS goes to instance.completed, in the order made")
    assert inst.beams[0].logprobs == [{}, ans_a] and inst.beams[1].logprobs == [{}, ans_b], (
        "each child's logprobs is its parent's list plus its parent's answer dict "
        f"(lengths {[len(x.logprobs) for x in inst.beams]}, want [2, 2])")
    assert a.tokens == [7, 1] and a.logprobs == [{}] and a.cum_logprob == -0.5, (
        "the parent is left as it was")
    assert inst.history == [[[7, 1, 4], [7, 2, 4]]], (
        "history gets one entry per step, the new live beams' tokens in rank order: want "
        f"[[[7, 1, 4], [7, 2, 4]]], got {inst.history}")


def test_expand_beams_with_ignore_eos_keeps_eos_children_live():
    inst = lab.BeamSearchInstance([7])
    lab.expand_beams(inst, [{BEAM_EOS: lp(-0.1), 4: lp(-0.2)}], 2, BEAM_EOS, True,
                     oracle_key(BEAM_EOS, 1.0))
    assert [x.tokens for x in inst.beams] == [[7, BEAM_EOS], [7, 4]] and inst.completed == [], (
        f"want live [[7, 3], [7, 4]], completed [], got {[x.tokens for x in inst.beams]}, "
        f"{[x.tokens for x in inst.completed]}: both score -0.1, so swapped means your sort "
        "reverses ties (keep the order made: sorted(..., reverse=True), not [::-1]); "
        "[7, 3] in completed means ignore_eos is not honoured")


def test_expand_beams_refuses_an_answer_count_that_is_not_the_beam_count():
    inst = lab.BeamSearchInstance([7])
    with pytest.raises(ValueError) as err:
        lab.expand_beams(inst, [{4: lp(-0.1)}, {5: lp(-0.2)}], 2, BEAM_EOS, False,
                         oracle_key(BEAM_EOS, 1.0))
    assert "1" in str(err.value) and "2" in str(err.value), "name both counts"
    assert [x.tokens for x in inst.beams] == [[7]] and inst.history == [], (
        "a refused step changes nothing: want beams [[7]], history [], got "
        f"{[x.tokens for x in inst.beams]}, {inst.history}: raise before touching the instance")


def test_finish_beams_ranks_completed_and_live_beams_together():
    inst = lab.BeamSearchInstance([7])
    done = lab.BeamSearchSequence([7, 1, BEAM_EOS], [{}, {}], -0.4)  # score -0.2
    inst.completed = [done]
    inst.beams = [lab.BeamSearchSequence([7, 1, 4, 4], [{}] * 3, -1.2),   # -0.3
                  lab.BeamSearchSequence([7, 2, 4, 5], [{}] * 3, -0.6)]   # -0.15
    inst.history = [[[7, 1]], [[7, 1, 4]], [[7, 1, 4, 4], [7, 2, 4, 5]]]
    out = lab.finish_beams(inst, 2, oracle_key(BEAM_EOS, 1.0))
    assert [x.tokens for x in out.sequences] == [[7, 2, 4, 5], [7, 1, BEAM_EOS]], (
        "a completed beam competes with the live ones for the final ranking")
    assert out.beam_history == inst.history, (
        f"beam_history must be instance.history, got {out.beam_history}")
    # Equal scores keep the order they come in, completed beams first: upstream sorts
    # completed + live with Python's stable sort, best first. A reversed sort swaps them.
    tie = lab.BeamSearchInstance([7])
    tie.completed = [lab.BeamSearchSequence([7, 1, BEAM_EOS], [{}, {}], -0.5)]  # -0.5 / 2
    tie.beams = [lab.BeamSearchSequence([7, 5, 5], [{}, {}], -0.75),  # -0.75 / 3
                 lab.BeamSearchSequence([7, 4, 4], [{}, {}], -0.75)]
    got = [x.tokens for x in lab.finish_beams(tie, 3, oracle_key(BEAM_EOS, 1.0)).sequences]
    assert got == [[7, 1, BEAM_EOS], [7, 5, 5], [7, 4, 4]], (
        f"three beams tie at -0.25: keep them in the order they come, completed first, got "
        f"{got}: sort with reverse=True (stable for ties), not sorted(...)[::-1]")


CASES = [  # (width, length_penalty, ignore_eos)
    (1, 1.0, False), (2, 1.0, False), (3, 0.0, False), (4, 2.0, False), (5, -1.0, False),
    (3, 1.0, True),
]


@pytest.mark.parametrize("width, length_penalty, ignore_eos", CASES)
def test_beam_search_on_a_table_equals_brute_force(width, length_penalty, ignore_eos):
    rng = random.Random(width)
    prompts = [[rng.choice([0, 1, 2, 4, 5, 6, 7, 8, 9]) for _ in range(rng.randint(1, 5))]
               for _ in range(6)]
    outputs = beam_search_on_table(prompts, width, 4, ignore_eos=ignore_eos,
                                   length_penalty=length_penalty)
    wanted = brute_force_beam_search(table_logprobs, prompts, width, 4, BEAM_EOS,
                                     ignore_eos=ignore_eos, length_penalty=length_penalty)
    for i, (out, want, prompt) in enumerate(zip(outputs, wanted, prompts)):
        got = [x.tokens[len(prompt):] for x in out.sequences]
        assert got == [t[len(prompt):] for t, _ in want], (
            f"width {width}, length_penalty {length_penalty}, ignore_eos {ignore_eos}, prompt "
            f"{i} {prompt}: your beams {got}, brute force {[t[len(prompt):] for t, _ in want]}")
        assert [x.cum_logprob for x in out.sequences] == pytest.approx([c for _, c in want]), (
            f"width {width}, prompt {i}: same beams, but cum_logprobs "
            f"{[round(x.cum_logprob, 4) for x in out.sequences]} vs "
            f"{[round(c, 4) for _, c in want]}"
            ": a child's cum_logprob is its parent's plus its token's .logprob")
    if not ignore_eos:
        assert any(x.tokens[-1] == BEAM_EOS for o in outputs for x in o.sequences), (
            "no completed beam among the results: this case would not test completion")
