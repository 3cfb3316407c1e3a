"""Graded tests of lab 03-03: preemption by swapping.

The headline property: a request that is swapped out and back in resumes with exactly the KV it
had, so its paged-attention output is bit for bit the same. Around it: no block is lost or owned
twice across the GPU and CPU pools, swapped requests come back before new ones, and the two
preemption modes generate the same tokens while moving very different amounts of work.
"""

from __future__ import annotations

import random

import pytest
import torch

from course.loader import load_lab
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.config import SchedulerConfig
from mini_vllm.kv_cache_manager import cdiv
from mini_vllm.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.toy_runner import ToyModelRunner, run_engine

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


def make_scheduler(mode="swap", **overrides):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, block_size=4,
              num_gpu_blocks=25, enable_prefix_caching=False, preemption_mode=mode,
              num_cpu_blocks=64)
    kw.update(overrides)
    return lab.Scheduler(SchedulerConfig(**kw))


def check_pools(scheduler):
    """No block lost or owned twice, on either side."""
    bs = scheduler.block_size
    kv = scheduler.kv_cache_manager
    owners: dict[int, str] = {}
    for rid, blocks in kv.req_to_blocks.items():
        for b in blocks:
            assert b.block_id not in owners, f"GPU block {b.block_id} owned twice"
            owners[b.block_id] = rid
    in_use = {b.block_id for b in kv.block_pool.blocks[1:] if b.ref_cnt > 0}
    assert in_use == set(owners), "a GPU block is in use but in no table, or the reverse"
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_gpu_blocks - 1 - len(in_use)
    swap = scheduler.swap_space
    cpu_owners: dict[int, str] = {}
    for rid, blocks in swap.req_to_cpu_blocks.items():
        for b in blocks:
            assert b.block_id != 0, "the CPU null block was handed out"
            assert b.block_id not in cpu_owners, f"CPU block {b.block_id} owned twice"
            cpu_owners[b.block_id] = rid
    assert swap.get_num_free_blocks() == swap.block_pool.num_gpu_blocks - 1 - len(cpu_owners)
    swapped = {r.request_id for r in scheduler.swapped}
    assert set(swap.req_to_cpu_blocks) == swapped, "CPU blocks held exactly by swapped requests"
    for request in scheduler.swapped:
        assert request.status == RequestStatus.SWAPPED
        assert request.request_id not in kv.req_to_blocks, "a swapped request kept GPU blocks"
        want = cdiv(request.num_computed_tokens, bs)
        assert swap.num_swapped_blocks(request.request_id) == want


def check_kv(runner, scheduler):
    """Every running request's cached KV is exactly what its tokens and positions give."""
    for request in scheduler.running:
        state = runner.requests[request.request_id]
        n = request.num_computed_tokens
        k, v = runner.cached_kv(state.block_ids, n)
        ek, ev = runner.expected_kv(state.token_ids[:n])
        assert torch.equal(k, ek) and torch.equal(v, ev), f"{request.request_id}: wrong KV"


# ---------------------------------------------------------------------------------------------
# Tasks 1 and 2: the swap space
# ---------------------------------------------------------------------------------------------


def test_swap_out_pairs_each_gpu_block_with_its_own_cpu_block():
    space = lab.SwapSpace(8)
    mapping = space.swap_out("a", [5, 3, 9])
    assert [g for g, _ in mapping] == [5, 3, 9], "pair i must be logical block i"
    cpu = [c for _, c in mapping]
    assert len(set(cpu)) == 3 and 0 not in cpu
    assert space.get_num_free_blocks() == 7 - 3
    assert space.num_swapped_blocks("a") == 3
    back = space.swap_in("a", [11, 12, 13])
    assert back == [(cpu[0], 11), (cpu[1], 12), (cpu[2], 13)]
    assert space.get_num_free_blocks() == 7 and space.num_swapped_blocks("a") == 0


@pytest.mark.parametrize("case", ["twice", "too-big", "in-unknown", "in-wrong-count"])
def test_swap_space_rejects_bad_calls_and_changes_nothing(case):
    space = lab.SwapSpace(6)
    space.swap_out("a", [1, 2])
    with pytest.raises(ValueError):
        if case == "twice":
            space.swap_out("a", [3])
        elif case == "too-big":
            space.swap_out("b", [3, 4, 5, 6])
        elif case == "in-unknown":
            space.swap_in("b", [1])
        else:
            space.swap_in("a", [1, 2, 3])
    assert space.num_swapped_blocks("a") == 2
    assert space.num_swapped_blocks("b") == 0
    assert space.get_num_free_blocks() == 3


# ---------------------------------------------------------------------------------------------
# Tasks 3 and 4: the scheduler's swap mode
# ---------------------------------------------------------------------------------------------


def test_swapped_request_resumes_with_exactly_its_kv():
    """Snapshot the victim's KV and its paged-attention output when it is swapped out; after it
    is swapped back in (into other blocks), both are bit for bit the same."""
    bs = 4
    scheduler = make_scheduler(num_gpu_blocks=16)
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
            assert [g for g, _ in so.blocks_to_swap_out][-cdiv(n, bs):] == old[: cdiv(n, bs)]
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
    assert scheduler.stats.num_swap_preemptions >= 1
    assert scheduler.stats.num_recompute_preemptions == 0
    assert not scheduler.has_unfinished_requests()


def test_swap_preemption_keeps_progress_and_moves_the_right_blocks():
    bs = 4
    scheduler = make_scheduler(num_gpu_blocks=10, max_num_batched_tokens=64)
    requests = make_requests([(12, 8), (12, 8), (12, 8)], bs)
    for request in requests:
        scheduler.add_request(request)
    so = scheduler.schedule()  # 9 blocks: full
    victim_blocks = scheduler.kv_cache_manager.get_block_ids("r2")[0]
    from mini_vllm.scheduler_output import ModelRunnerOutput
    scheduler.update_from_output(so, ModelRunnerOutput(["r0", "r1", "r2"],
                                                      {"r0": 0, "r1": 1, "r2": 2}, [[5], [5], [5]]))
    so = scheduler.schedule()
    assert so.preempted_req_ids == ["r2"]
    victim = requests[2]
    assert victim.status == RequestStatus.SWAPPED
    assert victim.num_computed_tokens == 12, "swapping keeps the computed tokens"
    assert list(scheduler.swapped) == [victim] and len(scheduler.waiting) == 0
    assert [g for g, _ in so.blocks_to_swap_out] == victim_blocks
    assert so.blocks_to_swap_in == []
    assert scheduler.stats.num_blocks_swapped_out == 3
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
            assert all(n.req_id != "late" for n in so.scheduled_new_reqs)
            if any(r.request_id == "late" for r in sch.waiting):
                order.append(("late-waits-behind-swapped", "late", step))

    run_engine(scheduler, runner, {0: early, 3: [late]}, on_step=on_step)
    resumes = [s for kind, _, s in order if kind == "resume"]
    admit_late = [s for kind, rid, s in order if kind == "admit" and rid == "late"]
    assert any(kind == "late-waits-behind-swapped" for kind, _, _ in order)
    assert resumes and admit_late and min(resumes) <= admit_late[0]
    assert scheduler.swap_space.get_num_free_blocks() == 63


def test_full_cpu_pool_falls_back_to_recompute():
    """Swap while the CPU pool has room (3 usable blocks: one victim of 3 blocks), recompute once
    it is full; the pools and the KV stay consistent either way."""
    bs = 4
    scheduler = make_scheduler(num_gpu_blocks=10, num_cpu_blocks=4)
    runner = ToyModelRunner(bs, 10, 4)
    run_engine(scheduler, runner, {0: make_requests([(12, 8)] * 4, bs)},
               on_step=lambda s, so, sch: (check_pools(sch), check_kv(runner, sch)))
    assert scheduler.stats.num_swap_preemptions >= 1
    assert scheduler.stats.num_recompute_preemptions >= 1
    assert scheduler.swap_space.get_num_free_blocks() == 3


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
        assert kv.get_num_free_blocks() == kv.num_gpu_blocks - 1
        if scheduler.swap_space is not None:
            assert scheduler.swap_space.get_num_free_blocks() == 199
    assert results["swap"][0] == results["roomy"][0] == results["recompute"][0]
    swap_stats, rec_stats = results["swap"][1], results["recompute"][1]
    assert results["roomy"][1].num_preemptions == 0
    assert swap_stats.num_recomputed_tokens == 0
    assert swap_stats.num_blocks_swapped_out == swap_stats.num_blocks_swapped_in
    if rec_stats.num_preemptions:
        assert rec_stats.num_recomputed_tokens > 0


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
    assert stats["recompute"].num_preemptions > 0 and stats["swap"].num_preemptions > 0
    assert stats["recompute"].num_recomputed_tokens > 0
    assert stats["recompute"].num_blocks_swapped_out == 0
    assert stats["swap"].num_recomputed_tokens == 0
    assert stats["swap"].num_blocks_swapped_in == stats["swap"].num_blocks_swapped_out > 0
