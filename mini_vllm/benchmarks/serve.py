"""A load generator in the spirit of ``vllm bench serve``: requests arrive over time, the server
streams, and we measure what each client saw.

How a run goes:

1. a trace of requests (:func:`~mini_vllm.benchmarks.datasets.sharegpt_like_requests`) and their
   send times (:func:`arrival_times`: a Poisson process at ``rate`` requests per second, a
   gamma process with the same mean when ``burstiness`` is not 1, or everything at once, the
   burst, when ``rate`` is infinite);
2. every request is sent at its time, without waiting for the others (an open loop: a slow
   server makes the queue grow, it does not slow the clients down), greedy, ``ignore_eos`` so
   that each runs to exactly its ``output_len``;
3. each streamed chunk is timestamped on arrival; from those, per request: TTFT (sent to first
   token), TPOT (mean time per output token after the first), ITL (every gap between chunks),
   end-to-end latency, and the normalised latency of the PagedAttention paper (end-to-end
   latency over output tokens).

Two backends run the same trace: ``inprocess`` drives an
:class:`~mini_vllm.engine.async_llm.AsyncLLM` in this process (no HTTP), ``http`` streams from
``python -m mini_vllm serve``'s ``/v1/completions`` (server-sent events), so the difference between
the two is the server's.

Metrics (:func:`calculate_metrics`): request throughput, output and total token throughput,
mean/median/percentiles of each latency, and goodput: completed requests per second that met
every SLO given (e.g. ``{"ttft": 0.5, "tpot": 0.05}`` in seconds), as upstream's ``--goodput``.

    python -m mini_vllm.benchmarks.serve --rate 4 --num-requests 100
    python -m mini_vllm.benchmarks.serve --backend http --base-url http://127.0.0.1:8000 --rate 4
    python -m mini_vllm.benchmarks.serve --rate inf --kv-reservation max --json /tmp/r.json

upstream: none (course-only; upstream's vllm/benchmarks/serve.py, run as ``vllm bench serve``,
has the same arrivals, metrics and goodput, over aiohttp and real datasets)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from mini_vllm.benchmarks.datasets import SampleRequest, sharegpt_like_requests

__all__ = [
    "RequestResult",
    "arrival_times",
    "calculate_metrics",
    "format_metrics",
    "main",
    "nearest_rank",
    "run_http",
    "run_in_process",
    "run_trace",
    "sustained_rate",
]

SLO_NAMES = ("ttft", "tpot", "e2el")


def arrival_times(
    num_requests: int, rate: float, *, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times (seconds from the start, non-decreasing) of ``num_requests`` requests.

    The gaps are independent, with mean ``1 / rate``: exponential when ``burstiness == 1`` (a
    Poisson process), gamma with shape ``burstiness`` otherwise (below 1: burstier, above:
    more regular). ``rate == inf`` sends everything at time 0 (the burst mode). ``ValueError``
    for ``rate <= 0`` or ``burstiness <= 0``.

    upstream: vllm/benchmarks/serve.py:142 @ v0.11.0
    """
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"arrival_times: rate and burstiness must be > 0, got {rate}, "
                         f"{burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


@dataclass
class RequestResult:
    """What one client saw: when it sent, and when each chunk of tokens arrived.

    ``chunks`` holds ``(time, number of tokens)`` per streamed chunk, times in seconds on the
    run's clock (``time.perf_counter``). ``error`` is set when the request failed.

    upstream: none (as RequestFuncOutput in vllm/benchmarks/lib/endpoint_request_func.py)
    """

    prompt_len: int
    output_len: int
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunks[-1][0] - self.sent

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for a one-token output)."""
        n = self.num_output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else 0.0

    @property
    def itls(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]


StreamFn = Callable[[SampleRequest], AsyncIterator[int]]


async def run_trace(requests: Sequence[SampleRequest], times: Sequence[float],
                    stream: StreamFn) -> tuple[list[RequestResult], float]:
    """Send request ``i`` at ``times[i]`` (open loop); ``stream(request)`` yields the number of
    tokens in each chunk as it arrives. Returns the results (in trace order) and the run's
    duration (first send to last token).

    upstream: none (the benchmark() loop of vllm/benchmarks/serve.py)
    """
    start = time.perf_counter()
    results = [RequestResult(r.prompt_len, r.output_len, 0.0) for r in requests]

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        result = results[i]
        result.sent = time.perf_counter()
        try:
            async for num_tokens in stream(requests[i]):
                if num_tokens:
                    result.chunks.append((time.perf_counter(), num_tokens))
        except Exception as exc:  # a failed request is counted, not fatal
            result.error = f"{type(exc).__name__}: {exc}"
        if result.error is None and result.num_output_tokens != result.output_len:
            result.error = (f"got {result.num_output_tokens} tokens, asked for "
                            f"{result.output_len}")

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results, time.perf_counter() - start


def _params(request: SampleRequest) -> Any:
    from mini_vllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)


async def run_in_process(engine: Any, requests: Sequence[SampleRequest],
                         times: Sequence[float]) -> tuple[list[RequestResult], float]:
    """:func:`run_trace` against an :class:`~mini_vllm.engine.async_llm.AsyncLLM` in this process.

    upstream: none (upstream's benchmark always goes through a server)
    """

    async def stream(request: SampleRequest) -> AsyncIterator[int]:
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        async for out in engine.generate(prompt, _params(request)):
            yield sum(len(c.token_ids) for c in out.outputs)

    return await run_trace(requests, times, stream)


async def run_http(base_url: str, model: str, requests: Sequence[SampleRequest],
                   times: Sequence[float]) -> tuple[list[RequestResult], float]:
    """:func:`run_trace` against an OpenAI-compatible server's streaming ``/v1/completions``
    (``base_url`` like ``http://127.0.0.1:8000``); tokens are counted from each chunk's
    ``token_ids`` (vLLM's ``return_token_ids``).

    upstream: none (as async_request_openai_completions in
    vllm/benchmarks/lib/endpoint_request_func.py)
    """
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:

        async def stream(request: SampleRequest) -> AsyncIterator[int]:
            body = {"model": model, "prompt": list(request.prompt_token_ids), "stream": True,
                    "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:200]
                    raise RuntimeError(f"HTTP {response.status_code}: {detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    yield sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))

        return await run_trace(requests, times, stream)


def nearest_rank(p: float, n: int) -> int:
    """Which of ``n`` sorted values (1 = the smallest) is their ``p``-th percentile, nearest
    rank: the smallest value with at least p% of the values at or below it, so the rank is
    ``ceil(p * n / 100)``, and 1 for ``p = 0``.

    Exact, in integers: ``p`` is read as the decimal it prints as (``99.9`` is 999/10), never
    through a float product, which rounds up across a boundary: p28 of 25 values is the 7th
    (28 * 25 / 100 = 7 exactly), where ``ceil(28 / 100 * 25)`` gives 8. ``ValueError`` for
    ``p`` outside [0, 100] or ``n < 1``.

    upstream: none (upstream's percentiles interpolate, with numpy.percentile)
    """
    if n < 1:
        raise ValueError(f"nearest_rank: need at least one value, got n={n}")
    if not 0 <= p <= 100:
        raise ValueError(f"nearest_rank: percentile {p} is outside [0, 100]")
    share = Fraction(str(p))  # p = a / b exactly: ceil(a * n / (100 * b)) in integers
    a, b = share.numerator, 100 * share.denominator
    return max(1, (a * n + b - 1) // b)


def _stats(values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered), "median": statistics.median(ordered)}
    for p in percentiles:
        out[f"p{p:g}"] = ordered[nearest_rank(p, len(ordered)) - 1]
    return out


def calculate_metrics(results: Sequence[RequestResult], duration: float,
                      goodput: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (90, 99)) -> dict[str, Any]:
    """The run's metrics over the completed requests (those without ``error``).

    Throughputs are per second of ``duration``; latencies in seconds. ``goodput`` maps SLO names
    (``ttft``, ``tpot``, ``e2el``) to limits in seconds; a request is good when it completed and
    meets every one. ``normalized_latency`` is the mean over requests of end-to-end latency per
    output token (the PagedAttention paper's y-axis). Percentiles are nearest-rank
    (:func:`nearest_rank`). ``ValueError`` for an unknown SLO name, ``duration <= 0`` or a
    percentile outside [0, 100].

    upstream: vllm/benchmarks/serve.py:271 @ v0.11.0
    """
    if duration <= 0:
        raise ValueError(f"calculate_metrics: duration must be > 0, got {duration}")
    unknown = set(goodput or {}) - set(SLO_NAMES)
    if unknown:
        raise ValueError(f"calculate_metrics: unknown SLO {sorted(unknown)}; use {SLO_NAMES}")
    done = [r for r in results if r.error is None]
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = [r for r in done
            if all(getattr(r, name) <= limit for name, limit in (goodput or {}).items())]
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_goodput": len(good) / duration if goodput else None,
        "normalized_latency": (statistics.fmean(r.e2el / r.num_output_tokens for r in done)
                               if done else None),
    }
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", [r.tpot for r in done]),
                         ("itl", [x for r in done for x in r.itls]),
                         ("e2el", [r.e2el for r in done])):
        metrics[name] = _stats(values, percentiles)
    return metrics


def sustained_rate(points: Sequence[dict[str, float]], threshold: float) -> float | None:
    """The request rate a setting sustains at ``threshold`` normalised latency (s/token).

    ``points`` are ``{"rate", "normalized_latency"}`` in increasing rate. The answer is where
    the curve first reaches ``threshold``, linear between the two measured rates around it; the
    highest rate when it never does (a lower bound); ``None`` when even the first point is at
    or above it (nothing sustained).

    upstream: none (the comparison the PagedAttention paper's Figure 12 makes by eye)
    """
    previous = None
    for point in points:
        if point["normalized_latency"] >= threshold:
            if previous is None:
                return None
            r0, l0 = previous["rate"], previous["normalized_latency"]
            r1, l1 = point["rate"], point["normalized_latency"]
            return r0 + (threshold - l0) * (r1 - r0) / (l1 - l0)
        previous = point
    return previous["rate"] if previous else None


def format_metrics(m: dict[str, Any]) -> str:
    """The metrics as a short table (milliseconds for latencies).

    upstream: none (the summary that vllm/benchmarks/serve.py prints)
    """
    lines = [f"{'completed / failed':<34}{m['completed']} / {m['failed']}",
             f"{'duration (s)':<34}{m['duration_s']:.2f}",
             f"{'request throughput (req/s)':<34}{m['request_throughput']:.3f}",
             f"{'output token throughput (tok/s)':<34}{m['output_throughput']:.1f}",
             f"{'total token throughput (tok/s)':<34}{m['total_token_throughput']:.1f}"]
    if m["request_goodput"] is not None:
        lines.append(f"{'request goodput (req/s)':<34}{m['request_goodput']:.3f}")
    if m["normalized_latency"] is not None:
        lines.append(f"{'normalized latency (s/token)':<34}{m['normalized_latency']:.4f}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = m[name]
        if stats:
            cells = "  ".join(f"{k} {1e3 * v:.1f}" for k, v in stats.items())
            lines.append(f"{name.upper() + ' (ms)':<34}{cells}")
    return "\n".join(lines)


def _parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        if name not in SLO_NAMES or not value:
            raise SystemExit(f"--goodput {pair!r}: write NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_NAMES)} (e.g. ttft:500)")
        out[name] = float(value) / 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mini_vllm.benchmarks.serve``: one run, a table, and ``--json`` results.

    upstream: none (as main in vllm/benchmarks/serve.py)
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--backend", choices=("inprocess", "http"), default="inprocess")
    add("--base-url", default="http://127.0.0.1:8000", help="with --backend http")
    add("--model", default="mini_vllm/tiny_shakespeare", help="the served model's name (http)")
    add("--num-requests", type=int, default=100)
    add("--rate", type=float, default=float("inf"),
        help="requests per second; inf (default) sends all at once")
    add("--burstiness", type=float, default=1.0, help="1: Poisson; <1 burstier; >1 steadier")
    add("--seed", type=int, default=0)
    add("--scale", type=float, default=0.25, help="ShareGPT lengths times this")
    add("--max-model-len", type=int, default=512)
    add("--goodput", nargs="*", default=[], metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50")
    add("--num-gpu-blocks", type=int, default=None, help="inprocess: the KV budget in blocks")
    add("--block-size", type=int, default=16, help="inprocess: tokens per KV block")
    add("--kv-reservation", choices=("paged", "max", "pow2", "oracle"), default="paged")
    add("--static-batching", action="store_true")
    add("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    requests = sharegpt_like_requests(args.num_requests, seed=args.seed, scale=args.scale,
                                      max_model_len=args.max_model_len)
    times = arrival_times(args.num_requests, args.rate, burstiness=args.burstiness,
                          seed=args.seed)
    goodput = _parse_goodput(args.goodput)
    load_before = os.getloadavg()
    if args.backend == "http":
        results, duration = asyncio.run(run_http(args.base_url, args.model, requests, times))
    else:
        from mini_vllm.engine.async_llm import AsyncLLM
        from mini_vllm.entrypoints.llm import LLM

        llm = LLM(max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
                  block_size=args.block_size,
                  kv_reservation=args.kv_reservation, static_batching=args.static_batching,
                  enable_prefix_caching=False)
        engine = AsyncLLM(llm)
        try:
            results, duration = asyncio.run(run_in_process(engine, requests, times))
        finally:
            engine.shutdown()
    metrics = calculate_metrics(results, duration, goodput)
    print(format_metrics(metrics))
    failed = [r.error for r in results if r.error]
    if failed:
        print(f"{len(failed)} request(s) failed; the first: {failed[0]}")
    if args.json:
        record = {
            "command": shlex.join(["python", "-m", "mini_vllm.benchmarks.serve",
                                   *(sys.argv[1:] if argv is None else argv)]),
            # Strict JSON has no infinity: the burst rate is written "inf".
            "config": {k: (str(v) if isinstance(v, Path) or v == float("inf") else v)
                       for k, v in vars(args).items()},
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "metrics": metrics,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
