"""The load generator (mini_vllm/benchmarks): seeded ShareGPT-shaped traces, arrivals, the
metrics on hand-made results with known answers, and one short real run through AsyncLLM.
No timing is asserted: only what the numbers must be given the timestamps."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from mini_vllm.benchmarks.datasets import (
    SHAREGPT_INPUT,
    SHAREGPT_OUTPUT,
    SampleRequest,
    sharegpt_like_requests,
)
from mini_vllm.benchmarks.serve import (
    RequestResult,
    arrival_times,
    calculate_metrics,
    run_in_process,
    run_trace,
    sustained_rate,
)


def test_traces_are_seeded_bounded_and_shaped_like_sharegpt():
    a = sharegpt_like_requests(3000, seed=1, scale=1.0, max_model_len=100_000)
    assert a == sharegpt_like_requests(3000, seed=1, scale=1.0, max_model_len=100_000)
    assert a != sharegpt_like_requests(3000, seed=2, scale=1.0, max_model_len=100_000)
    # The paper's ShareGPT means (about 161 in, 338 out); 3000 draws of a log-normal with
    # sigma <= 1 put the sample mean within a few percent of them.
    mean_in = statistics.fmean(r.prompt_len for r in a)
    mean_out = statistics.fmean(r.output_len for r in a)
    assert 150 < mean_in < 172 and 320 < mean_out < 356, (mean_in, mean_out)
    assert statistics.median(r.prompt_len for r in a) == pytest.approx(SHAREGPT_INPUT[0], rel=0.1)
    assert statistics.median(r.output_len for r in a) == pytest.approx(SHAREGPT_OUTPUT[0],
                                                                       rel=0.1)
    small = sharegpt_like_requests(500, seed=1, scale=0.125, max_model_len=64)
    assert all(1 <= r.prompt_len <= 32 and r.output_len >= 1
               and r.prompt_len + r.output_len <= 64 for r in small)
    assert all(32 <= t < 127 for r in small for t in r.prompt_token_ids)


def test_arrivals_poisson_burst_and_gamma():
    times = arrival_times(4000, 5.0, seed=3)
    assert times == sorted(times) and times == arrival_times(4000, 5.0, seed=3)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)
    assert arrival_times(5, math.inf) == [0.0] * 5
    bursty = [b - a for a, b in zip([0.0, *arrival_times(4000, 5.0, burstiness=0.25)],
                                    arrival_times(4000, 5.0, burstiness=0.25))]
    assert statistics.fmean(bursty) == pytest.approx(0.2, rel=0.1)
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)
    with pytest.raises(ValueError, match="rate and burstiness must be > 0"):
        arrival_times(3, 0.0)


def make_result(sent, chunks, prompt_len=10, error=None):
    return RequestResult(prompt_len, sum(n for _, n in chunks), sent, list(chunks), error)


def test_metrics_from_known_timestamps():
    # r0: sent at 0, tokens at 1 (one), 2 (two), 4 (one): TTFT 1, e2el 4, TPOT 3/3, ITLs 1, 2.
    # r1: sent at 1, one token at 3: TTFT 2, e2el 2, TPOT 0 (one token).
    # r2 failed: it counts in "failed" and nowhere else.
    results = [make_result(0.0, [(1.0, 1), (2.0, 2), (4.0, 1)]),
               make_result(1.0, [(3.0, 1)], prompt_len=6),
               make_result(2.0, [], error="boom")]
    m = calculate_metrics(results, duration=5.0, goodput={"ttft": 1.5})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 16 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(0.4)
    assert m["output_throughput"] == pytest.approx(1.0)
    assert m["total_token_throughput"] == pytest.approx(21 / 5)
    assert m["ttft"]["mean"] == pytest.approx(1.5) and m["ttft"]["p99"] == pytest.approx(2.0)
    assert m["tpot"]["mean"] == pytest.approx(0.5)
    assert m["itl"]["mean"] == pytest.approx(1.5) and m["itl"]["p90"] == pytest.approx(2.0)
    assert m["e2el"]["median"] == pytest.approx(3.0)
    # Normalised latency: mean of e2el / tokens = (4/4 + 2/1) / 2.
    assert m["normalized_latency"] == pytest.approx(1.5)
    # Goodput: only r0 meets TTFT <= 1.5 s -> 1 request in 5 s.
    assert m["request_goodput"] == pytest.approx(0.2)
    assert calculate_metrics(results, 5.0)["request_goodput"] is None
    # r0 misses the TPOT limit, r1 the end-to-end one.
    assert calculate_metrics(results, 5.0, {"tpot": 0.5, "e2el": 1.5})["request_goodput"] == 0.0
    with pytest.raises(ValueError, match="unknown SLO"):
        calculate_metrics(results, 5.0, {"latency": 1.0})


def test_run_trace_is_an_open_loop_and_flags_short_streams():
    requests = [SampleRequest((65,), 2), SampleRequest((66,), 3)]

    async def stream(request):
        yield 1
        await asyncio.sleep(0)
        yield 1  # the second request asked for 3 and gets 2

    results, duration = asyncio.run(run_trace(requests, [0.0, 0.0], stream))
    assert duration > 0
    assert [r.num_output_tokens for r in results] == [2, 2]
    assert results[0].error is None
    assert results[1].error == "got 2 tokens, asked for 3"


def test_a_short_real_run_through_async_llm():
    from mini_vllm.async_llm import AsyncLLM
    from mini_vllm.llm import LLM

    requests = sharegpt_like_requests(4, seed=0, scale=0.03, max_model_len=64)
    llm = LLM(max_model_len=64, num_gpu_blocks=17, block_size=4, enable_prefix_caching=False,
              kv_reservation="oracle")
    engine = AsyncLLM(llm)
    try:
        results, duration = asyncio.run(run_in_process(engine, requests, [0.0] * 4))
    finally:
        engine.shutdown()
    assert [r.error for r in results] == [None] * 4
    assert [r.num_output_tokens for r in results] == [r.output_len for r in requests]
    m = calculate_metrics(results, duration)
    assert m["completed"] == 4
    assert m["total_output_tokens"] == sum(r.output_len for r in requests)
    assert llm.engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16


def test_sustained_rate_interpolates_the_first_crossing():
    points = [{"rate": 1, "normalized_latency": 0.02}, {"rate": 2, "normalized_latency": 0.03},
              {"rate": 4, "normalized_latency": 0.07}, {"rate": 8, "normalized_latency": 0.01}]
    # 0.04 lies a quarter of the way from 0.03 (rate 2) to 0.07 (rate 4).
    assert sustained_rate(points, 0.04) == pytest.approx(2.5)
    assert sustained_rate(points, 0.03) == pytest.approx(2.0)
    assert sustained_rate(points[:2], 0.5) == 2  # never reached: the highest rate measured
    assert sustained_rate(points, 0.01) is None
    assert sustained_rate([], 0.04) is None
