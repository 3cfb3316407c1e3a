"""The load generator (mini_vllm/benchmarks) beyond what lab 03-06's tests cover (arrivals,
metrics, sustained rate): seeded ShareGPT-shaped traces, the open loop, and one short real run
through AsyncLLM. No timing is asserted."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from mini_vllm.benchmarks.datasets import (
    SHAREGPT_INPUT,
    SHAREGPT_OUTPUT,
    SampleRequest,
    sharegpt_like_requests,
)
from mini_vllm.benchmarks.serve import (
    calculate_metrics,
    run_in_process,
    run_trace,
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
    from mini_vllm.engine.async_llm import AsyncLLM
    from mini_vllm.entrypoints.llm import LLM

    requests = sharegpt_like_requests(4, seed=0, scale=0.03, max_model_len=64)
    llm = LLM(max_model_len=64, num_gpu_blocks=17, block_size=4, enable_prefix_caching=False,
              kv_reservation="oracle")
    engine = AsyncLLM(llm, multiprocessing=False)
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
