"""Graded tests of lab 04-02: asynchronous scheduling.

The headline property: the engine that plans step N+1 while step N runs emits, token for token,
what the synchronous engine emits, in every configuration (chunked prefill, preemption by
recompute and by swap, stop tokens, prefix caching), frees every block, and caches the same
prefixes.

Groups, each using only its task and the ones before it (the engine tests at the end use all):
  1. tasks 1-3: ``AsyncScheduler`` driven by hand, two steps in flight as the busy loop keeps
     them, with tokens made up by the test (the reference's versions stand in for later tasks);
  2. task 4: ``EngineCore.step_with_batch_queue`` on a small model whose steps the test holds
     back (a gate), to see what a turn starts, what it waits for and what it returns;
  3. your scheduler and engine core together against the synchronous engine.

Where the lab's code runs in a process of its own (course/labs/student_process.py), the engine,
its gate and its model thread live there too (``@beside_the_student``); what comes back is data.
"""

from __future__ import annotations

import functools
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course.engine.compose import with_super_of
from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.engine.core import EngineCore as ReferenceEngineCore
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)

BLOCK = 4
WAIT_S = 20.0  # the longest a test waits on the model thread (a tiny model steps in ms)
MAX_TURNS = 3000  # a run of the engine tests takes a few hundred turns
HOLD_S = 5.0  # how long a test waits for a turn to start a step or return, its step held back


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


# ---------------------------------------------------------------------------- tasks 1 to 3

# The scheduler's tasks after task 1; `_scheduler(upto=N)` takes the reference's for the tasks
# after N, so a test of task N needs only your tasks up to N.
LATER_TASKS = {2: ("_num_new_tokens",), 3: ("update_from_output",)}


def _scheduler(upto=3, **overrides):
    kw = dict(block_size=BLOCK, num_gpu_blocks=32, max_num_batched_tokens=64, max_model_len=64,
              max_num_seqs=8)
    kw.update(overrides)
    return _scheduler_up_to(upto, SchedulerConfig(**kw), beside=lab)


@beside_the_student
def _scheduler_up_to(upto, config):
    """Built where your code runs (the class is made from yours there)."""
    from mini_vllm.core.sched.async_scheduler import AsyncScheduler as Reference

    cls = lab.AsyncScheduler
    stand_ins = {name: with_super_of(vars(Reference)[name], lab.AsyncScheduler)
                 for task, names in LATER_TASKS.items() if task > upto for name in names}
    if stand_ins:
        cls = type(f"AsyncSchedulerUpToTask{upto}", (lab.AsyncScheduler,), stand_ins)
    return cls(config)


def _request(rid="r", prompt=(1, 2, 3, 4, 5, 6), max_tokens=20, eos=None):
    return Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   eos_token_id=eos, block_hasher=get_request_block_hasher(BLOCK, sha256))


def _sampled(out, tokens):
    """The runner's output for step ``out``: ``tokens[id]`` for the named requests, nothing
    (mid-prompt) for the others."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [list(tokens.get(r, [])) for r in req_ids])


def test_a_step_that_reaches_the_end_of_the_prompt_gets_a_placeholder():
    scheduler = _scheduler(upto=1)
    gone, request = _request("gone"), _request()
    scheduler.add_request(gone)
    scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 6}, f"set-up: got {out.num_scheduled_tokens}"
    assert request.num_computed_tokens == 6 and out.finished_req_ids == {"gone"} and \
        scheduler.finished_req_ids == set(), (
            f"after schedule(): num_computed_tokens {request.num_computed_tokens} (want 6), the "
            f"step's finished ids {out.finished_req_ids} (want {{'gone'}}), the scheduler's "
            f"{scheduler.finished_req_ids} (want a fresh empty set): call "
            "super()._update_after_schedule(output) first")
    assert request.num_output_placeholders == 1, (
        f"the prompt's whole 6 tokens were scheduled, so this step samples a token: 1 "
        f"placeholder, got {request.num_output_placeholders}")


def test_a_chunk_that_stops_short_of_the_end_samples_nothing():
    scheduler = _scheduler(upto=1, max_num_batched_tokens=4)
    request = _request(prompt=range(10))
    scheduler.add_request(request)
    seen = []
    for _ in range(3):
        out = scheduler.schedule()
        seen.append((out.num_scheduled_tokens.get("r"), request.num_output_placeholders))
        scheduler.update_from_output(out, _sampled(out, {}))
    assert seen == [(4, 0), (4, 0), (2, 1)], (
        f"(tokens scheduled, placeholders) per step of a 10-token prompt in chunks of 4: got "
        f"{seen}, want [(4, 0), (4, 0), (2, 1)]: only the chunk that reaches the end samples")


def test_of_two_requests_only_the_one_that_reaches_its_end_samples():
    scheduler = _scheduler(upto=1, max_num_batched_tokens=8)
    short, long_ = _request("a", prompt=(1, 2, 3)), _request("b", prompt=range(10))
    scheduler.add_request(short)
    scheduler.add_request(long_)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}, f"set-up: {out.num_scheduled_tokens}"
    got = (short.num_output_placeholders, long_.num_output_placeholders)
    assert got == (1, 0), (
        f"placeholders (a, b) = {got}: a's 3 tokens reach its end, b's 5 of 10 do not; want (1, 0)")


def test_a_request_in_flight_is_scheduled_for_the_token_its_step_samples():
    scheduler = _scheduler(upto=2)
    request = _request()
    scheduler.add_request(request)
    scheduler.schedule()  # step N: the prompt; its token is not known yet
    out = scheduler.schedule()  # step N+1, planned while step N runs
    assert out.num_scheduled_tokens == {"r": 1}, (
        f"while step N runs, r's next step is its token from step N: {{'r': 1}}, got "
        f"{out.num_scheduled_tokens} (placeholders count as tokens that exist)")
    assert (request.num_computed_tokens, request.num_output_placeholders) == (7, 2), (
        f"(num_computed_tokens, placeholders) = ({request.num_computed_tokens}, "
        f"{request.num_output_placeholders}), want (7, 2): two steps in flight each sample one")


@pytest.mark.parametrize("max_tokens, planned", [(1, [6, None]), (2, [6, 1, None]),
                                                 (3, [6, 1, 1])])
def test_a_request_whose_step_in_flight_samples_its_last_token_is_not_planned_again(
        max_tokens, planned):
    scheduler = _scheduler(upto=2)
    request = _request(max_tokens=max_tokens)
    scheduler.add_request(request)
    got = []
    for _ in planned:
        got.append(scheduler.schedule().num_scheduled_tokens.get("r"))
    assert got == planned, (
        f"max_tokens={max_tokens}, steps planned with none finished: r got {got}, want "
        f"{planned} (None: not scheduled): a step past the one that samples the last token "
        "is wasted")


def test_the_model_length_still_caps_a_request_in_flight():
    scheduler = _scheduler(upto=2, max_model_len=8)
    request = _request(prompt=range(6))
    scheduler.add_request(request)
    got = [scheduler.schedule().num_scheduled_tokens.get("r") for _ in range(3)]
    assert got == [6, 1, None], (
        f"max_model_len=8, a 6-token prompt: steps got {got}, want [6, 1, None] (the last "
        "position is 7, computed in the second step)")


def _oracle_new_tokens(num_tokens, spec, ph, computed, outputs, max_tokens, threshold, budget,
                       max_model_len):
    if ph > 0 and outputs + ph >= max_tokens:
        return 0
    n = num_tokens + spec + ph - computed
    if 0 < threshold < n:
        n = threshold
    return max(0, min(n, budget, max_model_len - 1 - computed))


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 20), outputs=st.integers(0, 10), ph=st.integers(0, 2),
       behind=st.integers(0, 12), spec=st.integers(0, 3), max_tokens=st.integers(1, 16),
       threshold=st.sampled_from([0, 1, 3, 7]), budget=st.integers(1, 40),
       max_model_len=st.integers(24, 40))
def test_num_new_tokens_counts_placeholders_under_every_cap(prompt, outputs, ph, behind, spec,
                                                            max_tokens, threshold, budget,
                                                            max_model_len):
    init_none_hash(sha256)
    scheduler = _scheduler(upto=2, long_prefill_token_threshold=threshold,
                           max_model_len=max_model_len)
    request = _request(prompt=range(prompt), max_tokens=max_tokens)
    for t in range(outputs):
        request.append_output_token_ids(t)
    num_tokens = prompt + outputs
    request.num_output_placeholders = ph
    request.num_computed_tokens = max(0, num_tokens + ph - 1 - behind)
    request.spec_token_ids = list(range(spec)) if ph == 0 else []
    want = _oracle_new_tokens(num_tokens, len(request.spec_token_ids), ph,
                              request.num_computed_tokens, outputs, max_tokens, threshold,
                              budget, max_model_len)
    got = scheduler._num_new_tokens(request, budget)
    assert got == want, (
        f"a request of {num_tokens} tokens ({outputs} output, max_tokens={max_tokens}), "
        f"{request.num_computed_tokens} computed, {ph} placeholder(s), "
        f"{len(request.spec_token_ids)} draft(s); threshold={threshold}, budget={budget}, "
        f"max_model_len={max_model_len}: _num_new_tokens gave {got}, want {want}")


def test_tokens_that_arrive_replace_placeholders_in_order():
    scheduler = _scheduler(upto=3)
    request = _request()
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    news = scheduler.update_from_output(first, _sampled(first, {"r": [9]}))
    assert [(o.request_id, list(o.new_token_ids)) for o in news] == [("r", [9])], (
        f"step N's outputs: got {[(o.request_id, o.new_token_ids) for o in news]}, want "
        "[('r', [9])]: return what the synchronous scheduler's update_from_output returns")
    assert (list(request.output_token_ids), request.num_output_placeholders) == ([9], 1), (
        f"after step N's token: output {list(request.output_token_ids)}, placeholders "
        f"{request.num_output_placeholders}; want [9] and 1 (step N+1 still runs)")
    scheduler.update_from_output(second, _sampled(second, {"r": [10]}))
    assert (list(request.output_token_ids), request.num_output_placeholders) == ([9, 10], 0), (
        f"after step N+1's token: output {list(request.output_token_ids)}, placeholders "
        f"{request.num_output_placeholders}; want [9, 10] and 0")


def test_more_tokens_than_placeholders_is_an_assertion_naming_the_request():
    scheduler = _scheduler(upto=3)
    request = _request("lonely")
    scheduler.add_request(request)
    out = scheduler.schedule()
    with pytest.raises(AssertionError, match="lonely"):
        scheduler.update_from_output(out, _sampled(out, {"lonely": [9, 10]}))


def test_a_request_that_stops_drops_the_token_of_its_next_step():
    scheduler = _scheduler(upto=3)
    request = _request(eos=9)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    news = scheduler.update_from_output(first, _sampled(first, {"r": [9]}))
    assert [o.finished for o in news] == [True], "set-up: the EOS token finishes r"
    later = scheduler.update_from_output(second, _sampled(second, {"r": [11]}))
    assert later == [] and list(request.output_token_ids) == [9], (
        f"r finished in step N; step N+1's token for it must be dropped: got outputs {later} "
        f"and r's tokens {list(request.output_token_ids)}")
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "r's blocks did not go back"


def test_a_preempted_request_still_gets_its_token_and_caches_nothing():
    scheduler = _scheduler(upto=3, num_gpu_blocks=5)  # 4 usable blocks of 4 tokens
    a, b = (_request("a", prompt=range(8), max_tokens=4),
            _request("b", prompt=range(20, 27), max_tokens=4))
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # a: 2 blocks, b: 2 blocks; both sample
    second = scheduler.schedule()  # a needs a third block: b, the newest, is preempted
    assert second.preempted_req_ids == ["b"] and b.num_computed_tokens == 0, (
        f"set-up: b should be preempted by recompute, got {second.preempted_req_ids}")
    scheduler.update_from_output(first, _sampled(first, {"a": [9], "b": [9]}))
    assert list(b.output_token_ids) == [9] and b.num_output_placeholders == 0, (
        f"b was preempted after step N was planned; step N still sampled its token: b's "
        f"tokens {list(b.output_token_ids)} (want [9]), placeholders "
        f"{b.num_output_placeholders} (want 0)")


def test_the_blocks_a_finishing_request_wrote_stay_cached():
    scheduler = _scheduler(upto=3)
    request = _request(prompt=range(7), max_tokens=2)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt, positions 0-6; samples position 7's token
    second = scheduler.schedule()  # position 7 (its token still a placeholder): block 1 full
    scheduler.update_from_output(first, _sampled(first, {"r": [9]}))
    third = scheduler.schedule()
    assert "r" not in third.num_scheduled_tokens, "set-up: r's last token is in flight"
    scheduler.update_from_output(second, _sampled(second, {"r": [10]}))
    assert request.is_finished(), "set-up: r finishes at max_tokens=2"
    later = _request("later", prompt=[*range(7), 9, 40, 41, 42])
    _, hit = scheduler.kv_cache_manager.get_computed_blocks(later)
    assert hit == 8, (
        f"r's KV covers positions 0-7 (blocks 0 and 1) when it finishes; a later prompt with "
        f"those 8 tokens hits {hit} of them, want 8 (the synchronous scheduler has both cached): "
        "cache r's written blocks before super().update_from_output frees it")


# ---------------------------------------------------------------------------- task 4

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
)


@functools.lru_cache(maxsize=1)
def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(TINY)
    init_weights(model, seed=3, std=0.5)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", autouse=True)
def _model_before_the_fork():
    tiny_model()  # loaded here, so the student's process inherits it


def _config(**knobs) -> SchedulerConfig:
    kw = dict(block_size=BLOCK, num_gpu_blocks=64, max_num_batched_tokens=64, max_model_len=128,
              max_num_seqs=8)
    kw.update(knobs)
    return SchedulerConfig(**kw)


def _params(max_tokens, stop=()):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=list(stop))


class Gate:
    """Holds the engine's model steps until opened; counts the steps started."""

    def __init__(self, core, fail: bool = False) -> None:
        self.open = threading.Event()
        self.started = 0
        run, start = core.model_runner.execute_model, core.execute_model_async

        def held(output):
            self.open.wait(WAIT_S)
            if fail:
                raise RuntimeError("planted failure of the model step")
            return run(output)

        def counted(output):
            self.started += 1
            return start(output)

        core.model_runner.execute_model, core.execute_model_async = held, counted


def _core(**knobs):
    return lab.EngineCore(tiny_model(), _config(**knobs), async_scheduling=True)


def _add(core, rid, prompt, max_tokens):
    core.add_request(core.make_request(rid, list(prompt), _params(max_tokens)))


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _turn(core, timeout):
    """One turn on a thread: ``(finished in time, returned or raised)``."""
    box = {}

    def run():
        try:
            box["value"] = ("returned", core.step_with_batch_queue())
        except Exception as exc:  # noqa: BLE001 - reported as data
            box["value"] = ("raised", f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, box


def _outputs(value):
    kind, got = value
    if kind == "raised" and got.startswith("NotImplementedError"):
        raise NotImplementedError(got)
    if kind != "returned" or got is None:
        return value
    return [(o.request_id, list(o.new_token_ids), o.finished) for o in got]


@beside_the_student
def _first_two_turns():
    core = _core()
    gate = Gate(core)
    _add(core, "r", [5, 9, 12, 40, 7], 4)
    thread, box = _turn(core, 0)
    done = _wait_until(lambda: not thread.is_alive(), HOLD_S)
    first = {"done": done, "started": gate.started, "in_flight": len(core.batch_queue)}
    if not done:
        gate.open.set()
        thread.join(WAIT_S)
    first["value"] = _outputs(box.get("value", ("raised", "the turn never returned")))
    thread, box = _turn(core, 0)
    _wait_until(lambda: gate.started == 2 or not thread.is_alive(), HOLD_S)
    time.sleep(0.05)  # a turn that returns right after starting step 2 is done by now
    second = {"waited": thread.is_alive(), "started": gate.started}
    gate.open.set()
    thread.join(WAIT_S)
    second["value"] = _outputs(box.get("value", ("returned", None)))
    core.drain_batch_queue()
    return first, second


@pytest.mark.points(2)
def test_a_turn_starts_the_next_step_before_it_waits_for_the_running_one():
    first, second = _first_two_turns(beside=lab)
    assert first["done"] and first["value"] == ("returned", None), (
        f"the first turn {'returned ' + repr(first['value']) if first['done'] else 'waited'} "
        "while its step ran: with one step in flight and room for another, return None "
        "at once")
    assert (first["started"], first["in_flight"]) == (1, 1), (
        f"after the first turn: {first['started']} step(s) started, {first['in_flight']} in "
        "self.batch_queue; want 1 and 1")
    assert second["started"] == 2 and second["waited"], (
        f"the second turn started {second['started']} step(s) in all and "
        f"{'waited' if second['waited'] else 'did not wait'} for step 1: it must start step 2 "
        "and then wait for step 1 (the queue is full)")
    tokens = _reference_tokens(([5, 9, 12, 40, 7],), (4,), _config())[0]
    assert second["value"] == [("r", tokens[:1], False)], (
        f"the second turn returned {second['value']}; want step 1's outputs, "
        f"[('r', {tokens[:1]}, False)]")


@beside_the_student
def _empty_step_and_the_last():
    core = _core()
    gate = Gate(core)
    _add(core, "r", [5], 1)  # a step of one token: still one to plan ahead of
    turns = []
    for _ in range(4):
        thread, box = _turn(core, 0.5)
        gate.open.set()
        thread.join(WAIT_S)
        turns.append({"value": _outputs(box["value"]), "started": gate.started,
                      "in_flight": len(core.batch_queue)})
    return turns


@pytest.mark.points(2)
def test_a_step_of_no_tokens_is_started_and_the_turn_waits_for_the_oldest():
    turns = _empty_step_and_the_last(beside=lab)
    assert turns[0]["value"] == ("returned", None), f"first turn: got {turns[0]['value']}"
    value, started = turns[1]["value"], turns[1]["started"]
    assert started == 2, (
        f"second turn: r's last token is in flight, so nothing is scheduled, but the step is "
        f"started all the same (it carries the finished ids): {started} step(s) started, want 2")
    assert isinstance(value, list) and [(rid, done) for rid, _, done in value] == [("r", True)], (
        f"second turn: a step of no tokens must not make the turn return None; it waits for "
        f"step 1, which finishes r: got {value}")
    assert turns[2]["value"] == [] and turns[2]["in_flight"] == 0, (
        f"third turn: no unfinished request, one (empty) step in flight: wait for it and "
        f"return its outputs, []; got {turns[2]['value']} with {turns[2]['in_flight']} left "
        "in flight")
    assert turns[3]["value"] == [] and turns[3]["started"] == 2, (
        f"fourth turn: nothing to run, nothing in flight: return [] and start nothing; got "
        f"{turns[3]['value']} with {turns[3]['started']} step(s) started in all")


@beside_the_student
def _nothing_schedulable():
    core = _core()
    gate = Gate(core)
    _add(core, "r", [5, 9, 12], 4)
    core.scheduler.max_num_scheduled_tokens = 0  # nothing can be scheduled: a stall
    thread, box = _turn(core, 0.5)  # held: the step of nothing is still running
    gate.open.set()
    thread.join(WAIT_S)
    return {"value": _outputs(box["value"]), "started": gate.started,
            "in_flight": len(core.batch_queue)}


def test_a_turn_that_schedules_nothing_with_nothing_in_flight_returns_no_outputs():
    got = _nothing_schedulable(beside=lab)
    assert got["value"] == [] and got["started"] == 1 and got["in_flight"] == 0, (
        f"a turn whose step schedules nothing, with nothing else in flight, must start it, "
        f"wait for it and return [] (not None: the busy loop checks a turn with no output for "
        f"a stall); got {got['value']}, {got['started']} step(s) started, {got['in_flight']} in "
        "flight")


@beside_the_student
def _abort_in_flight():
    core = _core()
    gate = Gate(core)
    _add(core, "r", [5, 9, 12, 40, 7], 6)
    thread, box = _turn(core, 3.0)
    gate.open.set()
    thread.join(WAIT_S)
    first = _outputs(box["value"])
    core.scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    thread, box = _turn(core, WAIT_S)
    return {"first": first, "second": _outputs(box["value"]), "in_flight": len(core.batch_queue),
            "started": gate.started, "blocks": int(core.num_blocks_in_use)}


def test_a_step_in_flight_is_waited_for_even_when_no_request_is_left():
    got = _abort_in_flight(beside=lab)
    assert got["first"] == ("returned", None), f"set-up: first turn {got['first']}"
    assert got["second"] == [] and got["in_flight"] == 0 and got["started"] == 1, (
        f"r was aborted while its step ran: the next turn starts nothing, waits for that step "
        f"and returns [] (its token is dropped); got {got['second']}, {got['in_flight']} still "
        f"in flight, {got['started']} step(s) started")
    assert got["blocks"] == 0, f"{got['blocks']} block(s) still held"


@beside_the_student
def _failing_step():
    core = _core()
    gate = Gate(core, fail=True)
    _add(core, "r", [5, 9, 12], 4)
    values = []
    for _ in range(2):
        thread, box = _turn(core, 0.5)
        gate.open.set()
        thread.join(WAIT_S)
        values.append(_outputs(box["value"]))
    core.drain_batch_queue()
    return values


def test_a_failed_step_raises_from_the_turn_that_waits_for_it():
    first, second = _failing_step(beside=lab)
    assert first == ("returned", None), f"set-up: first turn {first}"
    assert second[0] == "raised" and "planted failure" in second[1], (
        f"step 1 raised RuntimeError('planted failure ...'); the turn that waits for it "
        f"must raise it (future.result() does), got {second}")


# ---------------------------------------------------------------------------- all four tasks


def _reference_tokens(prompts, max_tokens, config, stop=()):
    """The synchronous engine's tokens (and its prefix-cache counters) for ``prompts``."""
    core = ReferenceEngineCore(tiny_model(), config, async_scheduling=False)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        core.add_request(core.make_request(f"q{i}", list(prompt), _params(n, stop)))
    got = {f"q{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"q{i}"] for i in range(len(prompts))]


@beside_the_student
def _with_your_pieces(waves, config, stop=()):
    """Your scheduler and engine core run the requests of each wave to the end, the busy loop's
    way (``step_fn`` until nothing is unfinished or in flight). Returns the tokens, and what
    the engine holds afterwards."""
    from mini_vllm.engine import core as core_module

    saved = core_module.AsyncScheduler
    core_module.AsyncScheduler = lab.AsyncScheduler
    try:
        core = lab.EngineCore(tiny_model(), config, async_scheduling=True)
    finally:
        core_module.AsyncScheduler = saved
    got, requests = {}, []
    try:
        for wave in waves:
            for rid, prompt, n in wave:
                request = core.make_request(rid, list(prompt), _params(n, stop))
                core.add_request(request)
                requests.append(request)
                got[rid] = []
            for _ in range(MAX_TURNS):
                if not (core.has_unfinished_requests() or core.batch_queue):
                    break
                for out in core.step_fn() or []:
                    got[out.request_id] += out.new_token_ids
            else:
                raise RuntimeError(
                    f"the engine still had work after {MAX_TURNS} turns of step_fn(): some "
                    "request is never finished, or a step is never waited for")
    finally:
        core.drain_batch_queue()
    return {"tokens": got, "blocks": int(core.num_blocks_in_use),
            "placeholders": [r.num_output_placeholders for r in requests],
            "preemptions": core.scheduler.stats.num_preemptions,
            "hits": core.prefix_cache_hits, "queries": core.prefix_cache_queries,
            "peak_in_step": core.peak_blocks_in_step}


def _prompts(seed=7, count=8):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randrange(3, 30))]
            for _ in range(count)]


ENGINES = {
    "roomy": {},
    "chunked-prefill": dict(max_num_batched_tokens=12),
    "long-prefill-threshold": dict(long_prefill_token_threshold=5, max_num_batched_tokens=24),
    "preemption": dict(num_gpu_blocks=14, max_num_batched_tokens=24),
    "swap": dict(num_gpu_blocks=14, max_num_batched_tokens=24, preemption_mode="swap",
                 num_cpu_blocks=64),
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
}


@pytest.mark.points(3)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_your_async_engine_gives_the_synchronous_engine_s_tokens(engine):
    prompts = _prompts()
    max_tokens = [1, 2, 3, 9, 17, 24, 5, 12]
    config = _config(**ENGINES[engine])
    want = _reference_tokens(prompts, max_tokens, config)
    wave = [(f"q{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))]
    got = _with_your_pieces([wave], config, beside=lab)
    for i, prompt in enumerate(prompts):
        assert got["tokens"][f"q{i}"] == want[i], (
            f"{engine}: request q{i} (prompt of {len(prompt)}, max_tokens={max_tokens[i]}) "
            f"gave {got['tokens'][f'q{i}']}, the synchronous engine {want[i]}")
    assert got["blocks"] == 0 and not any(got["placeholders"]), (
        f"{engine}: at the end {got['blocks']} block(s) are held and the requests' "
        f"placeholders are {got['placeholders']}: want 0 and all 0")
    assert got["peak_in_step"] > 0, (
        "the engine's peak_blocks_in_step stayed 0: call self._record_blocks_in_step() after "
        "each schedule(), as step() does")
    if engine in ("preemption", "swap"):
        assert got["preemptions"] > 0, f"set-up: {engine} was meant to preempt"


def test_a_stop_token_mid_flight_gives_the_synchronous_engine_s_tokens():
    prompts = _prompts(seed=11, count=6)
    max_tokens = [20] * 6
    config = _config(max_num_batched_tokens=24)
    plain = _reference_tokens(prompts, max_tokens, config)
    stop = (plain[0][3],)  # a token the first request emits: it stops there, others may too
    want = _reference_tokens(prompts, max_tokens, config, stop)
    wave = [(f"q{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))]
    got = _with_your_pieces([wave], config, stop, beside=lab)
    assert [got["tokens"][f"q{i}"] for i in range(6)] == want, (
        f"with stop token {stop[0]}: got {[got['tokens'][f'q{i}'] for i in range(6)]}, the "
        f"synchronous engine {want}")
    assert got["blocks"] == 0, f"{got['blocks']} block(s) held after every request stopped"


def test_the_prefix_cache_hits_of_the_synchronous_engine():
    base = _prompts(seed=5, count=3)
    first = [(f"a{i}", p, 6) for i, p in enumerate(base)]
    second = [(f"b{i}", p + [1, 2], 4) for i, p in enumerate(base)]
    config = _config()
    want = _sync_waves([first, second], config)
    got = _with_your_pieces([first, second], config, beside=lab)
    assert got["tokens"] == want["tokens"], f"tokens: got {got['tokens']}, want {want['tokens']}"
    assert (got["hits"], got["queries"]) == (want["hits"], want["queries"]), (
        f"prefix cache (hits, queries): got ({got['hits']}, {got['queries']}), the synchronous "
        f"engine ({want['hits']}, {want['queries']}): the second wave's prompts extend the first "
        "wave's, whose written blocks must all be cached")
    assert got["hits"] > 0, "set-up: the second wave was meant to hit the cache"


def _sync_waves(waves, config):
    core = ReferenceEngineCore(tiny_model(), config, async_scheduling=False)
    got = {}
    for wave in waves:
        for rid, prompt, n in wave:
            core.add_request(core.make_request(rid, list(prompt), _params(n)))
            got[rid] = []
        while core.has_unfinished_requests():
            for out in core.step():
                got[out.request_id] += out.new_token_ids
    return {"tokens": got, "hits": core.prefix_cache_hits, "queries": core.prefix_cache_queries}
