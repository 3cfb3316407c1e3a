"""Graded tests of lab 03-01: the scheduler and continuous batching.

Several tests port the properties of upstream's tests/v1/core/test_scheduler.py at v0.11.0
(requests scheduled together, partial scheduling under a small budget, preemption during
execution with ``num_blocks=11``, no block leak, stop conditions); the rest check the invariants
of every step on seeded random workloads and compare a fixed workload with the golden trace.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from course.loader import load_lab
from mini_vllm.config import SchedulerConfig
from mini_vllm.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.request import FinishReason, Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler_output import ModelRunnerOutput
from mini_vllm.toy_runner import ToyModelRunner, run_engine

lab = load_lab(__file__)
HERE = Path(__file__).resolve().parent
EOS = 2


# ---------------------------------------------------------------------------------------------
# Helpers (they touch `lab` only when a test calls them)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    """One root hash per test: requests hashed under different roots never share a prefix."""
    init_none_hash(sha256)


def make_scheduler(**overrides):
    kw = dict(
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        block_size=16,
        num_gpu_blocks=10000,
        enable_prefix_caching=False,
    )
    kw.update(overrides)
    return lab.Scheduler(SchedulerConfig(**kw))


def create_requests(num_requests, num_tokens=10, max_tokens=16, block_size=16, stop_token_ids=None,
                    ignore_eos=False, first_id=0, prompt=None):
    """Requests ``"0", "1", ...`` whose prompts are distinct (so no accidental prefix hits)."""
    hasher = get_request_block_hasher(block_size, sha256)
    out = []
    for i in range(first_id, first_id + num_requests):
        tokens = list(prompt) if prompt is not None else [1000 * (i + 1) + t for t in
                                                           range(num_tokens)]
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                ignore_eos=ignore_eos)
        out.append(Request(str(i), tokens, params, eos_token_id=EOS, block_hasher=hasher))
    return out


def make_output(scheduler_output, tokens=None, default=0):
    """One token for every scheduled request whose prompt is done, [] for one still in prefill.

    ``tokens`` maps request id -> list of tokens to return instead.
    """
    tokens = tokens or {}
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        if rid in tokens:
            sampled.append(list(tokens[rid]))
        else:
            sampled.append([default])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def free_blocks(scheduler):
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def usable_blocks(scheduler):
    return scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1


def assert_scheduler_empty(scheduler):
    """Port of upstream's assert_scheduler_empty: nothing queued, nothing held."""
    assert len(scheduler.requests) == 0
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.swapped) == 0
    assert free_blocks(scheduler) == usable_blocks(scheduler), "blocks leaked"
    assert not scheduler.kv_cache_manager.req_to_blocks, "a finished request still has a table"
    for block in scheduler.kv_cache_manager.block_pool.blocks[1:]:
        assert block.ref_cnt == 0


def check_step_invariants(scheduler, so):
    """The invariants that every schedule() must keep."""
    cfg = scheduler.scheduler_config
    total = sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens == total
    assert total <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert all(n >= 1 for n in so.num_scheduled_tokens.values())
    assert len(scheduler.running) <= cfg.max_num_seqs
    ids = so.scheduled_req_ids
    assert sorted(ids) == sorted(so.num_scheduled_tokens), "scheduled requests and token counts"
    queues = ([r.request_id for r in scheduler.running] + [r.request_id for r in scheduler.waiting]
              + [r.request_id for r in scheduler.swapped])
    assert sorted(queues) == sorted(scheduler.requests), "a request is in two queues or none"
    held = set(scheduler.kv_cache_manager.req_to_blocks)
    running = {r.request_id for r in scheduler.running}
    assert held == running, "blocks must be held exactly by the running requests"
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING
        table = scheduler.kv_cache_manager.req_to_blocks[r.request_id]
        assert len(table) * cfg.block_size >= r.num_computed_tokens


# ---------------------------------------------------------------------------------------------
# Task 1: queues
# ---------------------------------------------------------------------------------------------


def test_add_requests_queues_them_in_order():
    scheduler = make_scheduler()
    requests = create_requests(num_requests=5)
    for i, request in enumerate(requests):
        scheduler.add_request(request)
        assert scheduler.requests[request.request_id] is request
        assert len(scheduler.waiting) == i + 1
    assert list(scheduler.waiting) == requests
    assert scheduler.get_num_unfinished_requests() == 5
    assert scheduler.has_unfinished_requests()


@pytest.mark.parametrize("case", ["duplicate", "too-long", "cannot-fit", "no-hasher"])
def test_add_request_rejects_bad_input_and_changes_nothing(case):
    scheduler = make_scheduler(max_model_len=64, num_gpu_blocks=4, block_size=4,
                               enable_prefix_caching=True)
    first = create_requests(1, num_tokens=4, max_tokens=4, block_size=4)[0]
    scheduler.add_request(first)
    if case == "duplicate":
        bad = create_requests(1, num_tokens=4, max_tokens=4, block_size=4)[0]
    elif case == "too-long":
        bad = create_requests(1, num_tokens=64, block_size=4, first_id=1)[0]
    elif case == "cannot-fit":  # 3 usable blocks of 4 tokens, but it may reach 20 tokens
        bad = create_requests(1, num_tokens=10, max_tokens=10, block_size=4, first_id=1)[0]
    else:
        bad = Request("9", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=EOS)
    with pytest.raises(ValueError):
        scheduler.add_request(bad)
    assert list(scheduler.waiting) == [first]
    assert list(scheduler.requests) == [first.request_id]
    assert scheduler.get_num_unfinished_requests() == 1


# ---------------------------------------------------------------------------------------------
# Tasks 2 and 4: running first, then waiting, within the budget
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_requests_are_scheduled_together(enable_prefix_caching):
    """Port of upstream test_schedule: ten prompts fit the budget, so all run in step 1."""
    scheduler = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == len(requests)
    assert output.scheduled_cached_reqs.num_reqs == 0
    assert len(output.finished_req_ids) == 0
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        assert num_tokens == len(requests[int(req_id)].prompt_token_ids)
    assert output.total_num_scheduled_tokens == 100
    assert len(scheduler.waiting) == 0
    assert scheduler.running == requests
    for request in requests:
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens == 10  # advanced right after scheduling
    for new in output.scheduled_new_reqs:
        assert new.num_computed_tokens == 0  # the output carries the count before the step
        assert len(new.block_ids[0]) == 1


def test_partial_scheduling_under_a_small_budget():
    """Port of upstream test_schedule_concurrent_partial_requests (threshold 400, budget 1024)."""
    scheduler = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    requests = create_requests(num_requests=3, num_tokens=800)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 3
    assert [output.num_scheduled_tokens[r.request_id] for r in requests] == [400, 400, 224]
    scheduler.update_from_output(output, make_output(output, {r.request_id: [] for r in requests}))

    output1 = scheduler.schedule()
    assert len(output1.scheduled_new_reqs) == 0
    assert output1.scheduled_cached_reqs.num_reqs == 3
    assert output1.scheduled_cached_reqs.num_computed_tokens == [400, 400, 224]
    assert [output1.num_scheduled_tokens[r.request_id] for r in requests] == [400, 400, 224]
    scheduler.update_from_output(output1, make_output(output1, {"2": []}))

    output2 = scheduler.schedule()
    assert [output2.num_scheduled_tokens[r.request_id] for r in requests] == [1, 1, 800 - 448]
    assert len(scheduler.running) == 3


def test_budget_splits_a_prompt_and_the_rest_waits():
    """Without a threshold the budget alone chunks: the second prompt gets what is left."""
    scheduler = make_scheduler(max_num_batched_tokens=100)
    requests = create_requests(num_requests=3, num_tokens=80)
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 80, "1": 20}
    assert [r.request_id for r in scheduler.waiting] == ["2"]
    scheduler.update_from_output(out, make_output(out, {"1": []}))
    out = scheduler.schedule()
    # Running first: "0" decodes, "1" finishes its prompt, then "2" takes the rest of the budget.
    assert out.num_scheduled_tokens == {"0": 1, "1": 60, "2": 39}
    assert out.scheduled_cached_reqs.req_ids == ["0", "1"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["2"]


def test_max_num_seqs_caps_the_running_queue():
    scheduler = make_scheduler(max_num_seqs=3)
    for request in create_requests(num_requests=5):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert sorted(out.num_scheduled_tokens) == ["0", "1", "2"]
    assert [r.request_id for r in scheduler.waiting] == ["3", "4"]


def test_prefix_cache_hit_on_admission():
    scheduler = make_scheduler(enable_prefix_caching=True, block_size=4)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    first = create_requests(1, block_size=4, prompt=prompt)[0]
    scheduler.add_request(first)
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out))
    second = create_requests(1, block_size=4, prompt=prompt, first_id=1)[0]
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["1"] == 2  # 16 tokens come from the cache
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert second.num_cached_tokens == 16
    first_blocks = scheduler.kv_cache_manager.get_block_ids("0")[0]
    assert out.scheduled_new_reqs[0].block_ids[0][:4] == first_blocks[:4]


# ---------------------------------------------------------------------------------------------
# Task 3: preemption by recompute
# ---------------------------------------------------------------------------------------------


def test_preempt_during_execution():
    """Port of upstream test_preempt_during_execution: 10 usable blocks (block 0 is null)."""
    scheduler = make_scheduler(max_num_batched_tokens=100, block_size=16, num_gpu_blocks=11)
    requests = create_requests(num_requests=2, num_tokens=80, block_size=16)
    scheduler.add_request(requests[0])
    output0 = scheduler.schedule()
    assert len(output0.num_scheduled_tokens) == 1
    assert len(output0.scheduled_new_reqs[0].block_ids[0]) == 5

    # The second request is scheduled while the first one's step is still running.
    scheduler.add_request(requests[1])
    output1 = scheduler.schedule()
    assert len(output1.num_scheduled_tokens) == 1
    assert len(output1.scheduled_new_reqs[0].block_ids[0]) == 5

    scheduler.update_from_output(output0, make_output(output0))
    # Request 0 needs a sixth block: the cache is full, so the newest request is preempted.
    output2 = scheduler.schedule()
    assert scheduler.running == [requests[0]]
    assert requests[1].status == RequestStatus.PREEMPTED
    assert requests[1].num_computed_tokens == 0
    assert list(scheduler.waiting) == [requests[1]]
    assert output2.preempted_req_ids == ["1"]
    assert output2.num_scheduled_tokens == {"0": 1}

    # The preempted request still receives the token of the step it was part of.
    scheduler.update_from_output(output1, make_output(output1, {"1": [42]}))
    assert list(requests[1].output_token_ids) == [42]


def test_preemption_takes_the_newest_and_resumes_it_first():
    """Three decoding requests outgrow a small cache: the newest is preempted, goes to the head
    of the waiting queue, nothing new is admitted in that step, and it resumes later."""
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=64)
    requests = create_requests(num_requests=3, num_tokens=12, max_tokens=8, block_size=4,
                               ignore_eos=True)
    late = create_requests(1, num_tokens=3, max_tokens=2, block_size=4, first_id=3)[0]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # 3 x 12 tokens = 9 blocks: the cache is full
    assert free_blocks(scheduler) == 0
    scheduler.update_from_output(out, make_output(out, default=5))
    scheduler.add_request(late)
    out = scheduler.schedule()  # everyone needs a 4th block for token 13
    assert out.preempted_req_ids == ["2"]
    assert [r.request_id for r in scheduler.running] == ["0", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2", "3"]  # victim at the head
    assert requests[2].num_preemptions == 1
    assert "3" not in out.num_scheduled_tokens  # no admission in a step that preempted
    # Run to the end: the victim comes back as a resumed request, before the late one.
    resumed_at = admitted_late_at = None
    for step in range(100):
        scheduler.update_from_output(out, make_output(out, default=5))
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        check_step_invariants(scheduler, out)
        cached = out.scheduled_cached_reqs
        if "2" in cached.req_ids and cached.resumed_from_preemption[cached.req_ids.index("2")]:
            resumed_at = resumed_at if resumed_at is not None else step
            # A resumed request gets its whole block table again, not a diff.
            ids = cached.new_block_ids[cached.req_ids.index("2")][0]
            assert ids == scheduler.kv_cache_manager.get_block_ids("2")[0]
        if any(n.req_id == "3" for n in out.scheduled_new_reqs):
            admitted_late_at = step
    assert resumed_at is not None and admitted_late_at is not None
    assert resumed_at <= admitted_late_at
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert_scheduler_empty(scheduler)


def test_no_admission_in_a_step_that_preempted():
    """A preempted mid-prefill request frees more blocks than the preempting request needs, and
    a smaller chunk of it would fit again at once. It must still wait for the next step:
    admitting into a cache that just proved too small only makes requests thrash."""
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=6, max_num_batched_tokens=8,
                               max_num_seqs=4)
    requests = []
    for i, (n, max_tokens) in enumerate([(3, 3), (6, 6), (10, 3)]):
        requests += create_requests(1, max_tokens=max_tokens, block_size=4, first_id=i,
                                    prompt=[10 + i] * n, ignore_eos=True)
    runner = ToyModelRunner(4, 6, with_kv=False)
    preempting_steps = []

    def check(step, so, sch):
        check_step_invariants(sch, so)
        if so.preempted_req_ids:
            preempting_steps.append(step)
            assert not so.scheduled_new_reqs, "admitted a new request in a step that preempted"
            assert not any(so.scheduled_cached_reqs.resumed_from_preemption), (
                "resumed a preempted request in the step that preempted")

    records = run_engine(scheduler, runner, {0: requests}, on_step=check)
    assert preempting_steps, "the workload must preempt"
    assert records[4].num_scheduled_tokens == {"1": 1} and records[4].preempted == ["2"]
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert_scheduler_empty(scheduler)


# ---------------------------------------------------------------------------------------------
# Task 5: update_from_output and the stop conditions
# ---------------------------------------------------------------------------------------------


def _one_running(scheduler, **kw):
    request = create_requests(1, **kw)[0]
    scheduler.add_request(request)
    out = scheduler.schedule()
    return request, out


def test_stop_on_eos_and_on_stop_token_trims_the_rest():
    """Port of upstream test_stop_via_update_from_output (several tokens in one step)."""
    scheduler = make_scheduler()
    eos_req, out = _one_running(scheduler, max_tokens=10)
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [7, EOS, 9]}))
    assert eos_req.status == RequestStatus.FINISHED_STOPPED
    assert eos_req.get_finished_reason() == FinishReason.STOP
    assert list(eos_req.output_token_ids) == [7, EOS]
    assert outputs[0].new_token_ids == [7, EOS] and outputs[0].finished

    stop_req = create_requests(1, stop_token_ids=[13], first_id=1)[0]
    scheduler.add_request(stop_req)
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out, {"1": [13, 4]}))
    assert stop_req.status == RequestStatus.FINISHED_STOPPED
    assert stop_req.stop_reason == 13
    assert list(stop_req.output_token_ids) == [13]
    assert out.finished_req_ids == {"0"}  # finished before this step: the runner drops it
    assert scheduler.schedule().finished_req_ids == {"1"}
    assert_scheduler_empty(scheduler)


def test_stop_at_max_tokens_and_ignore_eos():
    scheduler = make_scheduler()
    request, out = _one_running(scheduler, max_tokens=3, ignore_eos=True)
    scheduler.update_from_output(out, make_output(out, {"0": [EOS, EOS]}))
    assert request.status == RequestStatus.RUNNING  # EOS ignored, 2 < 3 tokens
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 2}  # both new tokens need their KV
    scheduler.update_from_output(out, make_output(out, {"0": [EOS, 8]}))
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(request.output_token_ids) == [EOS, EOS, EOS]
    assert request.get_finished_reason() == FinishReason.LENGTH


def test_stop_at_max_model_len():
    scheduler = make_scheduler(max_model_len=12, block_size=4)
    request, out = _one_running(scheduler, num_tokens=10, max_tokens=100, block_size=4)
    scheduler.update_from_output(out, make_output(out))
    assert request.status == RequestStatus.RUNNING
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out))
    assert request.num_tokens == 12
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_check_stop_directly():
    request = create_requests(1, max_tokens=5, stop_token_ids=[11])[0]
    request.append_output_token_ids(3)
    assert lab.check_stop(request, max_model_len=100) is False
    assert request.status == RequestStatus.WAITING
    request.append_output_token_ids(11)
    assert lab.check_stop(request, max_model_len=100) is True
    assert request.stop_reason == 11


def test_prefill_step_samples_nothing():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request, out = _one_running(scheduler, num_tokens=20)
    outputs = scheduler.update_from_output(out, make_output(out, {"0": []}))
    assert outputs == [] and request.num_output_tokens == 0
    assert scheduler.schedule().num_scheduled_tokens == {"0": 8}


# ---------------------------------------------------------------------------------------------
# Task 6: finishing from outside, and no leaks
# ---------------------------------------------------------------------------------------------


def test_finish_requests_from_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = create_requests(num_requests=3)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    scheduler.finish_requests(["0", "2", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert requests[0].status == RequestStatus.FINISHED_ABORTED
    assert requests[2].status == RequestStatus.FINISHED_ABORTED
    assert scheduler.running == [requests[1]] and len(scheduler.waiting) == 0
    assert "0" not in scheduler.kv_cache_manager.req_to_blocks
    assert scheduler.get_num_unfinished_requests() == 1
    out = scheduler.schedule()
    assert out.finished_req_ids == {"0", "2"}
    with pytest.raises(ValueError):
        scheduler.finish_requests("1", RequestStatus.RUNNING)
    assert requests[1].status == RequestStatus.RUNNING
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert_scheduler_empty(scheduler)


def test_no_block_leak():
    """Port of upstream test_memory_leak: five requests, one added per step, all finish."""
    scheduler = make_scheduler(enable_prefix_caching=True)
    requests = create_requests(num_requests=5, num_tokens=10, max_tokens=10, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
        out = scheduler.schedule()
        scheduler.update_from_output(out, make_output(out))
    while True:
        out = scheduler.schedule()
        if len(scheduler.running) == 0:
            break
        scheduler.update_from_output(out, make_output(out))
    assert_scheduler_empty(scheduler)
    assert all(len(r.output_token_ids) == 10 for r in requests)


# ---------------------------------------------------------------------------------------------
# Whole runs: invariants on random workloads, and the golden trace
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_invariants_hold_on_random_workloads(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    config = dict(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(8, 64),
        max_model_len=256,
        block_size=block_size,
        num_gpu_blocks=rng.randint(24, 48) // block_size * 4 + 2,
        enable_prefix_caching=rng.random() < 0.5,
        long_prefill_token_threshold=rng.choice([0, 0, 5]),
    )
    scheduler = make_scheduler(**config)
    hasher = get_request_block_hasher(block_size, sha256)
    shared = [rng.randrange(3, 90) for _ in range(2 * block_size)]
    arrivals: dict[int, list[Request]] = {}
    requests = []
    for i in range(10):
        prompt = (shared if rng.random() < 0.4 else []) + [rng.randrange(3, 90)
                                                             for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
        request = Request(f"q{i}", prompt, params, eos_token_id=None, block_hasher=hasher)
        requests.append(request)
        arrivals.setdefault(rng.randint(0, 15), []).append(request)
    runner = ToyModelRunner(block_size, config["num_gpu_blocks"], with_kv=False)

    def check(step, so, sch):
        check_step_invariants(sch, so)

    run_engine(scheduler, runner, arrivals, max_steps=2000, on_step=check)
    for request in requests:
        assert request.num_output_tokens == request.max_tokens
    assert_scheduler_empty(scheduler)


def _golden_module():
    path = HERE / "regen_golden.py"
    spec = importlib.util.spec_from_file_location("lab_03_01_regen_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_golden_trace():
    """Per-step decisions on a fixed workload equal the checked-in trace. If the reference
    changes on purpose, regenerate with ``python <this lab>/regen_golden.py``."""
    golden = json.loads((HERE / "golden_trace.json").read_text(encoding="utf-8"))["steps"]
    steps = _golden_module().trace(lab.Scheduler)
    for want, got in zip(golden, steps):
        assert got == want, f"step {want['step']} differs from the golden trace"
    assert len(steps) == len(golden), f"{len(steps)} steps, the golden trace has {len(golden)}"
    assert any(s["preempted"] for s in golden), "the workload must exercise preemption"
