"""The engine's batching baselines for lab 03-06 beside paged memory, on a scheduler with a small,
synthetic KV budget (16 usable blocks of 4 tokens, max_model_len 32): static batching against
continuous batching, paged memory growing and preempting, a reservation that cannot fit the
cache refused at add, bad settings refused. What each reservation policy admits is tested by
lab 03-06's own tests (phase-03-scheduler/labs/lab-06-under-load/test_lab.py).
"""
from __future__ import annotations

import pytest

from mini_vllm.config import SchedulerConfig
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

BLOCK, USABLE, MAX_LEN, PROMPT, MAX_TOKENS = 4, 16, 32, 5, 4


def make_scheduler(policy: str, static: bool = False, seats: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(
        max_num_seqs=seats, max_num_batched_tokens=1024, max_model_len=MAX_LEN,
        block_size=BLOCK, num_gpu_blocks=USABLE + 1, enable_prefix_caching=False,
        kv_reservation=policy, static_batching=static))


def add(scheduler: Scheduler, n: int, start: int = 0, max_tokens: int = MAX_TOKENS) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(start, start + n):
        scheduler.add_request(Request(f"r{i}", [7] * PROMPT, params, eos_token_id=None))


def step(scheduler: Scheduler) -> list[str]:
    """One step with a fake runner that samples token 1 for every request past its prompt;
    returns the ids that finished."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[1] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
               else [] for r in ids]
    news = scheduler.update_from_output(out, ModelRunnerOutput(
        ids, {r: i for i, r in enumerate(ids)}, sampled))
    return [n.request_id for n in news if n.finish_reason is not None]


def held_blocks(scheduler: Scheduler) -> dict[str, int]:
    manager = scheduler.kv_cache_manager
    return {r.request_id: len(manager.get_block_ids(r.request_id)[0]) for r in scheduler.running}


def test_paged_grows_one_block_at_a_time_and_preempts_when_the_pool_runs_dry():
    scheduler = make_scheduler("paged")
    add(scheduler, 8, max_tokens=6)
    step(scheduler)  # prefill: 8 x 2 blocks, the pool is full
    assert set(held_blocks(scheduler).values()) == {2}
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # The KV of token 9 needs a third block, which only a preemption can free.
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == USABLE


def test_static_batching_admits_a_new_batch_only_when_the_last_one_is_done():
    scheduler = make_scheduler("paged", static=True)
    add(scheduler, 2, max_tokens=3)
    step(scheduler)  # r0, r1: prefill and their first token
    add(scheduler, 1, start=2)
    assert step(scheduler) == []
    # r2 arrived while r0 and r1 run: it waits for the whole batch to finish.
    assert [r.request_id for r in scheduler.running] == ["r0", "r1"]
    assert sorted(step(scheduler)) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["r2"]


def test_continuous_batching_admits_a_late_request_at_the_next_step():
    scheduler = make_scheduler("paged")
    add(scheduler, 2, max_tokens=3)
    step(scheduler)
    add(scheduler, 1, start=2)
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2"]


def test_a_request_whose_reservation_cannot_fit_the_cache_is_refused_at_add():
    scheduler = Scheduler(SchedulerConfig(
        max_model_len=64, block_size=4, num_gpu_blocks=9, enable_prefix_caching=False,
        kv_reservation="max"))  # 8 usable blocks = 32 slots < max_model_len
    with pytest.raises(ValueError, match="64 tokens = 16 blocks, but the cache has only 8"):
        add(scheduler, 1)
    assert not scheduler.waiting and not scheduler.requests


def test_bad_reservation_settings_are_refused():
    with pytest.raises(ValueError, match="kv_reservation must be one of"):
        SchedulerConfig(kv_reservation="buddy")
    with pytest.raises(ValueError, match="static_batching must be True or False"):
        SchedulerConfig(static_batching=1)
