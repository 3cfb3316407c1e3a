"""Faults inside a step: the call fails, its requests are aborted, and the engine stays usable.

Each case plants an exception (or a Ctrl-C) at one stage of a step -- the scheduler, each part of
the model runner, the cache ops and attention kernels (reached through their module-level names,
as the engine looks them up at call time), a layer of the model, the sampler, the scheduler's
update -- on the first or on a later call. ``generate()`` must re-raise it, leave no request and
no KV block behind, and the very next ``generate()`` on the same ``LLM`` must produce exactly the
tokens a fresh engine produces. The prompts share prefixes and prefix caching is on, so a failed
step that left half-written blocks in the prefix cache would show up as wrong tokens.
"""

from __future__ import annotations

import pytest

from mini_vllm.attention import backend, cache_ops, paged_attn
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
CONFIG = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12)


class Planted(Exception):
    """The fault the tests inject."""


def _failing(fn, fail_on_call: int, exc: type[BaseException]):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise exc("planted fault")
        return fn(*args, **kwargs)

    wrapper.calls = calls
    return wrapper


def _instance(path: str):
    """(owner getter, attribute) for a fault planted on an attribute of the live engine."""
    *owner, attr = path.split(".")

    def get(llm):
        obj = llm
        for name in owner:
            obj = obj[int(name)] if name.isdigit() else getattr(obj, name)
        return obj

    return get, attr


# stage -> where the fault goes: an attribute of the LLM's objects, or a module-level function.
STAGES = {
    "schedule": _instance("engine.scheduler.schedule"),
    "runner-update-states": _instance("engine.model_runner._update_states"),
    "runner-new-request-state": _instance("engine.model_runner._new_request_state"),
    "runner-block-ops": _instance("engine.model_runner._execute_block_ops"),
    "runner-prepare-inputs": _instance("engine.model_runner._prepare_inputs"),
    "reshape-and-cache": (cache_ops, "reshape_and_cache"),
    "paged-decode": (paged_attn, "forward_decode"),
    "chunked-prefill-attention": (backend, "chunked_prefill_attention"),
    "model-layer": _instance("model.model.layers.1.mlp.forward"),
    "sampler": (None, "sampler"),  # a callable object: replaced whole, see plant()
    "update-from-output": _instance("engine.scheduler.update_from_output"),
    "record-stats": _instance("engine._record_stats"),
}


def plant(monkeypatch, llm, stage: str, fail_on_call: int, exc: type[BaseException]):
    where, attr = STAGES[stage]
    if stage == "sampler":
        sampler = llm.engine.model_runner.sampler
        monkeypatch.setattr(llm.engine.model_runner, "sampler",
                            _failing(sampler, fail_on_call, exc))
        return
    obj = where(llm) if callable(where) else where  # a live object's attribute, or a module's
    monkeypatch.setattr(obj, attr, _failing(getattr(obj, attr), fail_on_call, exc))


def assert_clean(llm, finished_before=()):
    """Nothing queued, no block held; the runner remembers no request of the failed call (it
    may still hold requests that finished normally: it forgets those at the next step)."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "the failed call left requests queued"
    assert engine.num_blocks_in_use == 0, "the failed call left KV blocks allocated"
    leftover = set(engine.model_runner.requests) - set(finished_before)
    assert not leftover, f"the runner still holds aborted requests {leftover}"


@pytest.mark.parametrize("fail_on_call,exc", [(1, Planted), (5, KeyboardInterrupt)],
                         ids=["first-call-exception", "later-call-ctrl-c"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_at_any_stage_aborts_the_call_and_leaves_the_engine_usable(
    stage, fail_on_call, exc, monkeypatch, tiny_model, prompts, reference_outputs
):
    llm = LLM(tiny_model, **CONFIG)
    warm = llm.generate(prompts[:3], GREEDY, use_tqdm=False)  # the prefix cache holds blocks
    finished = [o.request_id + "-0" for o in warm]
    plant(monkeypatch, llm, stage, fail_on_call, exc)
    with pytest.raises(exc, match="planted fault"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm, finished)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
    assert_clean(llm, [o.request_id + "-0" for o in outputs])


def test_the_prefix_cache_never_serves_blocks_a_failed_step_did_not_write(
    monkeypatch, tiny_model, prompts, reference_outputs
):
    """The step allocates (and registers as cached) every full block of a prompt before the
    model writes its KV; if the forward pass then fails, those blocks hold nothing valid."""
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=256)
    plant(monkeypatch, llm, "reshape-and-cache", 1, Planted)
    with pytest.raises(Planted):
        llm.generate(prompts[2], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate(prompts[2], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_outputs[2]


def test_a_step_that_schedules_nothing_while_requests_wait_is_an_error(
    monkeypatch, tiny_model, prompts, reference_outputs
):
    """A scheduler that never admits a waiting request would spin forever at 100% CPU."""
    llm = LLM(tiny_model, **CONFIG)
    sched = llm.engine.scheduler
    steps = {"n": 0}
    original_schedule = sched.schedule

    def counting_schedule():
        steps["n"] += 1
        assert steps["n"] < 100, "generate() kept stepping a stalled engine"
        return original_schedule()

    monkeypatch.setattr(sched, "_schedule_waiting", lambda step: None)
    monkeypatch.setattr(sched, "schedule", counting_schedule)
    with pytest.raises(RuntimeError, match="stalled"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert steps["n"] <= 3
    monkeypatch.undo()
    assert_clean(llm)
    out = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference_outputs[:2]


def test_a_request_stuck_running_with_nothing_to_compute_is_an_error(monkeypatch, tiny_model,
                                                                      prompts):
    """The original hang: the runner never returns a token for a request, so it stays RUNNING
    with every token computed and the scheduler has nothing left to give it."""
    llm = LLM(tiny_model, **CONFIG)
    runner = llm.engine.model_runner
    real_sample = runner._sample

    def sample_nothing(hidden, meta):
        real_sample(hidden, meta)
        return [[] for _ in meta.req_ids]

    monkeypatch.setattr(runner, "_sample", sample_nothing)
    with pytest.raises(RuntimeError, match="stalled"):
        llm.generate(prompts[0], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
