"""Disaggregated prefill against one engine doing both: what long prompts do to the decodes.

The trace (lab 03-06's load generator, :mod:`mini_vllm.benchmarks.serve`: Poisson arrivals at
``--rate``, greedy, EOS ignored) mixes ``--num-chat`` chat requests (short prompts, long
answers) with ``--num-long`` long-prompt requests (a ``--long-len``-token prompt, a few tokens
out), shuffled. One engine schedules a long prompt's prefill into the same step as every running
decode (chunked prefill under a ``--budget``-token budget), so each chat stream stalls for that
step; a prefill engine and a decode engine (:class:`~mini_vllm.entrypoints.disagg.
DisaggregatedLLM`, engine cores in processes of their own, the prompt's KV moved by the KV
connector over shared memory or TCP) keep the long prefills out of the decode engine's steps.

Reported per setting: the chat requests' time to first token and inter-token latency (median,
p90, p99, max: the stalls are in the tail), the long requests' TTFT, and request throughput.
Every engine gets the machine's cores between them: the single engine ``--threads`` torch
threads, each engine of the pair half as many (at least one).

    python benchmarks/disaggregated_prefill.py --json benchmarks/results/disaggregated_prefill.json
    python benchmarks/disaggregated_prefill.py --model smollm2 --num-chat 16 --chat-out 32 \
        --num-long 6 --rate 1 --json benchmarks/results/disaggregated_prefill_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.benchmarks.datasets import SampleRequest  # noqa: E402
from mini_vllm.benchmarks.serve import arrival_times, calculate_metrics, run_in_process  # noqa: E402
from mini_vllm.engine.async_llm import AsyncLLM  # noqa: E402
from mini_vllm.entrypoints.disagg import DisaggregatedLLM  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402


def trace(args: argparse.Namespace) -> list[tuple[str, SampleRequest]]:
    rng = random.Random(args.seed)
    printable = range(32, 127)

    def request(prompt_len: int, output_len: int) -> SampleRequest:
        return SampleRequest(tuple(rng.choices(printable, k=prompt_len)), output_len)

    mix = ([("chat", request(rng.randint(16, 48), args.chat_out)) for _ in range(args.num_chat)]
           + [("long", request(args.long_len, args.long_out)) for _ in range(args.num_long)])
    rng.shuffle(mix)
    return mix


def summary(kinds: list[str], results: list, duration: float) -> dict:
    out = {"request_throughput": calculate_metrics(results, duration)["request_throughput"]}
    for kind in ("chat", "long"):
        picked = [r for k, r in zip(kinds, results) if k == kind]
        m = calculate_metrics(picked, duration, percentiles=(90, 99))
        out[kind] = {"completed": m["completed"], "failed": m["failed"],
                     "ttft_ms": {k: v * 1e3 for k, v in m["ttft"].items()}}
        if kind == "chat":
            itls = sorted(x for r in picked for x in r.itls)
            out[kind]["itl_ms"] = {**{k: v * 1e3 for k, v in m["itl"].items()},
                                   "max": itls[-1] * 1e3 if itls else None}
    return out


async def drive(engine, mix, times) -> tuple[list, float]:
    return await run_in_process(engine, [r for _, r in mix], times)


def run(name: str, make, mix, times) -> dict:
    engine = make()
    try:
        asyncio.run(drive(engine, mix[:2], [0.0, 0.0]))  # warm up both paths
        results, duration = asyncio.run(drive(engine, mix, times))
    finally:
        engine.shutdown()
    row = summary([k for k, _ in mix], results, duration)
    chat, long = row["chat"], row["long"]
    print(f"{name:<26} chat TTFT p50 {chat['ttft_ms']['median']:7.1f} ms  ITL p50 "
          f"{chat['itl_ms']['median']:6.1f} p99 {chat['itl_ms']['p99']:7.1f} max "
          f"{chat['itl_ms']['max']:7.1f} ms | long TTFT p50 {long['ttft_ms']['median']:7.1f} ms"
          f" | {row['request_throughput']:.2f} req/s | failed "
          f"{chat['failed'] + long['failed']}")
    return {"setting": name, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-chat", type=int, default=32)
    parser.add_argument("--chat-out", type=int, default=48)
    parser.add_argument("--num-long", type=int, default=10)
    parser.add_argument("--long-len", type=int, default=400)
    parser.add_argument("--long-out", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="LLM's model (default: the shipped one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    mix = trace(args)
    times = arrival_times(len(mix), args.rate, seed=args.seed)
    knobs = dict(model=args.model, num_gpu_blocks=1024, max_num_batched_tokens=args.budget)
    half = max(1, args.threads // 2)
    rows = [run("one engine", lambda: AsyncLLM(LLM(**knobs, num_threads=args.threads),
                                                multiprocessing=True), mix, times)]
    for transport in ("shm", "tcp"):
        rows.append(run(f"prefill + decode ({transport})",
                        lambda t=transport: DisaggregatedLLM(kv_transport=t, num_threads=half,
                                                             **knobs), mix, times))
    write_result(args.json, "disaggregated_prefill.py", environment(), {
        "workload": {k: getattr(args, k) for k in
                     ("num_chat", "chat_out", "num_long", "long_len", "long_out", "rate",
                      "budget", "threads", "seed")},
        "model": args.model or "shipped tiny_shakespeare",
        "results": rows}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
