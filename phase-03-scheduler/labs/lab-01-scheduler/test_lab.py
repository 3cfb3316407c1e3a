"""Graded tests of lab 03-01: the scheduler and continuous batching.

Tests are grouped by task, and each group uses only its task and the ones before it: where a
test needs a later task (admission, the stop conditions, aborts), it runs with the reference's
method in its place (``make_scheduler(upto=N)``), and where it needs requests already running,
it puts them there by hand (``run_by_hand``). So the number of passing tests grows after every
task you finish. The whole-run tests at the end (random workloads, the golden trace, no leak)
use all of your code.

Several tests port upstream's tests/v1/core/test_scheduler.py at v0.11.0 (requests scheduled
together, partial scheduling under a small budget, preemption during execution with
``num_blocks=11``, no block leak, stop conditions).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student, read
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.core.sched.scheduler import Scheduler as ReferenceScheduler
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import FinishReason, Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.toy_runner import ToyModelRunner, run_engine

lab = load_lab(__file__)
HERE = Path(__file__).resolve().parent
EOS = 2

# The methods of each task after task 2; `make_scheduler(upto=N)` takes the reference's for the
# tasks after N, so a test of task N needs only your tasks 1..N.
LATER_TASKS = {
    3: ("_preempt_by_recompute",),
    4: ("_schedule_waiting",),
    5: ("update_from_output",),
    6: ("finish_requests",),
}


# ---------------------------------------------------------------------------------------------
# Helpers (they touch `lab` only when a test calls them)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    """One root hash per test: requests hashed under different roots never share a prefix."""
    init_none_hash(sha256)


def make_scheduler(upto=6, **overrides):
    """Your Scheduler; with ``upto=N``, the reference's methods stand in for tasks after N."""
    kw = dict(
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        block_size=16,
        num_gpu_blocks=10000,
        enable_prefix_caching=False,
    )
    kw.update(overrides)
    return _scheduler_up_to(upto, SchedulerConfig(**kw), beside=lab)


@beside_the_student
def _scheduler_up_to(upto, config):
    """Built where your code runs (the class is made from yours there)."""
    cls = lab.Scheduler
    stand_ins = {
        name: vars(ReferenceScheduler)[name]
        for task, names in LATER_TASKS.items()
        if task > upto
        for name in names
    }
    if stand_ins:
        cls = type(f"SchedulerUpToTask{upto}", (lab.Scheduler,), stand_ins)
    return cls(config)


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
    """One token for every scheduled request, or ``tokens[request id]`` (a list; [] = still in
    prefill)."""
    tokens = tokens or {}
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [list(tokens[rid]) if rid in tokens else [default] for rid in req_ids]
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


@beside_the_student
def run_by_hand(scheduler, request, computed, outputs=()):
    """Put a request added with ``add_request`` into ``running`` as a step would have left it:
    its first ``computed`` tokens have KV (blocks claimed from the KV cache manager), then the
    runner sampled ``outputs``. Needs only task 1. (Done where your code runs: the queues are
    your scheduler's.)"""
    scheduler.waiting.remove(request)
    assert scheduler.kv_cache_manager.allocate_slots(request, computed) is not None, (
        f"set-up: the KV cache manager refused {computed} tokens of request "
        f"{request.request_id!r}"
    )
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = computed
    request.num_cached_tokens = 0
    scheduler.running.append(request)
    for token in outputs:
        request.append_output_token_ids(token)


@beside_the_student
def swap_out_by_hand(scheduler, request, queue="waiting"):
    """Move a request from ``queue`` to ``swapped`` as lab 03-03's preemption by swapping
    would: a running one lets its blocks go."""
    getattr(scheduler, queue).remove(request)
    if queue == "running":
        scheduler.kv_cache_manager.free(request)
    request.status = RequestStatus.SWAPPED
    scheduler.swapped.append(request)


@beside_the_student
def empty_by_hand(scheduler, *queues):
    for name in queues:
        getattr(scheduler, name).clear()


def free_blocks(scheduler):
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def usable_blocks(scheduler):
    return scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1


def ids(requests):
    return [r.request_id for r in requests]


def assert_scheduler_empty(scheduler):
    """Port of upstream's assert_scheduler_empty: nothing queued, nothing held. (The scheduler
    is read whole, once: where your code has its own process, each attribute asked one by one
    would be a round trip.)"""
    scheduler = read(scheduler)
    left = {
        "requests": sorted(scheduler.requests),
        "waiting": ids(scheduler.waiting),
        "running": ids(scheduler.running),
        "swapped": ids(scheduler.swapped),
    }
    assert not any(left.values()), (
        f"after every request finished the scheduler must be empty; still there: "
        f"{ {name: rids for name, rids in left.items() if rids} }"
    )
    free = scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
    assert free == usable_blocks(scheduler), (
        f"blocks leaked: {free} of the {usable_blocks(scheduler)} usable blocks are free")
    assert not scheduler.kv_cache_manager.req_to_blocks, "a finished request still has a table"
    for block in scheduler.kv_cache_manager.block_pool.blocks[1:]:
        assert block.ref_cnt == 0, f"block {block.block_id} kept ref_cnt {block.ref_cnt}"


def check_step_invariants(scheduler, so):
    """The invariants that every schedule() must keep (on the scheduler read whole, once)."""
    scheduler = read(scheduler)
    cfg = scheduler.scheduler_config
    total = sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens == total, (
        f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens}, the per-request counts "
        f"{so.num_scheduled_tokens} sum to {total}"
    )
    assert total <= cfg.max_num_batched_tokens, (
        f"token budget exceeded: {total} tokens scheduled, max_num_batched_tokens is "
        f"{cfg.max_num_batched_tokens}"
    )
    assert all(n >= 1 for n in so.num_scheduled_tokens.values()), (
        f"a scheduled request gets at least one token: {so.num_scheduled_tokens}"
    )
    assert len(scheduler.running) <= cfg.max_num_seqs, (
        f"{len(scheduler.running)} requests running, max_num_seqs is {cfg.max_num_seqs}"
    )
    assert sorted(so.scheduled_req_ids) == sorted(so.num_scheduled_tokens), (
        "scheduled requests and token counts")
    queues = ids(scheduler.running) + ids(scheduler.waiting) + ids(scheduler.swapped)
    assert sorted(queues) == sorted(scheduler.requests), "a request is in two queues or none"
    held = set(scheduler.kv_cache_manager.req_to_blocks)
    assert held == set(ids(scheduler.running)), "blocks must be held exactly by running requests"
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING, (
            f"request {r.request_id!r} is in running with status {r.status!r}"
        )
        table = scheduler.kv_cache_manager.req_to_blocks[r.request_id]
        assert len(table) * cfg.block_size >= r.num_computed_tokens, (
            f"request {r.request_id!r} computed {r.num_computed_tokens} tokens but holds "
            f"{len(table)} block(s) of {cfg.block_size}"
        )
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"request {r.request_id!r} is in waiting with status {r.status!r}"
        )


# ---------------------------------------------------------------------------------------------
# Task 1: requests in, and the counts
# ---------------------------------------------------------------------------------------------


def test_add_requests_queues_them_in_order():
    scheduler = make_scheduler()
    requests = create_requests(num_requests=5)
    assert scheduler.get_num_unfinished_requests() == 0, (
        "a new scheduler has 0 unfinished requests, get_num_unfinished_requests() gave "
        f"{scheduler.get_num_unfinished_requests()!r}"
    )
    assert scheduler.has_unfinished_requests() is False, (
        "has_unfinished_requests() must be False (a bool) before any request is added, got "
        f"{scheduler.has_unfinished_requests()!r}"
    )
    for i, request in enumerate(requests):
        scheduler.add_request(request)
        assert scheduler.requests[request.request_id] is request, (
            "add_request must store the request itself in scheduler.requests under its id "
            f"{request.request_id!r}; ids stored: {sorted(scheduler.requests)[:8]}"
        )
        assert len(scheduler.waiting) == i + 1, (
            f"after adding {i + 1} request(s) waiting holds {len(scheduler.waiting)}: add_request "
            "appends each request to waiting once"
        )
    assert list(scheduler.waiting) == requests, (
        "waiting must hold the requests in arrival order (appended at the back): want "
        f"{ids(requests)}, got {ids(scheduler.waiting)[:8]}"
    )
    assert scheduler.running == [], (
        "add_request only queues in waiting; running must stay empty, got "
        f"{ids(scheduler.running)[:8]}"
    )
    assert requests[0].status == RequestStatus.WAITING, (
        f"a queued request keeps its status WAITING, got {requests[0].status!r}"
    )
    assert scheduler.get_num_unfinished_requests() == 5, (
        "5 requests waiting: get_num_unfinished_requests() must be 5, got "
        f"{scheduler.get_num_unfinished_requests()!r}"
    )
    assert scheduler.has_unfinished_requests() is True, (
        "has_unfinished_requests() must be True (a bool) with 5 requests waiting, got "
        f"{scheduler.has_unfinished_requests()!r}"
    )


def test_unfinished_requests_counts_every_queue():
    """Waiting, running and swapped out (lab 03-03 fills `swapped`; here it is done by hand)."""
    scheduler = make_scheduler(block_size=4)
    waiting, running, swapped = create_requests(3, num_tokens=6, block_size=4)
    for request in (waiting, running, swapped):
        scheduler.add_request(request)
    run_by_hand(scheduler, running, 6)
    swap_out_by_hand(scheduler, swapped)
    for queues, want in (("waiting, running, swapped", 3), ("swapped", 1), ("", 0)):
        got = scheduler.get_num_unfinished_requests()
        assert got == want, (
            f"get_num_unfinished_requests counts waiting + running + swapped: with one request "
            f"in each of [{queues}] it is {want}, got {got}"
        )
        assert scheduler.has_unfinished_requests() is (want > 0), (
            f"has_unfinished_requests is {want > 0} with {want} unfinished request(s)"
        )
        empty_by_hand(scheduler, *(["waiting", "running"] if want == 3 else ["swapped"]))


@pytest.mark.parametrize(
    "case, numbers",
    [
        ("duplicate", []),
        ("too-long", ["64"]),             # 64 prompt tokens, max_model_len 64: no room left
        ("cannot-fit", ["6", "5"]),       # it may reach 21 tokens = 6 blocks; 5 are usable
        ("no-hasher", []),
        ("preempted", []),
        ("computed", []),
    ],
)
def test_add_request_rejects_bad_input_and_changes_nothing(case, numbers):
    """Refused with a ValueError naming the request (and, for the size checks, the numbers),
    before anything is queued. The cache is large enough that each check is the only reason."""
    blocks = 6 if case == "cannot-fit" else 40
    scheduler = make_scheduler(max_model_len=64, num_gpu_blocks=blocks, block_size=4,
                               enable_prefix_caching=True)
    first = create_requests(1, num_tokens=4, max_tokens=4, block_size=4)[0]
    scheduler.add_request(first)
    bad = create_requests(1, num_tokens=4, max_tokens=4, block_size=4, first_id=7)[0]
    if case == "duplicate":
        bad = create_requests(1, num_tokens=4, max_tokens=4, block_size=4)[0]
    elif case == "too-long":
        bad = create_requests(1, num_tokens=64, max_tokens=1, block_size=4, first_id=7)[0]
    elif case == "cannot-fit":
        bad = create_requests(1, num_tokens=11, max_tokens=10, block_size=4, first_id=7)[0]
    elif case == "no-hasher":
        bad = Request("7", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=EOS)
    elif case == "preempted":
        bad.status = RequestStatus.PREEMPTED
    else:
        bad.num_computed_tokens = 2
    with pytest.raises(ValueError) as excinfo:
        scheduler.add_request(bad)
    message = str(excinfo.value)
    assert bad.request_id in message, f"the message must name the request: {message!r}"
    for number in numbers:
        assert number in message, f"the message must give {number}: {message!r}"
    assert list(scheduler.waiting) == [first], (
        f"a refused request ({case}) must not be queued: waiting must be ['0'], got "
        f"{ids(scheduler.waiting)}: raise before appending"
    )
    assert list(scheduler.requests) == [first.request_id], (
        f"a refused request ({case}) must not be remembered: requests must be ['0'], got "
        f"{list(scheduler.requests)}: raise before storing it"
    )
    assert scheduler.get_num_unfinished_requests() == 1, (
        f"one accepted and one refused ({case}) request: get_num_unfinished_requests() must be 1, "
        f"got {scheduler.get_num_unfinished_requests()!r}"
    )


@pytest.mark.parametrize("case", ["longest-prompt", "exact-fit", "capped-by-max-model-len",
                                  "no-hasher-without-caching"])
def test_add_request_accepts_the_limits(case):
    """The checks refuse only what they must: a prompt of max_model_len - 1 tokens, a request
    that needs exactly the usable blocks, one whose max_tokens only max_model_len caps, and one
    without a hasher when caching is off."""
    caching = case != "no-hasher-without-caching"
    scheduler = make_scheduler(max_model_len=24, num_gpu_blocks=6, block_size=4,
                               enable_prefix_caching=caching)
    if case == "longest-prompt":  # 23 tokens + 1 output = 24 = 6 blocks > 5: make room
        scheduler = make_scheduler(max_model_len=24, num_gpu_blocks=7, block_size=4)
        request = create_requests(1, num_tokens=23, max_tokens=1, block_size=4)[0]
    elif case == "exact-fit":  # 12 + 8 = 20 tokens = 5 blocks = every usable block
        request = create_requests(1, num_tokens=12, max_tokens=8, block_size=4)[0]
    elif case == "capped-by-max-model-len":  # 10 + 1000 is capped at 24 tokens: 6 blocks
        scheduler = make_scheduler(max_model_len=24, num_gpu_blocks=7, block_size=4,
                                   enable_prefix_caching=True)
        request = create_requests(1, num_tokens=10, max_tokens=1000, block_size=4)[0]
    else:
        request = Request("0", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=EOS)
    scheduler.add_request(request)
    assert list(scheduler.waiting) == [request], (
        f"add_request must accept and queue the {case} request; waiting holds "
        f"{ids(scheduler.waiting)}"
    )
    assert scheduler.requests == {request.request_id: request}, (
        f"add_request must remember the {case} request (and only it) in requests; ids stored: "
        f"{list(scheduler.requests)}"
    )


# ---------------------------------------------------------------------------------------------
# Task 2: the running requests, the budget, preempt and retry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, outputs, computed, threshold, budget, max_model_len, want",
    [
        (10, 0, 0, 0, 100, 64, 10),   # what it lacks
        (10, 0, 3, 0, 100, 64, 7),
        (10, 0, 0, 4, 100, 64, 4),    # the long-prefill threshold
        (10, 0, 0, 1, 100, 64, 1),
        (10, 0, 0, 10, 100, 64, 10),
        (10, 0, 0, 12, 100, 64, 10),
        (10, 0, 0, 0, 3, 64, 3),      # the budget
        (10, 0, 0, 4, 3, 64, 3),
        (10, 0, 0, 0, 0, 64, 0),
        (10, 0, 10, 0, 100, 64, 0),   # nothing left to compute
        (11, 1, 10, 0, 100, 12, 1),   # the last position is max_model_len - 1
        (11, 1, 11, 0, 100, 12, 0),
        (11, 1, 12, 0, 100, 12, 0),   # never negative
    ],
)
def test_num_new_tokens(prompt, outputs, computed, threshold, budget, max_model_len, want):
    scheduler = make_scheduler(max_model_len=max_model_len, block_size=4,
                               long_prefill_token_threshold=threshold)
    request = create_requests(1, num_tokens=prompt, block_size=4)[0]
    for _ in range(outputs):
        request.append_output_token_ids(7)
    request.num_computed_tokens = computed
    assert scheduler._num_new_tokens(request, budget) == want, (
        f"_num_new_tokens with {computed} of {prompt + outputs} tokens computed, threshold "
        f"{threshold}, budget {budget}, max_model_len {max_model_len}: want {want}, got "
        f"{scheduler._num_new_tokens(request, budget)!r}"
    )
    assert request.num_computed_tokens == computed and request.num_tokens == prompt + outputs, (
        f"_num_new_tokens must change nothing: num_computed_tokens {request.num_computed_tokens} "
        f"(was {computed}), num_tokens {request.num_tokens} (was {prompt + outputs})"
    )


def test_num_new_tokens_counts_the_draft_tokens():
    """Draft tokens (lab 04-04's speculative decoding) are tokens the request lacks: they come
    out of the same budget and stop at the same caps."""
    scheduler = make_scheduler(max_model_len=16, block_size=4)
    request = create_requests(1, num_tokens=10, block_size=4)[0]
    request.append_output_token_ids(7)
    request.num_computed_tokens = 10
    request.spec_token_ids = [3, 4, 5]
    for budget, want in ((100, 4), (2, 2)):
        got = scheduler._num_new_tokens(request, budget)
        assert got == want, (
            f"_num_new_tokens of a request with 11 tokens, 10 computed and 3 drafts, budget "
            f"{budget}: want {want} (the last token and the drafts), got {got!r}; count "
            "request.num_tokens_with_spec"
        )
    request.spec_token_ids = [3, 4, 5, 6, 7, 8]
    got = scheduler._num_new_tokens(request, 100)
    assert got == 5, (
        f"6 drafts after 11 tokens in a 16-token model: the last position is 15, so 5 tokens "
        f"(positions 10..14 hold the last token and 4 drafts), got {got!r}"
    )


def test_running_requests_are_scheduled_oldest_first_within_the_budget():
    """Three running requests each lack 4 tokens of their prompt; a budget of 5 gives the oldest
    4, the next 1 and the newest nothing, and the next step continues from there. A request with
    nothing to do (its prompt is computed, its token not sampled yet) is passed over."""
    scheduler = make_scheduler(upto=2, block_size=4)
    requests = create_requests(3, num_tokens=8, block_size=4)
    for request in requests:
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 4)
    scheduler.max_num_scheduled_tokens = 5  # the budget of every following step

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "1": 1}, (
        f"step 1, budget 5, oldest first: 0 gets its 4, 1 the last 1, 2 nothing (take each "
        f"request's tokens out of the budget); got {out.num_scheduled_tokens}"
    )
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["0", "1"], f"step 1's running requests, in order: {cached.req_ids}"
    assert cached.num_computed_tokens == [4, 4], (
        f"the output carries the counts before the step: [4, 4], got {cached.num_computed_tokens}"
    )
    assert cached.resumed_from_preemption == [False, False], "no request resumed in step 1"
    assert out.scheduled_new_reqs == [], "no waiting request: no new request scheduled"
    assert ids(scheduler.running) == ["0", "1", "2"], f"running: {ids(scheduler.running)}"
    # Advanced once (by schedule(), after packaging the output), not twice.
    computed = [r.num_computed_tokens for r in requests]
    assert computed == [8, 5, 4], (
        f"schedule() advances num_computed_tokens once by what it scheduled: [8, 5, 4], got "
        f"{computed}"
    )

    out = scheduler.schedule()  # "0" has nothing to do; the ones behind it still run
    assert out.num_scheduled_tokens == {"1": 3, "2": 2}, (
        f"step 2: 0 has nothing to do and is passed over (not a reason to stop), 1 gets its "
        f"last 3 and 2 the remaining 2; got {out.num_scheduled_tokens}"
    )
    assert ids(scheduler.running) == ["0", "1", "2"], f"running: {ids(scheduler.running)}"
    computed = [r.num_computed_tokens for r in requests]
    assert computed == [8, 8, 6], f"after step 2 the counts are [8, 8, 6], got {computed}"

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"2": 2}, (
        f"step 3: only 2 has tokens left (2 of them), got {out.num_scheduled_tokens}"
    )

    out = scheduler.schedule()  # nobody has anything to do
    assert out.num_scheduled_tokens == {} and out.total_num_scheduled_tokens == 0, (
        f"nobody has anything to do: an empty step, got {out.num_scheduled_tokens}"
    )
    assert ids(scheduler.running) == ["0", "1", "2"], (
        f"requests with nothing to do stay running: {ids(scheduler.running)}"
    )


def test_a_request_with_nothing_to_do_does_not_block_the_others():
    """Steps overlap: "a" was scheduled for its whole prompt and its token has not come back
    yet, so it has nothing to do; "b" behind it is in the middle of its prompt."""
    scheduler = make_scheduler(upto=2, block_size=4, max_num_batched_tokens=16)
    a, b = create_requests(2, num_tokens=8, block_size=4)
    b_long = create_requests(1, num_tokens=40, block_size=4, first_id=1)[0]
    scheduler.add_request(a)
    scheduler.add_request(b_long)
    run_by_hand(scheduler, a, 8)
    run_by_hand(scheduler, b_long, 8)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"1": 16}, (
        "'0' has nothing to do (prompt computed, no token yet): pass over it and give '1' 16 of "
        f"its prompt tokens (the budget); got {out.num_scheduled_tokens}"
    )
    assert out.scheduled_cached_reqs.req_ids == ["1"], (
        "only '1' runs in this step: scheduled_cached_reqs.req_ids must be ['1'], got "
        f"{out.scheduled_cached_reqs.req_ids}"
    )
    assert ids(scheduler.running) == ["0", "1"] and a.status == RequestStatus.RUNNING, (
        "a request with nothing to do stays running: running must be ['0', '1'] with '0' RUNNING; "
        f"got {ids(scheduler.running)}, '0' is {a.status!r}"
    )
    assert b_long.num_computed_tokens == 24, (
        "'1' had 8 computed + 16 scheduled: 24 after schedule() (which advances it once; "
        f"_schedule_running must not), got {b_long.num_computed_tokens}"
    )


def test_a_running_request_gets_only_its_new_blocks():
    """The output carries a running request's *new* blocks (appended by the runner), None when
    its token fits the blocks it has."""
    scheduler = make_scheduler(upto=2, block_size=4)
    request = create_requests(1, num_tokens=6, block_size=4)[0]
    scheduler.add_request(request)
    run_by_hand(scheduler, request, 6, outputs=[5])
    table = scheduler.kv_cache_manager.get_block_ids("0")[0]
    assert len(table) == 2, (
        f"test premise: 6 computed tokens in blocks of 4 take 2 blocks, the table has {len(table)}"
    )
    out = scheduler.schedule()  # position 6: still block 1
    assert out.num_scheduled_tokens == {"0": 1}, (
        "the sampled token (position 6) is the one token to schedule: want '0': 1, got "
        f"{out.num_scheduled_tokens}"
    )
    assert out.scheduled_cached_reqs.new_block_ids == [None], (
        "position 6 fits the request's second block: new_block_ids must be [None] (no new block), "
        f"got {out.scheduled_cached_reqs.new_block_ids}; store what allocate_slots returned"
    )
    request.append_output_token_ids(5)
    out = scheduler.schedule()  # position 7: still block 1
    assert out.scheduled_cached_reqs.new_block_ids == [None], (
        "position 7 still fits the second block: new_block_ids must be [None], got "
        f"{out.scheduled_cached_reqs.new_block_ids}; store what allocate_slots returned"
    )
    request.append_output_token_ids(5)
    out = scheduler.schedule()  # position 8: a third block
    table = scheduler.kv_cache_manager.get_block_ids("0")[0]
    assert len(table) == 3, (
        "position 8 needs a third block: the table must have 3 blocks after schedule(), got "
        f"{len(table)}"
    )
    assert out.scheduled_cached_reqs.new_block_ids == [([table[2]],)], (
        f"the output carries only the new block: new_block_ids must be [([{table[2]}],)], got "
        f"{out.scheduled_cached_reqs.new_block_ids}"
    )
    assert request.num_computed_tokens == 9, (
        f"three one-token steps from 6 computed tokens: 9, got {request.num_computed_tokens}"
    )


def _full_cache_of_three(upto, **overrides):
    """9 usable blocks of 4 tokens held by three running requests of 12 computed tokens, each
    with one sampled token: the next step needs a fourth block for each."""
    scheduler = make_scheduler(upto=upto, block_size=4, num_gpu_blocks=10, **overrides)
    requests = create_requests(3, num_tokens=12, max_tokens=8, block_size=4, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 12, outputs=[5])
    assert free_blocks(scheduler) == 0, f"set-up: the cache is full, {free_blocks(scheduler)} free"
    return scheduler, requests


def test_out_of_blocks_preempts_the_newest_and_retries():
    scheduler, requests = _full_cache_of_three(upto=2)
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["2"], (
        f"out of blocks, the newest running request (2, the back of running) is preempted; "
        f"preempted: {out.preempted_req_ids}"
    )
    assert out.num_scheduled_tokens == {"0": 1, "1": 1}, (
        f"after the preemption the step retries: 0 and 1 get one token each, got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.running) == ["0", "1"], f"running: {ids(scheduler.running)}"
    assert requests[2].status == RequestStatus.PREEMPTED, (
        f"the victim's status is PREEMPTED, not {requests[2].status!r}"
    )
    assert scheduler.stats.num_preemptions == 1, (
        f"one preemption counted, got {scheduler.stats.num_preemptions}"
    )
    assert "2" not in out.scheduled_req_ids, "the victim is not scheduled in the step it left"
    free = free_blocks(scheduler)
    assert free == 1, f"the victim's 3 blocks freed, 2 claimed: 1 free, got {free}"


def test_the_victim_is_the_last_of_running_not_the_latest_arrival():
    """Running order is admission order, and a re-admitted request joins at the back: the
    victim is the last request of `running`, whatever its id or arrival time."""
    scheduler = make_scheduler(upto=2, block_size=4, num_gpu_blocks=10)
    requests = create_requests(3, num_tokens=12, max_tokens=8, block_size=4, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
    for i in (2, 0, 1):
        run_by_hand(scheduler, requests[i], 12, outputs=[5])
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["1"], (
        "the victim is the last of running (ordered 2, 0, 1), so '1' is preempted, not the latest "
        f"arrival; preempted: {out.preempted_req_ids}"
    )
    assert out.num_scheduled_tokens == {"2": 1, "0": 1}, (
        "after preempting '1', '2' and '0' get one token each, in running order; got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.running) == ["2", "0"], (
        f"running after the step must be ['2', '0'], got {ids(scheduler.running)}"
    )


def test_one_request_may_preempt_several():
    """"0" needs four more blocks for its next 16 prompt tokens; preempting the newest ("3", two
    blocks) is not enough, so "2" goes too. "1" still gets its token."""
    scheduler = make_scheduler(upto=2, block_size=4, num_gpu_blocks=10)
    r0 = create_requests(1, num_tokens=20, block_size=4)[0]
    r1 = create_requests(1, num_tokens=15, block_size=4, first_id=1)[0]
    r2, r3 = create_requests(2, num_tokens=8, block_size=4, first_id=2)
    for request in (r0, r1, r2, r3):
        scheduler.add_request(request)
    run_by_hand(scheduler, r0, 4)                 # 1 block
    run_by_hand(scheduler, r1, 15, outputs=[5])   # 4 blocks; its token fits the 4th
    run_by_hand(scheduler, r2, 8, outputs=[5])    # 2 blocks
    run_by_hand(scheduler, r3, 8, outputs=[5])    # 2 blocks
    assert free_blocks(scheduler) == 0, (
        f"test premise: 1 + 4 + 2 + 2 blocks fill the 9 usable ones, {free_blocks(scheduler)} free"
    )
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["3", "2"], (
        "'0' needs 4 new blocks: preempt the newest ('3', 2 blocks), retry, then preempt '2'; "
        f"preempted: {out.preempted_req_ids}"
    )
    assert out.num_scheduled_tokens == {"0": 16, "1": 1}, (
        "after the two preemptions '0' gets its 16 prompt tokens and '1' its one token; got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.running) == ["0", "1"], (
        f"running must be ['0', '1'] after '3' and '2' were preempted, got {ids(scheduler.running)}"
    )
    assert r0.num_computed_tokens == 20, (
        "'0' had 4 computed and was scheduled for 16: 20 after schedule(), got "
        f"{r0.num_computed_tokens}"
    )
    assert len(scheduler.kv_cache_manager.get_block_ids("0")[0]) == 5, (
        "'0' holds 5 blocks for its 20 tokens, got "
        f"{len(scheduler.kv_cache_manager.get_block_ids('0')[0])}"
    )


def test_a_request_that_is_the_newest_preempts_itself():
    """"1" needs a sixth block and is the newest running request: it preempts itself and is
    not scheduled. "0", before it, got its token without a new block."""
    scheduler = make_scheduler(upto=2, block_size=4, num_gpu_blocks=10)
    r0 = create_requests(1, num_tokens=15, block_size=4)[0]
    r1 = create_requests(1, num_tokens=20, block_size=4, first_id=1)[0]
    for request in (r0, r1):
        scheduler.add_request(request)
    run_by_hand(scheduler, r0, 15, outputs=[5])   # 4 blocks
    run_by_hand(scheduler, r1, 20, outputs=[5])   # 5 blocks, the token needs a 6th
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["1"], (
        "'1' needs a sixth block and is itself the newest running request: it preempts itself; "
        f"preempted: {out.preempted_req_ids}"
    )
    assert out.num_scheduled_tokens == {"0": 1}, (
        "only '0' is scheduled (its token fits its 4th block); a request that preempted itself is "
        f"not; got {out.num_scheduled_tokens}"
    )
    assert out.scheduled_cached_reqs.req_ids == ["0"], (
        f"scheduled_cached_reqs.req_ids must be ['0'], got {out.scheduled_cached_reqs.req_ids}"
    )
    assert ids(scheduler.running) == ["0"], (
        f"running must be ['0'] after '1' preempted itself, got {ids(scheduler.running)}"
    )
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0, (
        f"the self-preempted '1' is PREEMPTED with 0 computed tokens; got {r1.status!r}, "
        f"{r1.num_computed_tokens}"
    )


# ---------------------------------------------------------------------------------------------
# Task 3: preemption by recompute
# ---------------------------------------------------------------------------------------------


def test_the_victim_drops_its_kv_and_waits_at_the_head():
    scheduler, requests = _full_cache_of_three(upto=3)
    late = create_requests(1, num_tokens=3, max_tokens=2, block_size=4, first_id=3)[0]
    scheduler.add_request(late)
    out = scheduler.schedule()
    victim = requests[2]
    assert out.preempted_req_ids == ["2"], (
        "out of blocks, the newest running request ('2') is preempted; preempted: "
        f"{out.preempted_req_ids}"
    )
    assert victim.status == RequestStatus.PREEMPTED, (
        f"_preempt_by_recompute sets the victim's status to PREEMPTED, got {victim.status!r}"
    )
    assert victim.num_computed_tokens == 0, (
        "_preempt_by_recompute resets the victim's num_computed_tokens to 0 (its KV is dropped), "
        f"got {victim.num_computed_tokens}"
    )
    assert list(victim.output_token_ids) == [5], "its output is kept (and recomputed)"
    assert ids(scheduler.waiting) == ["2", "3"], "the victim goes ahead of those waiting"
    assert "2" not in scheduler.kv_cache_manager.req_to_blocks, "its blocks must be freed"
    assert free_blocks(scheduler) == 1, (
        "the victim's 3 blocks go back and '0' and '1' take one each: 1 free, got "
        f"{free_blocks(scheduler)}; free the victim with kv_cache_manager.free"
    )
    assert "3" not in out.num_scheduled_tokens, "no admission in a step that preempted"
    stats = scheduler.stats
    assert (stats.num_preemptions, stats.num_recompute_preemptions) == (1, 1), (
        "one preemption, by recompute: counts (1, 1), got "
        f"{(stats.num_preemptions, stats.num_recompute_preemptions)}; hand the victim to "
        "self._preempt (it counts), count nothing else"
    )
    assert stats.num_recomputed_tokens == 12, (
        f"the victim's 12 computed tokens count as recomputed, got {stats.num_recomputed_tokens}; "
        "self._preempt counts them, count nothing else"
    )
    assert victim.num_preemptions == 1, (
        f"the victim was preempted once: num_preemptions 1, got {victim.num_preemptions}; "
        "self._preempt counts it, count nothing else"
    )


def test_two_victims_wait_in_preemption_order_before_the_rest():
    """Each victim goes to the head: the one preempted last waits first (it is older)."""
    scheduler = make_scheduler(upto=3, block_size=4, num_gpu_blocks=10)
    r0 = create_requests(1, num_tokens=20, block_size=4)[0]
    r1 = create_requests(1, num_tokens=15, block_size=4, first_id=1)[0]
    r2, r3, r4 = create_requests(3, num_tokens=8, block_size=4, first_id=2)
    for request in (r0, r1, r2, r3, r4):
        scheduler.add_request(request)
    for request, n in ((r0, 4), (r1, 15), (r2, 8), (r3, 8)):
        run_by_hand(scheduler, request, n, outputs=[5] if n > 4 else [])
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["3", "2"], (
        "'0' needs 4 blocks: '3' then '2' are preempted (newest first); preempted: "
        f"{out.preempted_req_ids}"
    )
    assert ids(scheduler.waiting) == ["2", "3", "4"], (
        "each victim goes to the head of waiting: want ['2', '3', '4'], got "
        f"{ids(scheduler.waiting)}; _preempt_by_recompute uses appendleft"
    )
    assert free_blocks(scheduler) == 0, (
        f"'3' and '2' free 4 blocks and '0' takes all 4: 0 free, got {free_blocks(scheduler)}"
    )


def test_the_victim_comes_back_first_with_its_whole_table():
    """Three decoding requests outgrow a small cache: the newest is preempted, goes to the head
    of the waiting queue, nothing is admitted in that step, and it is re-admitted as a resumed
    request (with its whole new block table) before a later arrival."""
    scheduler = make_scheduler(upto=3, block_size=4, num_gpu_blocks=10,
                               max_num_batched_tokens=64)
    requests = create_requests(num_requests=3, num_tokens=12, max_tokens=8, block_size=4,
                               ignore_eos=True)
    late = create_requests(1, num_tokens=3, max_tokens=2, block_size=4, first_id=3)[0]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # 3 x 12 tokens = 9 blocks: the cache is full
    free = free_blocks(scheduler)
    assert free == 0, f"3 prompts of 12 fill all 9 blocks; {free} free"
    scheduler.update_from_output(out, make_output(out, default=5))
    scheduler.add_request(late)
    out = scheduler.schedule()  # everyone needs a 4th block for token 13
    assert out.preempted_req_ids == ["2"], (
        f"everyone needs a 4th block and none is free: the newest (2) is preempted; preempted: "
        f"{out.preempted_req_ids}"
    )
    assert ids(scheduler.running) == ["0", "1"], f"running: {ids(scheduler.running)}"
    assert ids(scheduler.waiting) == ["2", "3"], (
        f"the victim waits at the head of waiting, before the later arrival 3: "
        f"{ids(scheduler.waiting)}"
    )
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
            ids_now = cached.new_block_ids[cached.req_ids.index("2")][0]
            table = scheduler.kv_cache_manager.get_block_ids("2")[0]
            assert ids_now == table, (
                f"a resumed request's new_block_ids is its whole new table {table}, got {ids_now}"
            )
        if any(n.req_id == "3" for n in out.scheduled_new_reqs):
            admitted_late_at = step
    assert resumed_at is not None and admitted_late_at is not None, (
        f"the victim must come back as resumed (step {resumed_at}) and the late request be "
        f"admitted (step {admitted_late_at}); None: it never happened"
    )
    assert resumed_at <= admitted_late_at, (
        f"the victim resumed at step {resumed_at}, after the later arrival (step "
        f"{admitted_late_at}): it waits at the head of waiting"
    )
    outputs = [len(r.output_token_ids) for r in requests]
    assert outputs == [8, 8, 8], f"every request ends with max_tokens=8 tokens, got {outputs}"
    assert_scheduler_empty(scheduler)


def _victim_with_a_cached_prefix(upto):
    """Prefix caching on, 9 usable blocks held by "0", "1", "2" (12 computed tokens each, three
    full cached blocks); "0" and "2" have sampled a token. "0" needs a fourth block: "2" is
    preempted, and "0" reuses the block freed first, the victim's last one. Then "1" is
    aborted, which makes room for the victim again."""
    scheduler = make_scheduler(upto=upto, block_size=4, num_gpu_blocks=10,
                               enable_prefix_caching=True)
    requests = create_requests(3, num_tokens=12, max_tokens=8, block_size=4, ignore_eos=True)
    for request, outputs in zip(requests, ([5], [], [5])):
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 12, outputs=outputs)
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["2"] and out.num_scheduled_tokens == {"0": 1}, (
        f"set-up: request 0 needs a block, so the last running request (2) is preempted and 0 "
        f"alone runs one token; got preempted {out.preempted_req_ids}, scheduled "
        f"{out.num_scheduled_tokens}"
    )
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    return scheduler, requests


def test_preempted_blocks_stay_in_the_prefix_cache():
    """A recompute preemption frees the blocks but keeps their hashes: the victim's
    re-admission finds its first two blocks in the cache (its third was reused) and computes
    only the rest."""
    scheduler, requests = _victim_with_a_cached_prefix(upto=3)
    out = scheduler.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["2"] and cached.resumed_from_preemption == [True], (
        f"the victim comes back as a resumed request: req_ids {cached.req_ids}, resumed "
        f"{cached.resumed_from_preemption}"
    )
    assert cached.num_computed_tokens == [8], (
        f"its first two blocks (8 tokens) are prefix-cache hits, got {cached.num_computed_tokens}"
    )
    assert out.num_scheduled_tokens == {"2": 5}, (
        f"it computes only the other 5 of its 13 tokens, got {out.num_scheduled_tokens}"
    )
    assert requests[2].num_computed_tokens == 13, (
        f"after the step it has computed 13 tokens, got {requests[2].num_computed_tokens}"
    )


def test_preempt_during_execution():
    """Port of upstream test_preempt_during_execution: 10 usable blocks (block 0 is null)."""
    scheduler = make_scheduler(upto=3, max_num_batched_tokens=100, block_size=16,
                               num_gpu_blocks=11)
    requests = create_requests(num_requests=2, num_tokens=80, block_size=16)
    scheduler.add_request(requests[0])
    output0 = scheduler.schedule()
    assert len(output0.num_scheduled_tokens) == 1, (
        f"step 1 schedules only '0', got {output0.num_scheduled_tokens}"
    )
    assert len(output0.scheduled_new_reqs[0].block_ids[0]) == 5, (
        "'0's 80 prompt tokens take 5 blocks of 16, got "
        f"{len(output0.scheduled_new_reqs[0].block_ids[0])}"
    )

    # The second request is scheduled while the first one's step is still running.
    scheduler.add_request(requests[1])
    output1 = scheduler.schedule()
    assert len(output1.num_scheduled_tokens) == 1, (
        "step 2: '0' awaits its token (nothing to do) and '1' is admitted: one request scheduled, "
        f"got {output1.num_scheduled_tokens}"
    )
    assert len(output1.scheduled_new_reqs[0].block_ids[0]) == 5, (
        "'1's 80 prompt tokens take 5 blocks of 16, got "
        f"{len(output1.scheduled_new_reqs[0].block_ids[0])}"
    )

    scheduler.update_from_output(output0, make_output(output0))
    # Request 0 needs a sixth block: the cache is full, so the newest request is preempted.
    output2 = scheduler.schedule()
    assert scheduler.running == [requests[0]], (
        "'0' needs a sixth block and the cache is full: the newest ('1') is preempted and only '0' "
        f"runs; running: {ids(scheduler.running)}"
    )
    assert requests[1].status == RequestStatus.PREEMPTED, (
        f"the victim '1' is PREEMPTED, got {requests[1].status!r}"
    )
    assert requests[1].num_computed_tokens == 0, (
        f"the victim '1' has num_computed_tokens reset to 0, got {requests[1].num_computed_tokens}"
    )
    assert list(scheduler.waiting) == [requests[1]], (
        f"the victim '1' waits again: waiting must be ['1'], got {ids(scheduler.waiting)}"
    )
    assert output2.preempted_req_ids == ["1"], (
        f"preempted_req_ids must be ['1'], got {output2.preempted_req_ids}"
    )
    assert output2.num_scheduled_tokens == {"0": 1}, (
        f"'0' gets one token (its sampled one), got {output2.num_scheduled_tokens}"
    )

    # The preempted request still receives the token of the step it was part of.
    scheduler.update_from_output(output1, make_output(output1, {"1": [42]}))
    assert list(requests[1].output_token_ids) == [42], (
        "a request preempted after it was scheduled still receives that step's token: '1' must "
        f"have [42], got {list(requests[1].output_token_ids)}"
    )


# ---------------------------------------------------------------------------------------------
# Task 4: admission, first come first served
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_requests_are_scheduled_together(enable_prefix_caching):
    """Port of upstream test_schedule: ten prompts fit the budget, so all run in step 1."""
    scheduler = make_scheduler(upto=4, enable_prefix_caching=enable_prefix_caching)
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == len(requests), (
        "all 10 prompts fit the budget: 10 new requests in step 1, got "
        f"{len(output.scheduled_new_reqs)}"
    )
    assert output.scheduled_cached_reqs.num_reqs == 0, (
        "nothing ran before: scheduled_cached_reqs must be empty, got "
        f"{output.scheduled_cached_reqs.num_reqs}; an admitted WAITING request is a new request"
    )
    assert len(output.finished_req_ids) == 0, (
        "nothing finished: finished_req_ids must be empty, got "
        f"{sorted(output.finished_req_ids)[:8]}"
    )
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        assert num_tokens == len(requests[int(req_id)].prompt_token_ids), (
            f"request {req_id!r} gets its whole prompt "
            f"({len(requests[int(req_id)].prompt_token_ids)} tokens), got {num_tokens}"
        )
    assert output.total_num_scheduled_tokens == 100, (
        "10 prompts of 10 tokens: 100 tokens scheduled in all, got "
        f"{output.total_num_scheduled_tokens}"
    )
    assert len(scheduler.waiting) == 0, (
        f"every request is admitted: waiting must be empty, got {ids(scheduler.waiting)[:8]}"
    )
    assert scheduler.running == requests, (
        f"admitted requests join running in order: want {ids(requests)}, got "
        f"{ids(scheduler.running)[:12]}"
    )
    for request in requests:
        assert request.status == RequestStatus.RUNNING, (
            f"an admitted request is RUNNING, {request.request_id!r} is {request.status!r}"
        )
        assert request.num_computed_tokens == 10, (  # advanced right after scheduling
            f"{request.request_id!r} has 10 computed tokens after schedule(), got "
            f"{request.num_computed_tokens}: _schedule_waiting sets it to the hit (0), schedule() "
            "adds the tokens"
        )
        assert request.num_cached_tokens == 0, (
            f"no prefix hit: {request.request_id!r} has num_cached_tokens 0, got "
            f"{request.num_cached_tokens}; set it to the hit while it is unset (negative)"
        )
    for new, request in zip(output.scheduled_new_reqs, requests):
        assert new.req_id == request.request_id, (
            f"scheduled_new_reqs follow admission order: want {request.request_id!r}, got "
            f"{new.req_id!r}"
        )
        assert new.num_computed_tokens == 0, (  # the output carries the count before the step
            f"the output carries num_computed_tokens before the step (0), {new.req_id!r} has "
            f"{new.num_computed_tokens}; do not advance it in _schedule_waiting"
        )
        assert new.block_ids == scheduler.kv_cache_manager.get_block_ids(new.req_id), (
            "a new request carries its whole block table "
            f"{scheduler.kv_cache_manager.get_block_ids(new.req_id)}, got {new.block_ids}"
        )
        assert len(new.block_ids[0]) == 1, (
            f"a 10-token prompt takes 1 block of 16, {new.req_id!r} got {len(new.block_ids[0])}"
        )


def test_partial_scheduling_under_a_small_budget():
    """Port of upstream test_schedule_concurrent_partial_requests (threshold 400, budget 1024)."""
    scheduler = make_scheduler(upto=4, max_num_batched_tokens=1024,
                               long_prefill_token_threshold=400)
    requests = create_requests(num_requests=3, num_tokens=800)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 3, (
        f"step 1 admits all 3 requests, got {len(output.scheduled_new_reqs)} new"
    )
    assert [output.num_scheduled_tokens[r.request_id] for r in requests] == [400, 400, 224], (
        "threshold 400, budget 1024: the three prompts get [400, 400, 224], got "
        f"{[output.num_scheduled_tokens.get(r.request_id) for r in requests]}"
    )
    scheduler.update_from_output(output, make_output(output, {r.request_id: [] for r in requests}))

    output1 = scheduler.schedule()
    assert len(output1.scheduled_new_reqs) == 0, (
        f"step 2: no new request (all three already run), got {len(output1.scheduled_new_reqs)}"
    )
    assert output1.scheduled_cached_reqs.num_reqs == 3, (
        "step 2: the 3 running requests are scheduled as cached requests, got "
        f"{output1.scheduled_cached_reqs.num_reqs}"
    )
    assert output1.scheduled_cached_reqs.num_computed_tokens == [400, 400, 224], (
        "step 2's output carries each count before the step, [400, 400, 224], got "
        f"{output1.scheduled_cached_reqs.num_computed_tokens}"
    )
    assert [output1.num_scheduled_tokens[r.request_id] for r in requests] == [400, 400, 224], (
        "step 2, threshold 400, budget 1024: [400, 400, 224] again, got "
        f"{[output1.num_scheduled_tokens.get(r.request_id) for r in requests]}"
    )
    scheduler.update_from_output(output1, make_output(output1, {"2": []}))

    output2 = scheduler.schedule()
    assert [output2.num_scheduled_tokens[r.request_id] for r in requests] == [1, 1, 800 - 448], (
        "step 3: '0' and '1' decode 1 token each, '2' takes the 352 left of its prompt; got "
        f"{[output2.num_scheduled_tokens.get(r.request_id) for r in requests]}"
    )
    assert len(scheduler.running) == 3, f"all 3 requests still run, got {ids(scheduler.running)}"


def test_budget_splits_a_prompt_and_the_rest_waits():
    """Without a threshold the budget alone chunks: the second prompt gets what is left."""
    scheduler = make_scheduler(upto=4, max_num_batched_tokens=100)
    requests = create_requests(num_requests=3, num_tokens=80)
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 80, "1": 20}, (
        "budget 100: '0' gets its 80 prompt tokens, '1' the 20 left; got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.waiting) == ["2"], (
        f"no budget is left for '2': it keeps waiting; waiting: {ids(scheduler.waiting)}"
    )
    scheduler.update_from_output(out, make_output(out, {"1": []}))
    out = scheduler.schedule()
    # Running first: "0" decodes, "1" finishes its prompt, then "2" takes the rest of the budget.
    assert out.num_scheduled_tokens == {"0": 1, "1": 60, "2": 39}, (
        "running first: '0' decodes 1, '1' finishes its prompt (60), then '2' takes the 39 left; "
        f"got {out.num_scheduled_tokens}"
    )
    assert out.scheduled_cached_reqs.req_ids == ["0", "1"], (
        "'0' and '1' are the running (cached) requests, in order; got "
        f"{out.scheduled_cached_reqs.req_ids}"
    )
    assert [n.req_id for n in out.scheduled_new_reqs] == ["2"], (
        f"'2' is the one new request, got {[n.req_id for n in out.scheduled_new_reqs]}"
    )


def test_no_admission_once_the_running_requests_took_the_budget():
    scheduler = make_scheduler(upto=4, max_num_batched_tokens=8, block_size=4)
    running = create_requests(1, num_tokens=20, block_size=4)[0]
    waiting = create_requests(1, num_tokens=2, block_size=4, first_id=1)[0]
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_by_hand(scheduler, running, 4)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 8}, (
        "budget 8: the running '0' takes all 8, nothing is left for '1'; got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.waiting) == ["1"] and waiting.status == RequestStatus.WAITING, (
        f"no budget left: '1' stays WAITING in waiting; waiting {ids(scheduler.waiting)}, '1' is "
        f"{waiting.status!r}"
    )


@pytest.mark.parametrize("threshold", [1, 5, 12])
def test_waiting_requests_are_capped_by_the_threshold(threshold):
    scheduler = make_scheduler(upto=4, max_num_batched_tokens=64,
                               long_prefill_token_threshold=threshold)
    requests = create_requests(3, num_tokens=12)
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": threshold, "1": threshold, "2": threshold}, (
        f"long_prefill_token_threshold={threshold}: each 12-token prompt gets {threshold} tokens, "
        f"got {out.num_scheduled_tokens}"
    )
    assert [r.num_computed_tokens for r in requests] == [threshold] * 3, (
        f"after schedule() each request has {threshold} computed tokens, got "
        f"{[r.num_computed_tokens for r in requests]}"
    )


def test_the_last_token_of_the_budget_admits_a_request():
    """Running requests leave exactly 1 token of the budget: the next waiting request is
    admitted with it (a chunk of one token)."""
    scheduler = make_scheduler(upto=4, max_num_batched_tokens=9, block_size=4)
    running = create_requests(1, num_tokens=20, block_size=4)[0]
    waiting = create_requests(1, num_tokens=6, block_size=4, first_id=1)[0]
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_by_hand(scheduler, running, 12)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 8, "1": 1}, (
        "budget 9: '0' takes its 8 missing tokens and '1' is admitted with the last one; got "
        f"{out.num_scheduled_tokens}"
    )
    assert waiting.status == RequestStatus.RUNNING and waiting.num_computed_tokens == 1, (
        f"'1' admitted with one token: RUNNING with 1 computed token; got {waiting.status!r}, "
        f"{waiting.num_computed_tokens}"
    )


@pytest.mark.parametrize("already_running", [0, 2])
def test_max_num_seqs_caps_the_running_queue(already_running):
    scheduler = make_scheduler(upto=4, max_num_seqs=3, block_size=4)
    requests = create_requests(num_requests=6, block_size=4)
    for request in requests:
        scheduler.add_request(request)
    for request in requests[:already_running]:
        run_by_hand(scheduler, request, 10, outputs=[5])
    out = scheduler.schedule()
    assert len(scheduler.running) == 3, (
        f"max_num_seqs=3: 3 requests run after the step, got {ids(scheduler.running)}"
    )
    admitted = [n.req_id for n in out.scheduled_new_reqs]
    assert admitted == [str(i) for i in range(already_running, 3)], (
        f"with {already_running} running, the first waiting ones are admitted in order up to 3 "
        f"running; admitted {admitted}"
    )
    assert ids(scheduler.waiting) == [str(i) for i in range(3, 6)], (
        f"'3', '4', '5' keep waiting in order, got {ids(scheduler.waiting)}"
    )


def test_admission_stops_at_the_first_request_that_does_not_fit():
    """FCFS: "1" needs 4 blocks and 3 are free; "2" needs 1 and would fit, but may not jump
    the queue."""
    scheduler = make_scheduler(upto=4, block_size=4, num_gpu_blocks=10)
    r0 = create_requests(1, num_tokens=24, max_tokens=4, block_size=4)[0]
    r1 = create_requests(1, num_tokens=16, max_tokens=4, block_size=4, first_id=1)[0]
    r2 = create_requests(1, num_tokens=2, max_tokens=4, block_size=4, first_id=2)[0]
    for request in (r0, r1, r2):
        scheduler.add_request(request)
    run_by_hand(scheduler, r0, 24, outputs=[5])  # 6 blocks + its token needs a 7th
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 1}, (
        "only '0' runs: '1' does not fit and '2' may not overtake it (FCFS); got "
        f"{out.num_scheduled_tokens}"
    )
    assert ids(scheduler.waiting) == ["1", "2"], (
        f"'1' and '2' keep waiting in order, got {ids(scheduler.waiting)}; admission stops at the "
        "first request that does not fit"
    )
    assert r2.status == RequestStatus.WAITING and r2.num_computed_tokens == 0, (
        f"'2' must not be admitted past '1': WAITING with 0 computed; got {r2.status!r}, "
        f"{r2.num_computed_tokens}"
    )
    assert "1" not in scheduler.kv_cache_manager.req_to_blocks, "a refused claim holds nothing"


def test_admission_claims_through_the_reservation_helper():
    """With ``kv_reservation="max"`` an admitted request holds its whole reservation at once:
    ``max_model_len`` = 40 slots = 10 blocks of 4, though its 6 prompt tokens need 2; so only
    one of two such requests runs in a cache of 12 usable blocks."""
    scheduler = make_scheduler(upto=4, block_size=4, num_gpu_blocks=13, max_model_len=40,
                               kv_reservation="max")
    for request in create_requests(2, num_tokens=6, max_tokens=4, block_size=4):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 6}, (
        "admission must claim room with self._allocate_on_admission (it adds the reservation); "
        f"scheduled {out.num_scheduled_tokens}"
    )
    assert len(out.scheduled_new_reqs[0].block_ids[0]) == 10, (
        "kv_reservation='max': '0' holds its whole 10-block reservation, got "
        f"{len(out.scheduled_new_reqs[0].block_ids[0])} block(s)"
    )
    assert ids(scheduler.waiting) == ["1"], (
        "only one reservation fits the 12 usable blocks: '1' keeps waiting; waiting: "
        f"{ids(scheduler.waiting)}"
    )


def test_prefix_cache_hit_on_admission():
    scheduler = make_scheduler(upto=4, enable_prefix_caching=True, block_size=4)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    first = create_requests(1, block_size=4, prompt=prompt)[0]
    scheduler.add_request(first)
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out))
    second = create_requests(1, block_size=4, prompt=prompt, first_id=1)[0]
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["1"] == 2, (  # 16 tokens come from the cache
        "the second request hits 16 cached tokens and computes only 2, got "
        f"{out.num_scheduled_tokens['1']}; start from kv_cache_manager.get_computed_blocks"
    )
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16, (
        "the new request's output carries its 16-token hit as num_computed_tokens, got "
        f"{out.scheduled_new_reqs[0].num_computed_tokens}"
    )
    assert second.num_cached_tokens == 16, (
        f"num_cached_tokens is the first admission's hit, 16, got {second.num_cached_tokens}"
    )
    assert second.num_computed_tokens == 18, (
        "after schedule() the second request has 16 + 2 = 18 computed tokens, got "
        f"{second.num_computed_tokens}"
    )
    first_blocks = scheduler.kv_cache_manager.get_block_ids("0")[0]
    assert out.scheduled_new_reqs[0].block_ids[0][:4] == first_blocks[:4], (
        f"its first 4 blocks are the first request's cached blocks {first_blocks[:4]}, got "
        f"{out.scheduled_new_reqs[0].block_ids[0][:4]}"
    )


def test_a_prefix_hit_and_the_budget_together():
    """The budget is spent on the tokens beyond the hit: 16 of 18 are cached, 2 are computed,
    and the next request gets the rest of the budget."""
    scheduler = make_scheduler(upto=4, enable_prefix_caching=True, block_size=4,
                               max_num_batched_tokens=12)
    prompt = list(range(100, 118))
    first = create_requests(1, block_size=4, prompt=prompt)[0]
    scheduler.add_request(first)
    run_by_hand(scheduler, first, 18)
    second = create_requests(1, block_size=4, prompt=prompt, first_id=1)[0]
    third = create_requests(1, num_tokens=30, block_size=4, first_id=2)[0]
    scheduler.add_request(second)
    scheduler.add_request(third)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"1": 2, "2": 10}, (
        "budget 12: '1' computes 2 tokens beyond its 16-token hit, '2' takes the other 10; got "
        f"{out.num_scheduled_tokens}"
    )


def test_readmission_is_a_resumed_request_and_keeps_its_first_cached_count():
    """A preempted request comes back as a *resumed* request (the runner must replace its old
    table) with its whole block table; num_cached_tokens keeps the value of its first
    admission, while num_computed_tokens starts from the new hit. A newcomer behind it is a
    new request."""
    scheduler, requests = _victim_with_a_cached_prefix(upto=4)
    victim = requests[2]
    assert victim.num_cached_tokens == 0, (  # its first admission (by hand) hit nothing
        "the victim entered running with num_cached_tokens 0 and was preempted, now "
        f"{victim.num_cached_tokens}; preemption must not change it"
    )
    newcomer = create_requests(1, num_tokens=3, max_tokens=2, block_size=4, first_id=3)[0]
    scheduler.add_request(newcomer)
    out = scheduler.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["2"] and [n.req_id for n in out.scheduled_new_reqs] == ["3"], (
        "the victim '2' comes back first as a resumed request, then '3' as new; cached "
        f"{cached.req_ids}, new {[n.req_id for n in out.scheduled_new_reqs]}"
    )
    assert cached.resumed_from_preemption == [True], (
        "'2' was PREEMPTED: resumed_from_preemption must be [True], got "
        f"{cached.resumed_from_preemption}"
    )
    assert cached.new_block_ids == [scheduler.kv_cache_manager.get_block_ids("2")], (
        "a resumed request carries its whole block table "
        f"{scheduler.kv_cache_manager.get_block_ids('2')}, got {cached.new_block_ids}: store "
        "kv_cache_manager.get_blocks(id)"
    )
    assert len(cached.new_block_ids[0][0]) == 4, (
        "the resumed '2' holds 4 blocks (2 cached + 2 new) for its 13 tokens, got "
        f"{len(cached.new_block_ids[0][0])}"
    )
    assert cached.num_computed_tokens == [8], (
        "'2' starts from its 8-token prefix hit: num_computed_tokens [8], got "
        f"{cached.num_computed_tokens}"
    )
    assert out.num_scheduled_tokens == {"2": 5, "3": 3}, (
        "'2' computes its other 5 tokens and '3' its 3-token prompt; got "
        f"{out.num_scheduled_tokens}"
    )
    assert victim.num_cached_tokens == 0, "set on the first admission only"
    assert newcomer.num_cached_tokens == 0, (
        f"the newcomer had no prefix hit: num_cached_tokens 0, got {newcomer.num_cached_tokens}"
    )
    assert victim.status == RequestStatus.RUNNING and newcomer.status == RequestStatus.RUNNING, (
        f"both admitted requests are RUNNING; '2' is {victim.status!r}, '3' is {newcomer.status!r}"
    )
    assert ids(scheduler.running) == ["0", "2", "3"] and not scheduler.waiting, (
        f"running must be ['0', '2', '3'] and waiting empty; got running {ids(scheduler.running)}, "
        f"waiting {ids(scheduler.waiting)}"
    )
    assert out.scheduled_new_reqs[0].block_ids == scheduler.kv_cache_manager.get_block_ids("3"), (
        "the new '3' carries its whole block table "
        f"{scheduler.kv_cache_manager.get_block_ids('3')}, got "
        f"{out.scheduled_new_reqs[0].block_ids}"
    )


def test_no_admission_in_a_step_that_preempted():
    """A preempted mid-prefill request frees more blocks than the preempting request needs, and
    a smaller chunk of it would fit again at once. It must still wait for the next step:
    admitting into a cache that just proved too small only makes requests thrash."""
    scheduler = make_scheduler(upto=4, block_size=4, num_gpu_blocks=6, max_num_batched_tokens=8,
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
    assert records[4].num_scheduled_tokens == {"1": 1} and records[4].preempted == ["2"], (
        "step 4: '1' decodes 1 token and '2' (mid-prefill) is preempted; got scheduled "
        f"{records[4].num_scheduled_tokens}, preempted {records[4].preempted}"
    )
    assert all(r.num_output_tokens == r.max_tokens for r in requests), (
        "every request ends with max_tokens outputs (ignore_eos): (id, outputs, max_tokens) "
        f"{[(r.request_id, r.num_output_tokens, r.max_tokens) for r in requests]}"
    )
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
    scheduler = make_scheduler(upto=5)
    eos_req, out = _one_running(scheduler, max_tokens=10)
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [7, EOS, 9]}))
    assert eos_req.status == RequestStatus.FINISHED_STOPPED, (
        f"EOS after token 7 stops the request: FINISHED_STOPPED, got {eos_req.status!r}"
    )
    assert eos_req.get_finished_reason() == FinishReason.STOP, (
        f"the finish reason of an EOS stop is STOP, got {eos_req.get_finished_reason()!r}"
    )
    assert eos_req.stop_reason is None, (
        f"an EOS stop records no stop_reason (only stop_token_ids do), got {eos_req.stop_reason!r}"
    )
    assert list(eos_req.output_token_ids) == [7, EOS], (
        f"the tokens after EOS are dropped: output [7, {EOS}], got "
        f"{list(eos_req.output_token_ids)}; append one at a time, check_stop after each"
    )
    assert len(outputs) == 1, f"one output for the one request, got {len(outputs)}"
    assert outputs[0].new_token_ids == [7, EOS] and outputs[0].finished, (
        f"the output carries the appended tokens [7, {EOS}] and finished; got "
        f"{outputs[0].new_token_ids}, finished={outputs[0].finished}"
    )
    assert outputs[0].finish_reason == FinishReason.STOP and outputs[0].stop_reason is None, (
        f"the output says STOP and no stop reason; got {outputs[0].finish_reason!r}, "
        f"{outputs[0].stop_reason!r}"
    )

    stop_req = create_requests(1, stop_token_ids=[13], first_id=1)[0]
    scheduler.add_request(stop_req)
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, make_output(out, {"1": [13, 4]}))
    assert stop_req.status == RequestStatus.FINISHED_STOPPED, (
        f"stop token 13 stops the request: FINISHED_STOPPED, got {stop_req.status!r}"
    )
    assert stop_req.stop_reason == 13, (
        f"a stop token is recorded as the stop_reason, 13, got {stop_req.stop_reason!r}"
    )
    assert list(stop_req.output_token_ids) == [13], (
        f"the tokens after the stop token are dropped: [13], got {list(stop_req.output_token_ids)}"
    )
    assert outputs[0].stop_reason == 13 and outputs[0].new_token_ids == [13], (
        f"the output carries stop_reason 13 and new tokens [13]; got {outputs[0].stop_reason!r}, "
        f"{outputs[0].new_token_ids}"
    )
    assert out.finished_req_ids == {"0"}, (  # finished before this step: the runner drops it
        "this step reports '0' (stopped before it) in finished_req_ids, got "
        f"{sorted(out.finished_req_ids)}; free a stopped request with _free_request"
    )
    assert scheduler.schedule().finished_req_ids == {"1"}, (
        "the step after '1' stopped reports exactly '1' in finished_req_ids; free a stopped "
        "request with _free_request"
    )
    assert_scheduler_empty(scheduler)


@beside_the_student
def _scheduler_recording_rollbacks(config):
    """Your Scheduler (tasks 1-5), with lab 04-04's ``_roll_back_rejected`` replaced by one
    that records its arguments in ``scheduler.rollbacks``."""

    def _roll_back_rejected(self, request, num_draft_tokens, num_accepted):
        self.rollbacks.append((request.request_id, num_draft_tokens, num_accepted))

    cls = type("SchedulerRecordingRollbacks", (lab.Scheduler,),
               {"_roll_back_rejected": _roll_back_rejected,
                **{n: vars(ReferenceScheduler)[n] for n in LATER_TASKS[6]}})
    scheduler = cls(config)
    scheduler.rollbacks = []
    return scheduler


def test_update_from_output_rolls_back_the_rejected_drafts_first():
    """A request whose drafts were checked in the step hands ``_roll_back_rejected`` how many
    were checked and how many the target accepted (all its tokens but the last), before the
    stop conditions cut its tokens; a request without drafts hands it nothing."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             block_size=4, num_gpu_blocks=64, enable_prefix_caching=False)
    scheduler = _scheduler_recording_rollbacks(config, beside=lab)
    drafting, plain = create_requests(2, num_tokens=6, max_tokens=10, block_size=4)
    for request in (drafting, plain):
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out, default=7))
    out = scheduler.schedule()
    out.scheduled_spec_decode_tokens = {"0": [5, 6, 8]}  # as if lab 04-04 had scheduled them
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [5, EOS, 9], "1": [4]}))
    assert scheduler.rollbacks == [("0", 3, 2)], (
        f"request 0 had 3 drafts checked and gained 3 tokens (2 accepted drafts, then the "
        f"target's own): want one call _roll_back_rejected(request 0, 3, 2), got "
        f"{scheduler.rollbacks}"
    )
    assert [o.new_token_ids for o in outputs] == [[5, EOS], [4]], (
        f"the tokens are then appended as ever (EOS stops request 0): got "
        f"{[o.new_token_ids for o in outputs]}"
    )


@pytest.mark.parametrize("last", ["eos", "stop-token"])
def test_the_length_cap_wins_over_a_stop_on_the_last_allowed_token(last):
    """The last allowed token (max_tokens = 3) is also EOS or a stop token: the length cap is
    checked first, so the request finishes LENGTH_CAPPED and records no stop reason."""
    scheduler = make_scheduler(upto=5)
    request, out = _one_running(scheduler, max_tokens=3, stop_token_ids=[13])
    final = EOS if last == "eos" else 13
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [7, 8, final, 9]}))
    assert list(request.output_token_ids) == [7, 8, final], (
        f"the request keeps its 3 allowed tokens, got {list(request.output_token_ids)}"
    )
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"the length cap is checked before EOS and stop tokens: FINISHED_LENGTH_CAPPED, got "
        f"{request.status!r}"
    )
    assert request.get_finished_reason() == FinishReason.LENGTH, "the finish reason is LENGTH"
    assert request.stop_reason is None, (
        f"a length-capped request records no stop reason, got {request.stop_reason!r}"
    )
    assert outputs[0].finish_reason == FinishReason.LENGTH and outputs[0].stop_reason is None, (
        f"the output says LENGTH and no stop reason: {outputs[0].finish_reason}, "
        f"{outputs[0].stop_reason!r}"
    )
    assert outputs[0].new_token_ids == [7, 8, final], (
        f"the output carries the 3 tokens, got {outputs[0].new_token_ids}"
    )


def test_stop_at_max_tokens_and_ignore_eos():
    scheduler = make_scheduler(upto=5)
    request, out = _one_running(scheduler, max_tokens=3, ignore_eos=True)
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [EOS, EOS]}))
    assert request.status == RequestStatus.RUNNING, (  # EOS ignored, 2 < 3 tokens
        "ignore_eos: 2 EOS tokens of max_tokens=3 do not stop the request; it stays RUNNING, got "
        f"{request.status!r}"
    )
    assert outputs[0].new_token_ids == [EOS, EOS] and not outputs[0].finished, (
        f"the output carries both tokens and is not finished; got {outputs[0].new_token_ids}, "
        f"finished={outputs[0].finished}"
    )
    assert outputs[0].finish_reason is None, (
        f"a request still running has finish_reason None, got {outputs[0].finish_reason!r}"
    )
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 2}, (  # both new tokens need their KV
        f"both sampled tokens need their KV: '0' gets 2 tokens, got {out.num_scheduled_tokens}"
    )
    scheduler.update_from_output(out, make_output(out, {"0": [EOS, 8]}))
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"the third token reaches max_tokens=3: FINISHED_LENGTH_CAPPED, got {request.status!r}"
    )
    assert list(request.output_token_ids) == [EOS, EOS, EOS], (
        f"the token after the cap is dropped: 3 EOS tokens, got {list(request.output_token_ids)}"
    )
    assert request.get_finished_reason() == FinishReason.LENGTH, (
        f"the finish reason is LENGTH, got {request.get_finished_reason()!r}"
    )


def test_ignore_eos_does_not_ignore_stop_tokens():
    scheduler = make_scheduler(upto=5)
    request, out = _one_running(scheduler, max_tokens=10, ignore_eos=True, stop_token_ids=[EOS])
    scheduler.update_from_output(out, make_output(out, {"0": [EOS, 5]}))
    assert request.status == RequestStatus.FINISHED_STOPPED, (
        "ignore_eos ignores only EOS as EOS, not a listed stop token: FINISHED_STOPPED, got "
        f"{request.status!r}"
    )
    assert request.stop_reason == EOS, (
        f"the stop token {EOS} is the stop_reason, got {request.stop_reason!r}"
    )
    assert list(request.output_token_ids) == [EOS], (
        f"the tokens after the stop token are dropped: [{EOS}], got "
        f"{list(request.output_token_ids)}"
    )


def test_stop_at_max_model_len():
    scheduler = make_scheduler(upto=5, max_model_len=12, block_size=4)
    request, out = _one_running(scheduler, num_tokens=10, max_tokens=100, block_size=4)
    scheduler.update_from_output(out, make_output(out))
    assert request.status == RequestStatus.RUNNING, (
        "10 prompt + 1 output = 11 tokens < max_model_len 12: still RUNNING, got "
        f"{request.status!r}"
    )
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out, {"0": [EOS]}))  # EOS at the cap
    assert request.num_tokens == 12, (
        f"the EOS sampled at position 11 is appended: 12 tokens, got {request.num_tokens}"
    )
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        "12 tokens reach max_model_len 12: the length cap wins over EOS, FINISHED_LENGTH_CAPPED, "
        f"got {request.status!r}"
    )


def test_check_stop_directly():
    request = create_requests(1, max_tokens=5, stop_token_ids=[11])[0]
    request.append_output_token_ids(3)
    assert lab.check_stop(request, max_model_len=100) is False, (
        "1 of max_tokens=5, token 3 is no stop token: check_stop returns False; status now "
        f"{request.status!r}"
    )
    assert request.status == RequestStatus.WAITING and request.stop_reason is None, (
        "check_stop returning False changes nothing: WAITING and no stop_reason; got "
        f"{request.status!r}, {request.stop_reason!r}"
    )
    request.append_output_token_ids(11)
    assert lab.check_stop(request, max_model_len=100) is True, (
        f"stop token 11 makes check_stop return True; status now {request.status!r}"
    )
    assert request.status == RequestStatus.FINISHED_STOPPED, (
        f"a stop token gives FINISHED_STOPPED, got {request.status!r}"
    )
    assert request.stop_reason == 11, (
        f"the stop_reason is the stop token 11, got {request.stop_reason!r}"
    )
    # The cap on the total length: 10 prompt + 2 output tokens reach max_model_len = 12.
    capped = create_requests(1, max_tokens=50, first_id=1)[0]
    capped.append_output_token_ids([3, 4])
    assert lab.check_stop(capped, max_model_len=13) is False, (
        "10 prompt + 2 output = 12 tokens < max_model_len 13: check_stop returns False; status now "
        f"{capped.status!r}"
    )
    assert lab.check_stop(capped, max_model_len=12) is True, (
        "12 tokens reach max_model_len 12: check_stop returns True (the length cap); status now "
        f"{capped.status!r}"
    )
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"reaching max_model_len gives FINISHED_LENGTH_CAPPED, got {capped.status!r}"
    )


def test_check_stop_without_an_eos_id():
    """A request without an EOS id (None) stops only on length and stop tokens."""
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=None)
    request.append_output_token_ids(EOS)
    assert lab.check_stop(request, max_model_len=100) is False, (
        f"eos_token_id None: token {EOS} is no EOS, so check_stop returns False; status now "
        f"{request.status!r}"
    )
    assert request.status == RequestStatus.WAITING, (
        f"check_stop returning False leaves the status WAITING, got {request.status!r}"
    )


def test_prefill_step_samples_nothing():
    scheduler = make_scheduler(upto=5, max_num_batched_tokens=8)
    request, out = _one_running(scheduler, num_tokens=20)
    outputs = scheduler.update_from_output(out, make_output(out, {"0": []}))
    assert outputs == [] and request.num_output_tokens == 0, (
        f"a prefill chunk samples nothing: no output, no token appended; got {len(outputs)} "
        f"output(s), {request.num_output_tokens} token(s)"
    )
    assert scheduler.schedule().num_scheduled_tokens == {"0": 8}, (
        "the next step continues the prompt with 8 tokens (the budget) for '0'"
    )


def test_outputs_follow_the_scheduled_order_and_carry_the_cached_count():
    scheduler = make_scheduler(upto=5, enable_prefix_caching=True, block_size=4)
    prompt = list(range(100, 110))
    first = create_requests(1, block_size=4, prompt=prompt)[0]
    scheduler.add_request(first)
    run_by_hand(scheduler, first, 10, outputs=[5])
    second = create_requests(1, block_size=4, prompt=prompt, first_id=1)[0]
    third = create_requests(1, num_tokens=5, block_size=4, first_id=2)[0]
    scheduler.add_request(second)
    scheduler.add_request(third)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1", "2"], (
        "running '0' first, then '1' and '2' admitted in order; scheduled "
        f"{list(out.num_scheduled_tokens)}"
    )
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [6], "1": [7],
                                                                  "2": []}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("0", [6]), ("1", [7])], (
        "one output per request that gained tokens, in scheduled order: want [('0', [6]), ('1', "
        f"[7])], got {[(o.request_id, o.new_token_ids) for o in outputs]}"
    )
    assert [o.num_cached_tokens for o in outputs] == [0, 8], (
        "outputs carry max(num_cached_tokens, 0): 0 for '0', 8 (its hit) for '1'; got "
        f"{[o.num_cached_tokens for o in outputs]}"
    )


def test_an_unset_cached_count_is_reported_as_zero():
    scheduler = make_scheduler(upto=5, block_size=4)
    request = create_requests(1, num_tokens=4, block_size=4)[0]
    scheduler.add_request(request)
    run_by_hand(scheduler, request, 4)
    request.num_cached_tokens = -1  # never admitted through _schedule_waiting
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_output(out))  # "0" had nothing to do: no output
    request.num_computed_tokens = 3
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, make_output(out, {"0": [9]}))
    assert outputs[0].num_cached_tokens == 0, (
        "num_cached_tokens -1 (never set) is reported as 0, max(num_cached_tokens, 0); got "
        f"{outputs[0].num_cached_tokens}"
    )


def test_requests_aborted_while_the_step_ran_are_skipped():
    scheduler = make_scheduler(upto=5)
    requests = create_requests(2)
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(out, make_output(out, default=5))
    assert [o.request_id for o in outputs] == ["1"], (
        "'0' was aborted while the step ran and is skipped: only '1' gets an output; got outputs "
        f"for {[o.request_id for o in outputs]}"
    )
    assert list(requests[0].output_token_ids) == [], (
        f"an aborted request receives no token, '0' got {list(requests[0].output_token_ids)}; skip "
        "ids no longer in scheduler.requests"
    )
    assert requests[0].status == RequestStatus.FINISHED_ABORTED, (
        f"the aborted '0' stays FINISHED_ABORTED, got {requests[0].status!r}"
    )


def test_a_request_preempted_after_it_was_scheduled_can_stop():
    """Steps overlap: "1" is scheduled, then preempted (it waits again) before its token comes
    back; that token is its last (max_tokens = 1): it must leave `waiting` and be freed."""
    scheduler = make_scheduler(upto=5, max_num_batched_tokens=100, block_size=16,
                               num_gpu_blocks=11)
    r0 = create_requests(1, num_tokens=80, block_size=16)[0]
    r1 = create_requests(1, num_tokens=80, max_tokens=1, block_size=16, first_id=1)[0]
    scheduler.add_request(r0)
    out0 = scheduler.schedule()
    scheduler.add_request(r1)
    out1 = scheduler.schedule()
    scheduler.update_from_output(out0, make_output(out0))
    out2 = scheduler.schedule()
    assert out2.preempted_req_ids == ["1"] and ids(scheduler.waiting) == ["1"], (
        "'0' needs a sixth block: '1' is preempted and waits; got preempted "
        f"{out2.preempted_req_ids}, waiting {ids(scheduler.waiting)}"
    )
    outputs = scheduler.update_from_output(out1, make_output(out1, {"1": [42]}))
    assert outputs[0].request_id == "1" and outputs[0].finished, (
        "'1' receives its last token (max_tokens=1) though preempted: a finished output; got "
        f"{outputs[0].request_id!r}, finished={outputs[0].finished}"
    )
    assert r1.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"'1' reached max_tokens=1: FINISHED_LENGTH_CAPPED, got {r1.status!r}"
    )
    assert ids(scheduler.waiting) == [] and "1" not in scheduler.requests, (
        "'1' stopped while in waiting: it must leave waiting and requests; waiting "
        f"{ids(scheduler.waiting)}, '1' in requests: {'1' in scheduler.requests}"
    )
    assert scheduler.get_num_unfinished_requests() == 1, (
        f"only '0' is unfinished, got {scheduler.get_num_unfinished_requests()!r}"
    )
    assert scheduler.schedule().finished_req_ids == {"1"}, (
        "the next step reports exactly '1' in finished_req_ids"
    )


def test_a_request_swapped_out_after_it_was_scheduled_can_stop():
    """The same in swap mode (lab 03-03; here the swap-out is done by hand): the request that
    stops sits in `swapped` and must leave it."""
    scheduler = make_scheduler(upto=5, block_size=4)
    requests = create_requests(2, num_tokens=4, max_tokens=1, block_size=4)
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    for request in requests:  # "swapped out" while the step ran
        swap_out_by_hand(scheduler, request, "running")
    outputs = scheduler.update_from_output(out, make_output(out, default=5))
    assert [o.request_id for o in outputs] == ["0", "1"] and all(o.finished for o in outputs), (
        "both requests stop on their one token (max_tokens=1): finished outputs for '0', '1'; got "
        f"{[(o.request_id, o.finished) for o in outputs]}"
    )
    assert len(scheduler.swapped) == 0 and scheduler.requests == {}, (
        "requests that stop while in swapped leave swapped and requests; swapped "
        f"{ids(scheduler.swapped)}, requests {sorted(scheduler.requests)}"
    )
    assert scheduler.has_unfinished_requests() is False, (
        "nothing is left: has_unfinished_requests() must be False, got "
        f"{scheduler.has_unfinished_requests()!r}"
    )


# ---------------------------------------------------------------------------------------------
# Task 6: finishing from outside
# ---------------------------------------------------------------------------------------------


def test_finish_requests_from_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = create_requests(num_requests=3)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    scheduler.finish_requests(["0", "2", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert requests[0].status == RequestStatus.FINISHED_ABORTED, (
        f"'0' (running) is finished as FINISHED_ABORTED, got {requests[0].status!r}"
    )
    assert requests[2].status == RequestStatus.FINISHED_ABORTED, (
        f"'2' (waiting) is finished as FINISHED_ABORTED, got {requests[2].status!r}"
    )
    assert scheduler.running == [requests[1]] and len(scheduler.waiting) == 0, (
        "'0' leaves running and '2' leaves waiting: running ['1'], waiting []; got "
        f"{ids(scheduler.running)}, {ids(scheduler.waiting)}"
    )
    assert "0" not in scheduler.kv_cache_manager.req_to_blocks, (
        "the finished '0' must give its blocks back (free it with _free_request)"
    )
    assert scheduler.get_num_unfinished_requests() == 1, (
        f"only '1' is unfinished, got {scheduler.get_num_unfinished_requests()!r}"
    )
    out = scheduler.schedule()
    assert out.finished_req_ids == {"0", "2"}, (
        f"the next step reports '0' and '2' as finished, got {sorted(out.finished_req_ids)}; free "
        "each with _free_request"
    )
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert_scheduler_empty(scheduler)


def test_finish_requests_from_swapped():
    """A request swapped out (lab 03-03 does this; here by hand) is taken out of `swapped`."""
    scheduler = make_scheduler(block_size=4)
    requests = create_requests(3, num_tokens=6, block_size=4)
    for request in requests:
        scheduler.add_request(request)
    for request in requests:
        scheduler.waiting.remove(request)
        request.status = RequestStatus.SWAPPED
        scheduler.swapped.append(request)
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert ids(scheduler.swapped) == ["0", "2"], (
        "finish_requests('1') takes '1' out of swapped: ['0', '2'] left, got "
        f"{ids(scheduler.swapped)}"
    )
    assert requests[1].status == RequestStatus.FINISHED_ABORTED, (
        f"'1' gets the status FINISHED_ABORTED, got {requests[1].status!r}"
    )
    assert "1" not in scheduler.requests and scheduler.get_num_unfinished_requests() == 2, (
        f"'1' leaves requests, 2 stay unfinished; '1' in requests: {'1' in scheduler.requests}, "
        f"unfinished: {scheduler.get_num_unfinished_requests()!r}"
    )


def test_finish_requests_takes_one_id_as_a_whole_and_keeps_the_others_in_order():
    scheduler = make_scheduler(max_num_seqs=3, block_size=4)
    requests = [create_requests(1, num_tokens=5, block_size=4, first_id=i)[0] for i in range(6)]
    for rid, request in zip(["1", "2", "12", "3", "4", "5"], requests):
        request.request_id = rid
        scheduler.add_request(request)
    scheduler.schedule()  # "1", "2", "12" run; "3", "4", "5" wait
    scheduler.finish_requests("12", RequestStatus.FINISHED_ABORTED)
    queues = (ids(scheduler.running), ids(scheduler.waiting))
    assert queues == (["1", "2"], ["3", "4", "5"]), (
        f"finish_requests('12') finishes request '12' (one id as a whole, not '1' and '2'); "
        f"running, waiting: {queues}"
    )
    scheduler.finish_requests(iter(["4", "4", "1"]), RequestStatus.FINISHED_STOPPED)
    queues = (ids(scheduler.running), ids(scheduler.waiting))
    assert queues == (["2"], ["3", "5"]), (
        f"finishing '4' (twice) and '1' from any iterable keeps the others in order; running, "
        f"waiting: {queues}"
    )
    assert requests[4].status == RequestStatus.FINISHED_STOPPED, (
        f"a finished request takes the given status, got {requests[4].status!r}"
    )
    assert sorted(scheduler.requests) == ["2", "3", "5"], (
        f"finished requests leave scheduler.requests: {sorted(scheduler.requests)}"
    )
    free = free_blocks(scheduler)
    assert free == usable_blocks(scheduler) - 2, (
        f"the finished requests' blocks are freed: only '2' holds 2 blocks, {free} free"
    )
    finished = scheduler.schedule().finished_req_ids
    assert finished == {"12", "4", "1"}, (
        f"the next step reports every request finished since the last one: {finished}"
    )


@pytest.mark.parametrize("status", [RequestStatus.RUNNING, RequestStatus.WAITING,
                                    RequestStatus.PREEMPTED])
def test_finish_requests_refuses_a_status_that_is_not_finished(status):
    scheduler = make_scheduler(max_num_seqs=1)
    requests = create_requests(2)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    with pytest.raises(ValueError) as excinfo:
        scheduler.finish_requests(["1", "0"], status)
    assert str(status) in str(excinfo.value), "the message must name the status"
    assert scheduler.running == [requests[0]] and list(scheduler.waiting) == [requests[1]], (
        "a refused finish_requests changes nothing: running ['0'], waiting ['1']; got "
        f"{ids(scheduler.running)}, {ids(scheduler.waiting)}"
    )
    assert [r.status for r in requests] == [RequestStatus.RUNNING, RequestStatus.WAITING], (
        "a refused finish_requests changes no status: RUNNING, WAITING; got "
        f"{[str(r.status) for r in requests]}"
    )
    assert sorted(scheduler.requests) == ["0", "1"], (
        f"a refused finish_requests removes nobody from requests, got {sorted(scheduler.requests)}"
    )
    assert "0" in scheduler.kv_cache_manager.req_to_blocks, (
        "a refused finish_requests frees nothing: '0' keeps its blocks"
    )
    assert scheduler.schedule().finished_req_ids == set(), (
        "a refused finish_requests finishes nobody: the next step's finished_req_ids is empty"
    )


def test_finishing_an_unknown_or_finished_id_changes_nothing():
    scheduler = make_scheduler()
    request = create_requests(1)[0]
    scheduler.add_request(request)
    scheduler.finish_requests([], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("nobody", RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == [request] and request.status == RequestStatus.WAITING, (
        "finishing [] or an unknown id changes nothing: '0' WAITING in waiting; waiting "
        f"{ids(scheduler.waiting)}, status {request.status!r}"
    )
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("0", RequestStatus.FINISHED_STOPPED)
    assert request.status == RequestStatus.FINISHED_ABORTED, (
        "finishing an already finished id is ignored: '0' stays FINISHED_ABORTED, got "
        f"{request.status!r}"
    )
    assert_scheduler_empty(scheduler)


# ---------------------------------------------------------------------------------------------
# Whole runs, with all of your tasks: no leak, invariants on random workloads, the golden trace
# ---------------------------------------------------------------------------------------------


def test_no_block_leak():
    """Port of upstream test_memory_leak: five requests, one added per step, all finish."""
    scheduler = make_scheduler(enable_prefix_caching=True)
    requests = create_requests(num_requests=5, num_tokens=10, max_tokens=10, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
        out = scheduler.schedule()
        scheduler.update_from_output(out, make_output(out))
    for _ in range(200):  # five 10-token requests end in about 15 steps; a stall fails, not hangs
        out = scheduler.schedule()
        if len(scheduler.running) == 0:
            break
        scheduler.update_from_output(out, make_output(out))
    else:
        pytest.fail("five requests of 10 output tokens each were still running after 200 steps; "
                    "does update_from_output() finish a request at max_tokens and free it?")
    assert_scheduler_empty(scheduler)
    assert all(len(r.output_token_ids) == 10 for r in requests), (
        "every request generates max_tokens=10 tokens, got "
        f"{[len(r.output_token_ids) for r in requests]}"
    )


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
        assert request.num_output_tokens == request.max_tokens, (
            f"seed {seed}: request {request.request_id} ends with max_tokens={request.max_tokens} "
            f"outputs (ignore_eos), got {request.num_output_tokens}"
        )
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
