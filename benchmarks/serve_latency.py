"""What the HTTP server costs: time to first token and time per output token through
``python -m mini_vllm serve`` and the ``openai`` client, against the same engine in process.

Three ways to run the same requests (greedy, ``--max-tokens`` tokens each, EOS ignored), one
request at a time (the next one sent when the last has finished), so that the figures are the
engine's latency and the path's own cost, not queueing: ``LLM.generate`` runs one request per
call, and any overlap would batch the other paths' requests (slower steps, a prefill delayed
behind a decode) and charge that to them. ``--rate R`` sends them instead as Poisson arrivals
(seeded), which do overlap unless ``R`` times a request's duration is well below 1:

* **LLM.generate**: the in-process engine, one request per call (TTFT and per-token times from
  the request's own timestamps: arrival, first token, finish);
* **AsyncLLM**: the server's engine, streaming, no HTTP: its engine core in a process of its
  own (the default), and ``(one process)``: on a thread of this one (``multiprocessing=False``);
* **HTTP server**: ``python -m mini_vllm serve`` in a subprocess on 127.0.0.1, the official
  ``openai`` client streaming (TTFT: request sent to first text chunk; per-token: first to last
  chunk over the tokens between them); ``(one process)``: the same server with
  ``MINI_VLLM_ENABLE_MULTIPROCESSING=0``, its engine core on a thread of the server's process,
  taking turns with the server's Python on one GIL.

Correctness first: each path's text must equal ``LLM.generate``'s for every prompt. Times are
medians (and 90th percentiles) over the requests, in milliseconds. The issue's target (the server
adds at most 10% to TTFT and to per-token time over the in-process engine) is reported, never
asserted: on a shared 2-core machine the figures move with the load, which is recorded (the
one-minute load average before and after).

To say where the server's extra time goes, the HTTP row also records the engine's own view from
the server's ``/metrics`` (mean time from a request's arrival in ``AsyncLLM`` to its first token,
and between tokens) and the median round trip of a bare ``GET /health``: client-observed TTFT
minus the engine's TTFT is transport (connection, request parsing, the client's own work).

    python benchmarks/serve_latency.py
    python benchmarks/serve_latency.py --json benchmarks/results/serve_latency.json
    python benchmarks/serve_latency.py --model smollm2 --json \
        benchmarks/results/serve_latency_smollm2.json    # a real model: SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.engine.async_llm import AsyncLLM  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

SEQUENTIAL_PAUSE_S = 0.05  # between one request's end and the next one's start, with --rate 0
PROMPTS = ["ROMEO.\n", "JULIET.\n", "HAMLET.\n", "KING.\n", "QUEEN.\n", "FOOL.\n",
           "FIRST CITIZEN.\n", "OPHELIA.\n"]


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {"median_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3)}


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_generate(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    ttft, tpot, texts = [], [], []
    for prompt in prompts:
        # The pause the streamed paths make between requests: a step after an idle pause is
        # slower (the shipped model's first step, 0.85 -> 1.5 ms after 50 ms idle), and a
        # baseline run back to back would charge that to the other paths.
        time.sleep(SEQUENTIAL_PAUSE_S)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m, n = out.metrics, len(out.outputs[0].token_ids)
        ttft.append(m["first_token_time"] - m["arrival_time"])
        tpot.append((m["finished_time"] - m["first_token_time"]) / (n - 1))
        texts.append(out.text)
    return {"ttft": ttft, "tpot": tpot, "texts": texts}


async def _timed_stream(chunks) -> tuple[float, float, str, int]:
    """(first chunk time, last chunk time, text, pieces) of an async stream of text pieces."""
    first = last = 0.0
    text, pieces = "", 0
    async for piece in chunks:
        if not piece:
            continue
        last = time.perf_counter()
        first = first or last
        text += piece
        pieces += 1
    return first, last, text, pieces


async def run_timed(prompts: list[str], times: list[float] | None, stream_of,
                    max_tokens: int) -> dict:
    """Send prompt ``i`` at ``times[i]`` seconds, or, with ``times`` None, each prompt once the
    one before has finished (after a short pause); ``stream_of(prompt)`` yields text pieces."""
    start = time.perf_counter()
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        if times is not None:
            await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        sent = time.perf_counter()
        first, last, text, _ = await _timed_stream(stream_of(prompts[i]))
        results[i] = (first - sent, (last - first) / (max_tokens - 1), text)

    if times is None:
        for i in range(len(prompts)):
            await one(i)
            await asyncio.sleep(SEQUENTIAL_PAUSE_S)
    else:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return {"ttft": [r[0] for r in results], "tpot": [r[1] for r in results],
            "texts": [r[2] for r in results]}


def server_histograms(port: int) -> dict[str, float]:
    """The sums and counts of the server's latency histograms (from /metrics)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_server_path(prompts, times, params, max_tokens: int, model: str | None,
                          threads: int, multiprocessing: bool) -> dict:
    import httpx
    import openai

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "MINI_VLLM_ENABLE_MULTIPROCESSING": "1" if multiprocessing else "0"}
    served = "mini_vllm/tiny_shakespeare" if model is None else model
    extra = [] if model is None else ["--model", model]
    proc = subprocess.Popen([sys.executable, "-m", "mini_vllm", "serve", "--port", str(port),
                             "--log-level", "warning", "--threads", str(threads), *extra],
                            env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0, timeout=120)

        async def stream_of(prompt: str):
            stream = await client.completions.create(
                model=served, prompt=prompt, stream=True,
                temperature=0.0, max_tokens=max_tokens, extra_body={"ignore_eos": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    yield choice.text

        await _timed_stream(stream_of(prompts[0]))  # warm-up
        before = server_histograms(port)
        result = await run_timed(prompts, times, stream_of, max_tokens)
        after = server_histograms(port)
        await client.close()
        # Where the time goes: the engine's own view (arrival to first token, token to token,
        # as /metrics reports them) and a bare HTTP round trip (GET /health).
        result["server_side_mean_ms"] = {
            name: round(1e3 * (after[name + "_sum"] - before[name + "_sum"])
                        / max(1.0, after[name + "_count"] - before[name + "_count"]), 3)
            for name in ("vllm:time_to_first_token_seconds",
                         "vllm:inter_token_latency_seconds")}
        rtts = []
        # One client kept open, as the openai client keeps its connection: a new httpx client
        # per request would time its own construction (about 35 ms, its TLS context) instead.
        with httpx.Client(timeout=10) as health:
            for _ in range(20):
                t0 = time.perf_counter()
                health.get(f"http://127.0.0.1:{port}/health")
                rtts.append(time.perf_counter() - t0)
        result["health_round_trip"] = summary(rtts)
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def run_async_path(llm: LLM, prompts, times, params, max_tokens: int,
                         multiprocessing: bool) -> dict:
    engine = AsyncLLM(llm, multiprocessing=multiprocessing)

    async def stream_of(prompt: str):
        async for out in engine.generate(prompt, params):
            yield out.outputs[0].text if out.outputs else ""

    await _timed_stream(stream_of(prompts[0]))  # warm-up
    try:
        return await run_timed(prompts, times, stream_of, max_tokens)
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="Poisson arrivals, requests per second; 0 (the default): one "
                             "request at a time, as LLM.generate runs them")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None,
                        help="as `mini_vllm serve --model` (default: the shipped model)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    times = arrivals(args.requests, args.rate, args.seed) if args.rate > 0 else None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    load_before = os.getloadavg()

    llm = LLM(args.model)  # the server runs with the same number of threads
    run_generate(llm, prompts[:2], params)  # warm-up
    paths = {"LLM.generate": run_generate(llm, prompts, params)}
    for multiprocessing, suffix in ((False, " (one process)"), (True, "")):
        paths["AsyncLLM" + suffix] = asyncio.run(run_async_path(
            llm, prompts, times, params, args.max_tokens, multiprocessing))
    for multiprocessing, suffix in ((False, " (one process)"), (True, "")):
        paths["HTTP server" + suffix] = asyncio.run(run_server_path(
            prompts, times, params, args.max_tokens, args.model, llm.num_threads,
            multiprocessing))

    want = paths["LLM.generate"]["texts"]
    for name, got in paths.items():
        if got["texts"] != want:
            bad = next(i for i, (a, b) in enumerate(zip(got["texts"], want)) if a != b)
            raise SystemExit(f"correctness check failed: {name} answered prompt {bad} with "
                             f"{got['texts'][bad]!r}, LLM.generate with {want[bad]!r}")

    base = {k: summary(paths["LLM.generate"][k]) for k in ("ttft", "tpot")}
    rows = []
    print(f"{'path':<28}{'TTFT median':>13}{'p90':>9}{'per token':>11}{'p90':>9}"
          f"{'TTFT +%':>9}{'token +%':>10}   (ms)")
    for name, got in paths.items():
        ttft, tpot = summary(got["ttft"]), summary(got["tpot"])
        over_ttft = 100 * (ttft["median_ms"] / base["ttft"]["median_ms"] - 1)
        over_tpot = 100 * (tpot["median_ms"] / base["tpot"]["median_ms"] - 1)
        rows.append({"path": name, "ttft": ttft, "time_per_output_token": tpot,
                     "ttft_overhead_pct": round(over_ttft, 1),
                     "per_token_overhead_pct": round(over_tpot, 1)})
        print(f"{name:<28}{ttft['median_ms']:>13.2f}{ttft['p90_ms']:>9.2f}"
              f"{tpot['median_ms']:>11.2f}{tpot['p90_ms']:>9.2f}{over_ttft:>8.1f}%"
              f"{over_tpot:>9.1f}%")
    for row in rows:
        if row["path"].startswith("HTTP server"):
            http = paths[row["path"]]
            row["server_side_mean_ms"] = http["server_side_mean_ms"]
            row["health_round_trip"] = http["health_round_trip"]
            print(f"inside {row['path']} (its /metrics, mean): TTFT "
                  f"{http['server_side_mean_ms']['vllm:time_to_first_token_seconds']:.2f} ms, "
                  f"inter-token "
                  f"{http['server_side_mean_ms']['vllm:inter_token_latency_seconds']:.2f} ms; "
                  f"GET /health round trip median {http['health_round_trip']['median_ms']:.2f} "
                  "ms")
    server = rows[-1]
    target = {"ttft_within_10pct": server["ttft_overhead_pct"] <= 10,
              "per_token_within_10pct": server["per_token_overhead_pct"] <= 10}
    print(f"target (server within 10% of LLM.generate): TTFT {target['ttft_within_10pct']}, "
          f"per token {target['per_token_within_10pct']}")
    env = {**environment(), "loadavg_before": [round(x, 2) for x in load_before],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    write_result(args.json, "serve_latency.py", env, {
        "benchmark": "serve_latency",
        "config": {"requests": args.requests, "rate_per_s": args.rate,
                   "max_tokens": args.max_tokens, "seed": args.seed,
                   "model": args.model or "shipped tiny_shakespeare", "threads": llm.num_threads,
                   "ignore_eos": True, "greedy": True},
        "paths": rows,
        "target": target,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
