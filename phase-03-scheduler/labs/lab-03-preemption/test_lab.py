"""Graded tests of lab 03-03: preemption by swapping.

The headline property: a request that is swapped out and back in resumes with exactly the KV it
had, so its paged-attention output is bit for bit the same. Around it: no block is lost or owned
twice across the GPU and CPU pools, swapped requests come back before new ones, an aborted
swapped request gives its CPU blocks back, and the two preemption modes generate the same
tokens while moving very different amounts of work.

Tests are grouped by task and use only their task and the ones before it: task 3's runs use the
reference's ``_schedule_swapped`` (``make_scheduler(upto=3)``), and swapped-out states are built
with the given ``_preempt`` (``swap_out_by_hand``).
"""

from __future__ import annotations

import random

import pytest
import torch

from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student, read
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_manager import cdiv
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.core.sched.scheduler import Scheduler as ReferenceScheduler
from mini_vllm.core.sched.scheduler import _Step
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.toy_runner import ToyModelRunner, run_engine

lab = load_lab(__file__)


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


def make_requests(specs, block_size, seed=0):
    """``specs``: list of (prompt length, max_tokens); ids r0, r1, ..."""
    rng = random.Random(seed)
    hasher = get_request_block_hasher(block_size, sha256)
    out = []
    for i, (n, max_tokens) in enumerate(specs):
        prompt = [rng.randrange(1, 100) for _ in range(n)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out.append(Request(f"r{i}", prompt, params, eos_token_id=None, block_hasher=hasher))
    return out


def make_scheduler(mode="swap", upto=4, **overrides):
    """Your Scheduler; with ``upto=3`` the reference's ``_schedule_swapped`` stands in for
    task 4."""
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, block_size=4,
              num_gpu_blocks=25, enable_prefix_caching=False, preemption_mode=mode,
              num_cpu_blocks=64)
    kw.update(overrides)
    return _scheduler_up_to(upto, SchedulerConfig(**kw), beside=lab)


@beside_the_student
def _scheduler_up_to(upto, config):
    """Built where your code runs (the class is made from yours there)."""
    cls = lab.Scheduler
    if upto < 4:
        cls = type("SchedulerUpToTask3", (lab.Scheduler,),
                   {"_schedule_swapped": vars(ReferenceScheduler)["_schedule_swapped"]})
    return cls(config)


@beside_the_student
def run_by_hand(scheduler, request, computed, outputs=(), lookahead=0):
    """Put an added request into ``running`` as a step would have left it: ``computed`` tokens
    with KV (GPU blocks claimed from the KV cache manager, ``lookahead`` slots more), then
    ``outputs`` sampled. (Done where your code runs: the queues are your scheduler's.)"""
    scheduler.waiting.remove(request)
    claimed = scheduler.kv_cache_manager.allocate_slots(request, computed,
                                                        num_lookahead_tokens=lookahead)
    assert claimed is not None, (
        f"set-up: the KV cache manager refused {computed} tokens of request "
        f"{request.request_id!r}"
    )
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = computed
    scheduler.running.append(request)
    for token in outputs:
        request.append_output_token_ids(token)


@beside_the_student
def swap_out_by_hand(scheduler, request, step=None):
    """Preempt a running request through the given ``_preempt`` (which calls your
    ``_preempt_by_swap``); returns the step it recorded into (its ``blocks_to_swap_out``)."""
    step = _Step(token_budget=0) if step is None else step
    scheduler.running.remove(request)
    scheduler._preempt(request, step)
    return step


def one_token_each(so, tokens=None):
    tokens = tokens or {}
    req_ids = list(so.num_scheduled_tokens)
    sampled = [list(tokens.get(r, [5])) for r in req_ids]
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def gpu_free(scheduler):
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def check_pools(live):
    """No block lost or owned twice, on either side. (The scheduler's state is read whole,
    once, and its methods asked of the live one: where your code has its own process, each
    attribute asked one by one would be a round trip.)"""
    scheduler = read(live)
    bs = scheduler.block_size
    kv = scheduler.kv_cache_manager
    owners: dict[int, str] = {}
    for rid, blocks in kv.req_to_blocks.items():
        for b in blocks:
            assert b.block_id not in owners, f"GPU block {b.block_id} owned twice"
            owners[b.block_id] = rid
    in_use = {b.block_id for b in kv.block_pool.blocks[1:] if b.ref_cnt > 0}
    assert in_use == set(owners), "a GPU block is in use but in no table, or the reverse"
    gpu_free = live.kv_cache_manager.block_pool.get_num_free_blocks()
    assert gpu_free == kv.block_pool.num_gpu_blocks - 1 - len(in_use), (
        f"{gpu_free} GPU blocks free, but {len(in_use)} of {kv.block_pool.num_gpu_blocks - 1} "
        f"are in use"
    )
    swap = scheduler.swap_space
    cpu_owners: dict[int, str] = {}
    for rid, blocks in swap.req_to_cpu_blocks.items():
        for b in blocks:
            assert b.block_id != 0, "the CPU null block was handed out"
            assert b.block_id not in cpu_owners, f"CPU block {b.block_id} owned twice"
            cpu_owners[b.block_id] = rid
    cpu_free = live.swap_space.get_num_free_blocks()
    assert cpu_free == swap.block_pool.num_gpu_blocks - 1 - len(cpu_owners), (
        f"{cpu_free} CPU blocks free, but swapped requests hold {len(cpu_owners)} of "
        f"{swap.block_pool.num_gpu_blocks - 1}"
    )
    swapped = {r.request_id for r in scheduler.swapped}
    assert set(swap.req_to_cpu_blocks) == swapped, "CPU blocks held exactly by swapped requests"
    for request in scheduler.swapped:
        assert request.status == RequestStatus.SWAPPED, (
            f"request {request.request_id!r} is in swapped with status {request.status!r}"
        )
        assert request.request_id not in kv.req_to_blocks, "a swapped request kept GPU blocks"
        want = cdiv(request.num_computed_tokens, bs)
        got = live.swap_space.num_swapped_blocks(request.request_id)
        assert got == want, (
            f"swapped request {request.request_id!r} computed {request.num_computed_tokens} "
            f"tokens, {want} block(s) of KV, but holds {got} CPU block(s): swap out exactly the "
            f"filled blocks"
        )


def check_kv(runner, scheduler):
    """Every running request's cached KV is exactly what its tokens and positions give."""
    for request in scheduler.running:
        state = runner.requests[request.request_id]
        n = request.num_computed_tokens
        k, v = runner.cached_kv(state.block_ids, n)
        ek, ev = runner.expected_kv(state.token_ids[:n])
        assert torch.equal(k, ek) and torch.equal(v, ev), f"{request.request_id}: wrong KV"


# ---------------------------------------------------------------------------------------------
# Task 1: swap_out
# ---------------------------------------------------------------------------------------------


def test_swap_out_pairs_each_gpu_block_with_its_own_cpu_block():
    space = lab.SwapSpace(8)
    mapping = space.swap_out("a", [5, 3, 9])
    assert [g for g, _ in mapping] == [5, 3, 9], "pair i must be logical block i"
    cpu = [c for _, c in mapping]
    assert len(set(cpu)) == 3 and 0 not in cpu, (
        f"swap_out of 3 GPU blocks must give 3 distinct CPU blocks, never the null block 0; "
        f"got CPU blocks {cpu}"
    )
    assert all(1 <= c < 8 for c in cpu), (
        f"CPU block ids lie in 1..7 (a pool of 8, block 0 reserved); got {cpu}: take the CPU "
        f"blocks from self.block_pool"
    )
    assert space.get_num_free_blocks() == 7 - 3, (
        f"swapping out 3 blocks should leave 4 of 7 CPU blocks free, got "
        f"{space.get_num_free_blocks()}: take the CPU blocks from self.block_pool"
    )
    assert space.num_swapped_blocks("a") == 3, (
        f"request 'a' should hold 3 CPU blocks, num_swapped_blocks gives "
        f"{space.num_swapped_blocks('a')}: record them in req_to_cpu_blocks['a']"
    )
    assert [b.block_id for b in space.req_to_cpu_blocks["a"]] == cpu, (
        f"req_to_cpu_blocks['a'] must list the mapping's CPU blocks {cpu} in the same order, got "
        f"{[b.block_id for b in space.req_to_cpu_blocks.get('a', [])]}"
    )
    more = space.swap_out("b", [1, 2])
    assert not set(c for _, c in more) & set(cpu), "a CPU block given to two requests"
    assert space.get_num_free_blocks() == 2, (
        f"3 CPU blocks held by 'a' and 2 by 'b' leave 2 of 7 free, got "
        f"{space.get_num_free_blocks()}"
    )


def test_swap_out_may_use_every_free_cpu_block_and_free_gives_them_back():
    space = lab.SwapSpace(5)  # 4 usable
    mapping = space.swap_out("a", [10, 11, 12, 13])
    assert sorted(c for _, c in mapping) == [1, 2, 3, 4], (
        f"a pool of 5 CPU blocks has 4 usable, all of which may be used: expected CPU blocks "
        f"[1, 2, 3, 4], got {sorted(c for _, c in mapping)}"
    )
    assert space.get_num_free_blocks() == 0 and space.can_swap_out(1) is False, (
        f"all 4 usable CPU blocks taken: expected 0 free and can_swap_out(1) False, got "
        f"{space.get_num_free_blocks()} free, can_swap_out(1)={space.can_swap_out(1)}"
    )
    space.free("a")  # given: an aborted swapped request drops its CPU blocks
    assert space.get_num_free_blocks() == 4 and space.num_swapped_blocks("a") == 0, (
        f"the given free('a') frees the blocks in req_to_cpu_blocks['a']: expected 4 free and 0 "
        f"held, got {space.get_num_free_blocks()} free, {space.num_swapped_blocks('a')} held"
    )
    assert len(space.swap_out("b", [7, 8, 9, 6])) == 4, (
        "after free('a') the 4 CPU blocks are free again: swap_out of 4 blocks gives 4 pairs"
    )


@pytest.mark.parametrize("case, numbers", [("twice", ["req-A"]), ("too-big", ["4", "3"])])
def test_swap_out_refuses_and_changes_nothing(case, numbers):
    space = lab.SwapSpace(6)
    space.swap_out("req-A", [1, 2])
    with pytest.raises(ValueError) as excinfo:
        if case == "twice":
            space.swap_out("req-A", [3])
        else:
            space.swap_out("req-B", [3, 4, 5, 6])
    for number in numbers:
        assert number in str(excinfo.value), f"the message must give {number!r}"
    assert space.num_swapped_blocks("req-A") == 2, (
        f"case {case!r}: a refused swap_out changes nothing, req-A still holds 2 CPU blocks; got "
        f"{space.num_swapped_blocks('req-A')}"
    )
    assert space.num_swapped_blocks("req-B") == 0 and "req-B" not in space.req_to_cpu_blocks, (
        f"case {case!r}: a refused swap_out records nothing for req-B; it holds "
        f"{space.num_swapped_blocks('req-B')} CPU block(s)"
    )
    assert space.get_num_free_blocks() == 3, (
        f"case {case!r}: a refused swap_out takes no CPU block: 3 free expected, got "
        f"{space.get_num_free_blocks()}: refuse before allocating"
    )


# ---------------------------------------------------------------------------------------------
# Task 2: swap_in
# ---------------------------------------------------------------------------------------------


def test_swap_in_returns_the_same_cpu_blocks_in_order():
    space = lab.SwapSpace(8)
    mapping = space.swap_out("a", [5, 3, 9])
    cpu = [c for _, c in mapping]
    back = space.swap_in("a", [11, 12, 13])
    want = [(cpu[0], 11), (cpu[1], 12), (cpu[2], 13)]
    assert back == want, (
        f"swap_in returns (cpu, gpu) pairs: the request's CPU blocks {cpu}, in the order "
        f"swap_out gave them, into the new GPU blocks [11, 12, 13]; expected {want}, got {back}"
    )
    free, held = space.get_num_free_blocks(), space.num_swapped_blocks("a")
    assert free == 7 and held == 0, (
        f"swap_in frees the request's CPU blocks: 7 free and 0 held expected, got {free} free, "
        f"{held} held"
    )
    assert "a" not in space.req_to_cpu_blocks, "swap_in forgets the request's CPU block list"
    # Swapped out again, it gets CPU blocks again (the freed ones are reusable).
    again = space.swap_out("a", [1, 2, 3, 4, 5, 6, 7])
    got = sorted(c for _, c in again)
    assert got == list(range(1, 8)), (
        f"after swap_in every CPU block 1..7 is free again and reusable; swap_out got {got}"
    )


def test_swap_in_of_one_request_leaves_the_others_parked():
    space = lab.SwapSpace(8)
    a = space.swap_out("a", [1, 2])
    b = space.swap_out("b", [3, 4, 5])
    assert space.swap_in("b", [6, 7, 8]) == [(c, g) for (_, c), g in zip(b, [6, 7, 8])], (
        f"swap_in('b', [6, 7, 8]) must pair b's CPU blocks {[c for _, c in b]}, in order, with "
        f"GPU blocks 6, 7, 8 as (cpu, gpu)"
    )
    assert space.num_swapped_blocks("a") == 2 and space.get_num_free_blocks() == 5, (
        f"swap_in('b') frees b's 3 CPU blocks, leaving 'a' parked: expected 'a' holding 2 and "
        f"5 free, got {space.num_swapped_blocks('a')} held, {space.get_num_free_blocks()} free"
    )
    assert space.swap_in("a", [9, 10]) == [(c, g) for (_, c), g in zip(a, [9, 10])], (
        f"swap_in('a', [9, 10]) must pair a's CPU blocks {[c for _, c in a]}, in order, with "
        f"GPU blocks 9, 10 as (cpu, gpu)"
    )
    assert space.get_num_free_blocks() == 7, (
        f"both requests swapped back in: all 7 CPU blocks free expected, got "
        f"{space.get_num_free_blocks()}: does swap_in free the request's CPU blocks?"
    )


@pytest.mark.parametrize("case, numbers", [("unknown", ["req-B"]), ("too-few", ["2", "1"]),
                                           ("too-many", ["2", "3"])])
def test_swap_in_refuses_and_changes_nothing(case, numbers):
    space = lab.SwapSpace(6)
    mapping = space.swap_out("req-A", [1, 2])
    with pytest.raises(ValueError) as excinfo:
        if case == "unknown":
            space.swap_in("req-B", [1])
        elif case == "too-few":
            space.swap_in("req-A", [7])
        else:
            space.swap_in("req-A", [7, 8, 9])
    for number in numbers:
        assert number in str(excinfo.value), f"the message must give {number!r}"
    assert space.num_swapped_blocks("req-A") == 2, (
        f"case {case!r}: a refused swap_in changes nothing, req-A still holds 2 CPU blocks; got "
        f"{space.num_swapped_blocks('req-A')}"
    )
    assert space.get_num_free_blocks() == 3, (
        f"case {case!r}: a refused swap_in frees nothing: 3 CPU blocks free expected, got "
        f"{space.get_num_free_blocks()}: refuse before freeing"
    )
    assert space.swap_in("req-A", [7, 8]) == [(c, g) for (_, c), g in zip(mapping, [7, 8])], (
        f"case {case!r}: after the refusal, swap_in('req-A', [7, 8]) must still pair its CPU "
        f"blocks {[c for _, c in mapping]} with 7, 8"
    )


# ---------------------------------------------------------------------------------------------
# Task 3: preemption by swap (the reference's _schedule_swapped brings requests back)
# ---------------------------------------------------------------------------------------------


def test_swap_preemption_keeps_progress_and_moves_the_right_blocks():
    bs = 4
    scheduler = make_scheduler(upto=3, num_gpu_blocks=10, max_num_batched_tokens=64)
    requests = make_requests([(12, 8), (12, 8), (12, 8)], bs)
    for request in requests:
        scheduler.add_request(request)
    so = scheduler.schedule()  # 9 blocks: full
    victim_blocks = scheduler.kv_cache_manager.get_block_ids("r2")[0]
    scheduler.update_from_output(so, one_token_each(so))
    so = scheduler.schedule()
    assert so.preempted_req_ids == ["r2"], (
        f"only the newest request r2 should be preempted, got {so.preempted_req_ids} (more "
        f"victims: does _preempt_by_swap give r2's GPU blocks back?)"
    )
    victim = requests[2]
    assert victim.status == RequestStatus.SWAPPED, (
        f"the swapped-out victim r2 should have status SWAPPED, got {victim.status!r}"
    )
    assert victim.num_computed_tokens == 12, "swapping keeps the computed tokens"
    assert list(scheduler.swapped) == [victim] and len(scheduler.waiting) == 0, (
        f"r2 should be parked in swapped, with nobody waiting; swapped "
        f"{[r.request_id for r in scheduler.swapped]}, waiting "
        f"{[r.request_id for r in scheduler.waiting]}"
    )
    assert [g for g, _ in so.blocks_to_swap_out] == victim_blocks, (
        f"blocks_to_swap_out should move r2's GPU blocks {victim_blocks} in table order, got "
        f"{[g for g, _ in so.blocks_to_swap_out]}"
    )
    assert so.blocks_to_swap_in == [], (
        f"nothing is swapped in in the step that swaps r2 out; blocks_to_swap_in "
        f"{so.blocks_to_swap_in}"
    )
    assert len(set(c for _, c in so.blocks_to_swap_out)) == 3, (
        f"r2's 3 GPU blocks need 3 distinct CPU blocks; blocks_to_swap_out {so.blocks_to_swap_out}"
    )
    assert [c.block_id for c in scheduler.swap_space.req_to_cpu_blocks["r2"]] == [
        c for _, c in so.blocks_to_swap_out], (
        f"req_to_cpu_blocks['r2'] must list the CPU blocks of blocks_to_swap_out, in order: "
        f"{[c for _, c in so.blocks_to_swap_out]}, got "
        f"{[c.block_id for c in scheduler.swap_space.req_to_cpu_blocks.get('r2', [])]}"
    )
    assert scheduler.stats.num_blocks_swapped_out == 3, (
        f"3 blocks swapped out, stats.num_blocks_swapped_out is "
        f"{scheduler.stats.num_blocks_swapped_out}: _preempt_by_swap counts them"
    )
    assert scheduler.stats.num_swap_preemptions == 1 and victim.num_preemptions == 1, (
        f"one swap preemption expected: stats.num_swap_preemptions "
        f"{scheduler.stats.num_swap_preemptions}, r2.num_preemptions {victim.num_preemptions}"
    )
    assert gpu_free(scheduler) == 1, (
        f"r0 and r1 each take one of r2's 3 freed GPU blocks, leaving 1 free; got "
        f"{gpu_free(scheduler)}: does _preempt_by_swap free the victim's GPU blocks?"
    )
    check_pools(scheduler)


@pytest.mark.parametrize("computed, blocks", [(9, 3), (8, 2), (1, 1)])
def test_only_the_blocks_with_computed_tokens_travel(computed, blocks):
    """A table of 4 GPU blocks holding ``computed`` tokens: the first cdiv(computed, 4) blocks
    are swapped out (the last one may be partly filled), and all 4 are freed."""
    scheduler = make_scheduler(upto=3, num_gpu_blocks=10)
    request = make_requests([(16, 4)], 4)[0]
    scheduler.add_request(request)
    run_by_hand(scheduler, request, computed, lookahead=16 - computed)
    table = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    assert len(table) == 4, f"set-up: a table of 4 blocks, got {table}"
    step = swap_out_by_hand(scheduler, request)
    moved = [g for g, _ in step.blocks_to_swap_out]
    assert moved == table[:blocks], (
        f"{computed} computed tokens fill the first {blocks} of the table {table} (the last one "
        f"maybe partly): exactly those are swapped out, in order; got {moved}"
    )
    held = scheduler.swap_space.num_swapped_blocks("r0")
    assert held == blocks, f"the request holds {blocks} CPU block(s), got {held}"
    assert request.num_computed_tokens == computed, (
        f"swapping keeps the computed tokens ({computed}), got {request.num_computed_tokens}"
    )
    assert gpu_free(scheduler) == 9, (
        f"all 4 GPU blocks are freed, lookahead ones too: 9 free, got {gpu_free(scheduler)}"
    )
    assert list(scheduler.swapped) == [request] and scheduler.running == [], (
        f"the request moves from running to swapped: swapped "
        f"{[r.request_id for r in scheduler.swapped]}, running "
        f"{[r.request_id for r in scheduler.running]}"
    )
    check_pools(scheduler)


def test_victims_join_the_back_of_swapped_and_add_to_the_step():
    scheduler = make_scheduler(upto=3, num_gpu_blocks=10)
    requests = make_requests([(8, 4), (8, 4), (8, 4)], 4)
    for request in requests:
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 8, outputs=[5])
    step = _Step(token_budget=0)
    step.blocks_to_swap_out.append((99, 99))  # what an earlier victim of the step added
    for request in (requests[2], requests[0]):
        swap_out_by_hand(scheduler, request, step)
    swapped = [r.request_id for r in scheduler.swapped]
    assert swapped == ["r2", "r0"], (
        f"each victim joins the back of swapped, in the order preempted (r2, then r0); got "
        f"{swapped}"
    )
    pairs = step.blocks_to_swap_out
    assert len(pairs) == 5 and pairs[0] == (99, 99), (
        f"the victims' 4 (gpu, cpu) pairs are appended after the step's earlier one (99, 99); "
        f"got {pairs}"
    )
    assert scheduler.stats.num_blocks_swapped_out == 4, (
        f"4 blocks swapped out, stats count {scheduler.stats.num_blocks_swapped_out}"
    )
    check_pools(scheduler)


def test_an_aborted_swapped_request_gives_its_cpu_blocks_back():
    """A client aborts a request while its KV is parked on the CPU: finish_requests (lab
    03-01's, given here) drops it from `swapped` and the swap space frees its CPU blocks."""
    bs = 4
    scheduler = make_scheduler(upto=3, num_gpu_blocks=10, num_cpu_blocks=8)
    requests = make_requests([(12, 6), (12, 6), (12, 6)], bs)
    for request in requests:
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 12, outputs=[5])
    swap_out_by_hand(scheduler, requests[1])
    assert scheduler.swap_space.get_num_free_blocks() == 7 - 3, (
        f"swapping r1 out (3 blocks) should leave 4 of 7 CPU blocks free, got "
        f"{scheduler.swap_space.get_num_free_blocks()}"
    )
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert scheduler.swap_space.get_num_free_blocks() == 7, (
        f"aborting the swapped r1 gives its 3 CPU blocks back: 7 free expected, got "
        f"{scheduler.swap_space.get_num_free_blocks()}"
    )
    assert scheduler.swap_space.num_swapped_blocks("r1") == 0, (
        f"the aborted r1 holds no CPU block, got {scheduler.swap_space.num_swapped_blocks('r1')}"
    )
    assert list(scheduler.swapped) == [] and "r1" not in scheduler.requests, (
        f"the aborted r1 leaves swapped and requests; swapped "
        f"{[r.request_id for r in scheduler.swapped]}, in requests: {'r1' in scheduler.requests}"
    )
    assert requests[1].status == RequestStatus.FINISHED_ABORTED, (
        f"the aborted r1 should be FINISHED_ABORTED, got {requests[1].status!r}"
    )
    check_pools(scheduler)
    so = scheduler.schedule()
    assert "r1" in so.finished_req_ids and so.blocks_to_swap_in == [], (
        f"the next step reports r1 finished and swaps nothing in; finished "
        f"{sorted(so.finished_req_ids)}, blocks_to_swap_in {so.blocks_to_swap_in}"
    )
    for _ in range(50):  # the others run to the end
        scheduler.update_from_output(so, one_token_each(so))
        check_pools(scheduler)
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
    assert [r.num_output_tokens for r in requests] == [6, 1, 6], (
        f"r0 and r2 run to their 6 tokens, the aborted r1 keeps its 1; got "
        f"{[r.num_output_tokens for r in requests]}"
    )
    assert scheduler.swap_space.get_num_free_blocks() == 7, (
        f"at the end all 7 CPU blocks are free, got {scheduler.swap_space.get_num_free_blocks()}"
    )


def test_full_cpu_pool_falls_back_to_recompute():
    """Swap while the CPU pool has room (3 usable blocks: one victim of 3 blocks), recompute once
    it is full; the pools and the KV stay consistent either way."""
    bs = 4
    scheduler = make_scheduler(upto=3, num_gpu_blocks=10, num_cpu_blocks=4)
    runner = ToyModelRunner(bs, 10, 4)
    run_engine(scheduler, runner, {0: make_requests([(12, 8)] * 4, bs)},
               on_step=lambda s, so, sch: (check_pools(sch), check_kv(runner, sch)))
    assert scheduler.stats.num_swap_preemptions >= 1, (
        f"the first victim fits the 3 CPU blocks and is swapped; stats.num_swap_preemptions "
        f"{scheduler.stats.num_swap_preemptions}"
    )
    assert scheduler.stats.num_recompute_preemptions >= 1, (
        f"with the CPU pool full, later victims are recomputed; stats.num_recompute_preemptions "
        f"{scheduler.stats.num_recompute_preemptions}"
    )
    assert scheduler.swap_space.get_num_free_blocks() == 3, (
        f"at the end all 3 CPU blocks are free again, got "
        f"{scheduler.swap_space.get_num_free_blocks()}: does swap_in free the CPU blocks?"
    )


# ---------------------------------------------------------------------------------------------
# Task 4: bringing swapped requests back
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("upto", [3, 4], ids=["resumed-by-the-reference", "resumed-by-yours"])
def test_swapped_request_resumes_with_exactly_its_kv(upto):
    """Snapshot the victim's KV and its paged-attention output when it is swapped out; after it
    is swapped back in (into other blocks), both are bit for bit the same. With ``upto=3`` the
    reference's _schedule_swapped brings it back (a test of your swap-out), with 4 yours."""
    bs = 4
    scheduler = make_scheduler(upto=upto, num_gpu_blocks=16)
    runner = ToyModelRunner(bs, 16, 64)
    for request in make_requests([(13, 20), (14, 20), (15, 20)], bs):
        scheduler.add_request(request)
    query = torch.randn(1, runner.num_heads, runner.head_size,
                        generator=torch.Generator().manual_seed(0))

    def attend(block_ids, n):
        out = torch.empty_like(query)
        table = torch.tensor([block_ids], dtype=torch.int32)
        paged_attention_v1(out, query, runner.key_cache, runner.value_cache,
                           runner.num_kv_heads, 0.5, table, torch.tensor([n], dtype=torch.int32),
                           bs, n)
        return out

    snapshots = {}
    resumed = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        for rid in so.preempted_req_ids:
            request = next(r for r in scheduler.swapped if r.request_id == rid)
            n = request.num_computed_tokens
            old = runner.requests[rid].block_ids  # the runner has not run this step yet
            snapshots[rid] = (n, runner.cached_kv(old, n), attend(old, n))
            assert [g for g, _ in so.blocks_to_swap_out][-cdiv(n, bs):] == old[: cdiv(n, bs)], (
                f"{rid} swapped out with {n} computed tokens: its first {cdiv(n, bs)} GPU blocks "
                f"{old[: cdiv(n, bs)]} must be swapped out in table order, got "
                f"{[g for g, _ in so.blocks_to_swap_out][-cdiv(n, bs):]}"
            )
        cached = so.scheduled_cached_reqs
        mro = runner.execute_model(so)
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i] and rid in snapshots:
                n, (k, v), out = snapshots.pop(rid)
                new = runner.requests[rid].block_ids
                k2, v2 = runner.cached_kv(new, n)
                assert torch.equal(k2, k) and torch.equal(v2, v), f"{rid} lost its KV"
                assert torch.equal(attend(new, n), out), f"{rid}: attention output changed"
                resumed.append(rid)
        scheduler.update_from_output(so, mro)
        check_pools(scheduler)
        check_kv(runner, scheduler)
    assert resumed, "the workload must swap a request out and back in"
    assert scheduler.stats.num_swap_preemptions >= 1, (
        f"the workload should swap a request out; stats.num_swap_preemptions "
        f"{scheduler.stats.num_swap_preemptions}"
    )
    assert scheduler.stats.num_recompute_preemptions == 0, (
        f"64 CPU blocks hold every victim, so nobody is recomputed; "
        f"stats.num_recompute_preemptions {scheduler.stats.num_recompute_preemptions}"
    )
    assert not scheduler.has_unfinished_requests(), (
        f"after 200 steps requests are unfinished: {len(scheduler.running)} running, "
        f"{len(scheduler.waiting)} waiting, {len(scheduler.swapped)} swapped"
    )


def _one_swapped_and_room(max_num_seqs=8, budget=64):
    """"r0", "r1", "r2" of 12 computed tokens and one sampled token fill 9 usable blocks; "r2"
    is swapped out (its 3 blocks), then "r0" is aborted: 7 GPU blocks are free."""
    scheduler = make_scheduler(num_gpu_blocks=10, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget)
    requests = make_requests([(12, 8), (12, 8), (12, 8), (10, 4)], 4)
    for request in requests[:3]:
        scheduler.add_request(request)
        run_by_hand(scheduler, request, 12, outputs=[5])
    swapped_out = swap_out_by_hand(scheduler, requests[2]).blocks_to_swap_out
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert gpu_free(scheduler) == 6, (
        f"set-up: r2 swapped out and r0 aborted leave 6 GPU blocks free, not {gpu_free(scheduler)}"
    )
    return scheduler, requests, swapped_out


def test_resume_pairs_the_cpu_blocks_with_the_first_new_blocks():
    scheduler, requests, swapped_out = _one_swapped_and_room()
    victim = requests[2]
    so = scheduler.schedule()
    table = scheduler.kv_cache_manager.get_block_ids("r2")[0]
    assert len(table) == 4, "room for its 12 parked tokens and the new one"
    assert so.blocks_to_swap_in == [(c, g) for (_, c), g in zip(swapped_out, table[:3])], (
        f"r2's CPU blocks {[c for _, c in swapped_out]} go, in order, into the first 3 blocks "
        f"of its new table {table}; blocks_to_swap_in {so.blocks_to_swap_in}"
    )
    assert so.num_scheduled_tokens == {"r1": 1, "r2": 1}, (
        f"r1 runs 1 token and the resumed r2 1; num_scheduled_tokens {so.num_scheduled_tokens}"
    )
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["r1", "r2"], (
        f"scheduled_cached_reqs should list r1, then the resumed r2; got {cached.req_ids}"
    )
    assert cached.resumed_from_preemption == [False, True], (
        f"r2 resumes from preemption, r1 does not: expected [False, True], got "
        f"{cached.resumed_from_preemption}: put r2 in step.scheduled_resumed_reqs"
    )
    assert cached.new_block_ids[1] == (table,), "a resumed request gets its whole table"
    assert cached.num_computed_tokens == [12, 12], (
        f"r1 and r2 both resume from 12 computed tokens, got {cached.num_computed_tokens}"
    )
    assert victim.status == RequestStatus.RUNNING and victim.num_computed_tokens == 13, (
        f"after the step r2 is RUNNING with 13 computed tokens; got {victim.status!r}, "
        f"{victim.num_computed_tokens}"
    )
    assert [r.request_id for r in scheduler.running] == ["r1", "r2"], (
        f"the resumed r2 joins the back of running: expected ['r1', 'r2'], got "
        f"{[r.request_id for r in scheduler.running]}"
    )
    assert list(scheduler.swapped) == [], (
        f"r2 has left swapped; swapped still holds {[r.request_id for r in scheduler.swapped]}"
    )
    assert scheduler.stats.num_blocks_swapped_in == 3, (
        f"3 blocks swapped in, stats.num_blocks_swapped_in is "
        f"{scheduler.stats.num_blocks_swapped_in}: _schedule_swapped counts them"
    )
    assert scheduler.swap_space.get_num_free_blocks() == 63, (
        f"swap_in frees r2's 3 CPU blocks: 63 free expected, got "
        f"{scheduler.swap_space.get_num_free_blocks()}"
    )
    check_pools(scheduler)


@pytest.mark.parametrize("budget, want", [(6, {"r1": 1, "r2": 1, "r3": 4}),
                                          (2, {"r1": 1, "r2": 1})])
def test_a_resumed_request_takes_its_tokens_from_the_budget(budget, want):
    """"r1" takes 1 token, "r2" resumes with 1 (the last one of a budget of 2), and the waiting
    "r3" gets what is left."""
    scheduler, requests, _ = _one_swapped_and_room(budget=budget)
    scheduler.add_request(requests[3])
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == want, (
        f"budget {budget}: running first, then the swapped request resumes with what is left "
        f"(its tokens come out of the same budget), then waiting; expected {want}, got "
        f"{so.num_scheduled_tokens}"
    )


@pytest.mark.parametrize("case", ["seats", "budget", "nothing-to-do", "fcfs"])
def test_swapped_requests_wait_when_they_cannot_resume(case):
    """Nobody resumes: all seats taken; no budget left; the head of `swapped` has nothing to do
    yet (its token has not come back); the head does not fit the GPU, and the one behind it,
    which would, may not overtake it. Waiting requests are not admitted either."""
    scheduler = make_scheduler(num_gpu_blocks=10, max_num_batched_tokens=64)
    specs = [(12, 8), (16, 8), (4, 8), (8, 8), (3, 2)]
    r0, r1, r2, r3, late = make_requests(specs, 4)
    for request in (r0, r1, r2, r3, late):
        scheduler.add_request(request)
    run_by_hand(scheduler, r0, 12, outputs=[5])                     # 3 blocks
    run_by_hand(scheduler, r1, 16, outputs=[] if case == "nothing-to-do" else [5])  # 4 blocks
    run_by_hand(scheduler, r2, 4, outputs=[5])                      # 1 block
    swap_out_by_hand(scheduler, r1)
    swap_out_by_hand(scheduler, r2)
    if case == "seats":
        scheduler.max_num_running_reqs = 1
    elif case == "budget":
        scheduler.max_num_scheduled_tokens = 1  # "r0" takes it
    elif case == "fcfs":
        run_by_hand(scheduler, r3, 8, outputs=[5])  # 2 blocks: 4 free, "r1" needs 5, "r2" 2
    so = scheduler.schedule()
    swapped = [r.request_id for r in scheduler.swapped]
    assert swapped == ["r1", "r2"], (
        f"case {case!r}: nobody may resume, so r1 and r2 stay swapped in order; swapped: {swapped}"
    )
    resumed = so.scheduled_cached_reqs.resumed_from_preemption
    assert so.blocks_to_swap_in == [] and not any(resumed), (
        f"case {case!r}: nothing swapped in: blocks_to_swap_in {so.blocks_to_swap_in}, resumed "
        f"{resumed}"
    )
    assert so.scheduled_new_reqs == [], "nobody is admitted while requests are swapped out"
    assert scheduler.stats.num_blocks_swapped_in == 0, (
        f"no block swapped in, stats count {scheduler.stats.num_blocks_swapped_in}"
    )
    assert r1.status == r2.status == RequestStatus.SWAPPED, (
        f"both stay SWAPPED: r1 {r1.status!r}, r2 {r2.status!r}"
    )
    check_pools(scheduler)


def test_swapped_requests_come_back_before_new_ones():
    bs = 4
    scheduler = make_scheduler(num_gpu_blocks=14, max_num_batched_tokens=32)
    runner = ToyModelRunner(bs, 14, 64, with_kv=False)
    early = make_requests([(16, 12), (16, 12), (16, 12)], bs)
    late = make_requests([(4, 2)], bs, seed=9)[0]
    late.request_id = "late"
    order = []

    def on_step(step, so, sch):
        check_pools(sch)
        for rid in so.scheduled_cached_reqs.req_ids:
            i = so.scheduled_cached_reqs.req_ids.index(rid)
            if so.scheduled_cached_reqs.resumed_from_preemption[i]:
                order.append(("resume", rid, step))
                assert so.blocks_to_swap_in, "a swapped request resumed without a swap-in"
        for new in so.scheduled_new_reqs:
            order.append(("admit", new.req_id, step))
        if sch.swapped:
            assert all(n.req_id != "late" for n in so.scheduled_new_reqs), (
                f"step {step}: the waiting request 'late' was admitted while "
                f"{[r.request_id for r in sch.swapped]} wait in swapped: swapped requests "
                f"resume first"
            )
            if any(r.request_id == "late" for r in sch.waiting):
                order.append(("late-waits-behind-swapped", "late", step))

    run_engine(scheduler, runner, {0: early, 3: [late]}, on_step=on_step)
    resumes = [s for kind, _, s in order if kind == "resume"]
    admit_late = [s for kind, rid, s in order if kind == "admit" and rid == "late"]
    assert any(kind == "late-waits-behind-swapped" for kind, _, _ in order), (
        f"the workload should make 'late' wait while requests are swapped out; it never did "
        f"(events {order[:6]})"
    )
    assert resumes and admit_late and min(resumes) <= admit_late[0], (
        f"a swapped request resumes before 'late' is admitted: resume steps {resumes[:8]}, "
        f"'late' admitted at steps {admit_late[:1]}"
    )
    assert scheduler.swap_space.get_num_free_blocks() == 63, (
        f"at the end all 63 CPU blocks are free, got {scheduler.swap_space.get_num_free_blocks()}"
    )


@pytest.mark.parametrize("seed", range(4))
def test_swap_recompute_and_no_preemption_agree(seed):
    """Random workloads: in swap mode the pools stay consistent and the KV exact after every
    step; the generated tokens equal a recompute run and a run with a cache large enough that
    nobody is preempted; at the end both pools are entirely free."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    specs = [(rng.randint(2, 30), rng.randint(4, 16)) for _ in range(7)]
    arrivals_at = [rng.randint(0, 6) for _ in specs]
    num_blocks = max(cdiv(n + m, bs) for n, m in specs) + 4
    results = {}
    runs = (("swap", "swap", num_blocks), ("recompute", "recompute", num_blocks),
            ("roomy", "recompute", 400))
    for label, mode, blocks in runs:
        scheduler = make_scheduler(mode, num_gpu_blocks=blocks, block_size=bs,
                                   max_num_batched_tokens=rng.choice([16, 32]) if label == "swap"
                                   else results["swap_budget"], num_cpu_blocks=200)
        if label == "swap":
            results["swap_budget"] = scheduler.max_num_scheduled_tokens
        runner = ToyModelRunner(bs, blocks, 200)
        requests = make_requests(specs, bs, seed)
        arrivals = {}
        for request, at in zip(requests, arrivals_at):
            arrivals.setdefault(at, []).append(request)

        def on_step(step, so, sch, runner=runner):
            if sch.swap_space is not None:
                check_pools(sch)
            check_kv(runner, sch)

        run_engine(scheduler, runner, arrivals, on_step=on_step)
        results[label] = ([list(r.output_token_ids) for r in requests], scheduler.stats)
        kv = scheduler.kv_cache_manager.block_pool
        assert kv.get_num_free_blocks() == kv.num_gpu_blocks - 1, (
            f"seed {seed}, {label} run: at the end all {kv.num_gpu_blocks - 1} GPU blocks are "
            f"free, got {kv.get_num_free_blocks()}"
        )
        if scheduler.swap_space is not None:
            assert scheduler.swap_space.get_num_free_blocks() == 199, (
                f"seed {seed}, {label} run: at the end all 199 CPU blocks are free, got "
                f"{scheduler.swap_space.get_num_free_blocks()}"
            )
    assert results["swap"][0] == results["roomy"][0] == results["recompute"][0], (
        f"seed {seed}: the swap, recompute and roomy runs must generate the same tokens; they "
        f"differ (swap == roomy: {results['swap'][0] == results['roomy'][0]}, recompute == roomy: "
        f"{results['recompute'][0] == results['roomy'][0]})"
    )
    swap_stats, rec_stats = results["swap"][1], results["recompute"][1]
    assert results["roomy"][1].num_preemptions == 0, (
        f"test premise: the roomy run (400 blocks) preempts nobody, but preempted "
        f"{results['roomy'][1].num_preemptions} times"
    )
    assert swap_stats.num_recomputed_tokens == 0, (
        f"seed {seed}: swap mode with 200 CPU blocks recomputes nothing, but "
        f"{swap_stats.num_recomputed_tokens} tokens were recomputed"
    )
    assert swap_stats.num_blocks_swapped_out == swap_stats.num_blocks_swapped_in, (
        f"seed {seed}: every block swapped out comes back in: {swap_stats.num_blocks_swapped_out} "
        f"out, {swap_stats.num_blocks_swapped_in} in"
    )
    if rec_stats.num_preemptions:
        assert rec_stats.num_recomputed_tokens > 0, (
            f"test premise: recompute mode preempted {rec_stats.num_preemptions} times but "
            f"recomputed no token"
        )


@pytest.mark.parametrize("seed", range(3))
def test_aborts_at_any_point_leave_both_pools_clean(seed):
    """Random swap-mode workloads where a random request is aborted at a random step, whatever
    queue it is in (running, waiting, swapped): the pools stay consistent after every step and
    end entirely free; the others still generate all their tokens."""
    rng = random.Random(100 + seed)
    bs = rng.choice([2, 4])
    specs = [(rng.randint(4, 24), rng.randint(4, 12)) for _ in range(6)]
    blocks = max(cdiv(n + m, bs) for n, m in specs) + 3
    scheduler = make_scheduler(num_gpu_blocks=blocks, block_size=bs,
                               max_num_batched_tokens=16, num_cpu_blocks=40)
    runner = ToyModelRunner(bs, blocks, 40, with_kv=False)
    requests = make_requests(specs, bs, seed)
    aborts = {rng.randint(1, 25): f"r{i}" for i in rng.sample(range(6), 3)}
    where = []

    def on_step(step, so, sch):
        rid = aborts.get(step)
        if rid is not None and rid in sch.requests:
            where.append(sch.requests[rid].status)
            sch.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        check_pools(sch)

    run_engine(scheduler, runner, {0: requests}, on_step=on_step)
    assert scheduler.stats.num_swap_preemptions > 0, "the workload must swap"
    for request in requests:
        assert request.is_finished(), (
            f"seed {seed}: {request.request_id} never finished (status {request.status!r})"
        )
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert request.num_output_tokens == request.max_tokens, (
                f"seed {seed}: {request.request_id} (not aborted) generated "
                f"{request.num_output_tokens} of its {request.max_tokens} tokens"
            )
    assert scheduler.swap_space.get_num_free_blocks() == 39, (
        f"seed {seed}: at the end all 39 CPU blocks are free, got "
        f"{scheduler.swap_space.get_num_free_blocks()}"
    )
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, (
        f"seed {seed}: at the end all {pool.num_gpu_blocks - 1} GPU blocks are free, got "
        f"{pool.get_num_free_blocks()}"
    )


def test_the_two_modes_trade_recompute_for_copies():
    """The measurement of the benchmark, as counts (no clocks): on a workload that forces
    preemption, recompute mode recomputes tokens and copies nothing; swap mode recomputes
    nothing and copies every preempted block out and back in."""
    bs = 4
    stats = {}
    for mode in ("recompute", "swap"):
        scheduler = make_scheduler(mode, num_gpu_blocks=20, max_num_batched_tokens=48)
        runner = ToyModelRunner(bs, 20, 64, with_kv=False)
        run_engine(scheduler, runner, {0: make_requests([(20, 24)] * 4, bs)})
        stats[mode] = scheduler.stats
    assert stats["recompute"].num_preemptions > 0 and stats["swap"].num_preemptions > 0, (
        f"the workload must preempt in both modes: recompute {stats['recompute'].num_preemptions}"
        f", swap {stats['swap'].num_preemptions} preemptions"
    )
    assert stats["recompute"].num_recomputed_tokens > 0, (
        "test premise: recompute mode preempts, so it recomputes tokens; it recomputed none"
    )
    assert stats["recompute"].num_blocks_swapped_out == 0, (
        f"test premise: recompute mode swaps nothing out, got "
        f"{stats['recompute'].num_blocks_swapped_out} blocks"
    )
    assert stats["swap"].num_recomputed_tokens == 0, (
        f"swap mode with 64 CPU blocks recomputes nothing, but "
        f"{stats['swap'].num_recomputed_tokens} tokens were recomputed"
    )
    assert stats["swap"].num_blocks_swapped_in == stats["swap"].num_blocks_swapped_out > 0, (
        f"swap mode copies every preempted block out and back in: "
        f"{stats['swap'].num_blocks_swapped_out} out, {stats['swap'].num_blocks_swapped_in} in"
    )
