"""PagedAttention's headline on this machine: normalised latency against request rate, under a KV
budget small enough that memory is the bottleneck, for paged memory and for Orca-style
reservation on the same engine.

One curve per engine setting (all continuous batching unless named otherwise):

* ``paged``: mini_vllm as vLLM runs (blocks claimed as requests grow, recompute preemption);
* ``oracle``, ``pow2``, ``max``: a request claims its whole reservation on admission
  (``kv_reservation``; the policies of lab 02-02, made of the engine's own blocks, so without
  the external fragmentation a contiguous allocator adds: a best case for reservation);
* ``static``: static batching with reservation at the maximum length (FasterTransformer's way:
  a batch is admitted only when the previous one is done).

Each point replays the same seeded ShareGPT-shaped trace (``mini_vllm.benchmarks.datasets``,
lengths times ``--scale``, ``max_model_len`` times the same factor) with Poisson arrivals at the
rate, in process through ``AsyncLLM`` (``mini_vllm.benchmarks.serve.run_in_process``), and
records the mean normalised latency (end-to-end latency over output tokens, the paper's y-axis).
A curve stops one rate after it passes ``--stop-at`` (queues only grow from there). Rates are
the outer loop and settings the inner one, so that the settings compared at one rate see about
the same load of a shared machine (the one-minute load average is recorded with every point). The
sustained rate of a setting is where its curve crosses ``--threshold`` (linear between the two
measured rates around the crossing). At ``--ttft-rate`` each point also keeps every request's
time to first token, for the TTFT distribution (``course/figures/load.py``).

Greedy outputs are compared with ``LLM.generate``'s for a few requests first (correctness before
speed). The machine is shared: the load average before and after is recorded.

    python benchmarks/load_latency.py --json benchmarks/results/load_latency.json
    python benchmarks/load_latency.py --rates 8 --ttft-rate 8 --json \
        benchmarks/results/load_ttft.json                     # the TTFT distribution's run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.benchmarks.datasets import sharegpt_like_requests  # noqa: E402
from mini_vllm.benchmarks.serve import (  # noqa: E402
    arrival_times,
    calculate_metrics,
    run_in_process,
    sustained_rate,
)
from mini_vllm.engine.async_llm import AsyncLLM  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "paged": {"kv_reservation": "paged"},
    "oracle": {"kv_reservation": "oracle"},
    "pow2": {"kv_reservation": "pow2"},
    "max": {"kv_reservation": "max"},
    "static": {"kv_reservation": "max", "static_batching": True},
}


def check_outputs(llm: LLM, requests) -> None:
    """The engine under this setting answers greedy requests as the paged engine does."""
    reference = LLM(max_model_len=llm.config.max_model_len, enable_prefix_caching=False)
    for r in requests:
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        prompt = {"prompt_token_ids": list(r.prompt_token_ids)}
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        want = reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        if got != want:
            raise SystemExit(f"correctness check failed: {llm.config.kv_reservation} answered "
                             f"{got[:8]}..., the paged engine {want[:8]}...")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rates", type=float, nargs="+",
                        default=[1, 2, 3, 4, 6, 8, 12, 16, 24])
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--num-gpu-blocks", type=int, default=65,
                        help="the KV budget: 64 usable blocks (512 token slots at block size 8)")
    parser.add_argument("--threshold", type=float, default=0.08,
                        help="normalised latency (s/token) at which rates are compared")
    parser.add_argument("--stop-at", type=float, default=0.16,
                        help="stop a curve after the first rate above this (s/token)")
    parser.add_argument("--ttft-rate", type=float, default=None,
                        help="keep every request's TTFT at this rate (one of --rates)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.ttft_rate is not None and args.ttft_rate not in args.rates:
        parser.error(f"--ttft-rate {args.ttft_rate:g} is not one of --rates {args.rates}")

    requests = sharegpt_like_requests(args.num_requests, seed=args.seed, scale=args.scale,
                                      max_model_len=args.max_model_len)
    load_before = os.getloadavg()
    started = time.perf_counter()
    engines, points = {}, {name: [] for name in args.settings}
    for name in args.settings:
        llm = LLM(max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
                  block_size=args.block_size, enable_prefix_caching=False, num_threads=1,
                  **SETTINGS[name])
        check_outputs(llm, requests[:2])
        engines[name] = AsyncLLM(llm, multiprocessing=False)  # stats read from the core
    try:
        # Rates outside, settings inside: the settings compared at one rate run minutes apart
        # at most, under about the same load of a shared machine.
        for rate in args.rates:
            times = arrival_times(len(requests), rate, seed=args.seed)
            for name, engine in engines.items():
                if points[name] and points[name][-1]["normalized_latency"] > args.stop_at:
                    continue  # past its knee: queues only grow from here
                results, duration = asyncio.run(run_in_process(engine, requests, times))
                m = calculate_metrics(results, duration)
                if m["failed"]:
                    raise SystemExit(f"{name} at {rate} req/s: {m['failed']} requests failed")
                point = {"rate": rate, "normalized_latency": m["normalized_latency"],
                         "request_throughput": m["request_throughput"],
                         "output_throughput": m["output_throughput"],
                         "ttft_median": m["ttft"]["median"], "tpot_median": m["tpot"]["median"],
                         "e2el_p90": m["e2el"]["p90"], "duration_s": duration,
                         "loadavg_1min": round(os.getloadavg()[0], 2)}
                if rate == args.ttft_rate:  # the distribution, not just its median
                    point["ttfts"] = sorted(round(r.ttft, 4) for r in results if not r.error)
                points[name].append(point)
                print(f"{name:<7} {rate:>5.1f} req/s  normalised latency "
                      f"{point['normalized_latency']:.4f} s/token  throughput "
                      f"{point['request_throughput']:.2f} req/s  ({duration:.1f} s, load "
                      f"{point['loadavg_1min']})", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    curves = {name: {"points": points[name],
                     "sustained_rate": sustained_rate(points[name], args.threshold),
                     "preemptions": engines[name].engine_core.scheduler.stats.num_preemptions}
              for name in args.settings}

    print(f"\nsustained rate at {args.threshold} s/token (normalised latency):")
    for curve in curves.values():
        curve["reached_threshold"] = any(p["normalized_latency"] >= args.threshold
                                         for p in curve["points"])
    for name, curve in curves.items():
        rate = curve["sustained_rate"]
        bound = "" if curve["reached_threshold"] else ">= "
        print(f"  {name:<7} {'-' if rate is None else f'{bound}{rate:.2f} req/s'}")
    # A curve that never reached the threshold gives a lower bound: paged / it is unknown, and
    # paged / another is a lower bound when paged's own curve never reached it.
    paged = curves.get("paged", {})
    ratios = {name: paged["sustained_rate"] / c["sustained_rate"]
              for name, c in curves.items()
              if name != "paged" and paged.get("sustained_rate") and c["sustained_rate"]
              and c["reached_threshold"]}
    lower = "" if paged.get("reached_threshold", True) else ">= "
    for name, ratio in ratios.items():
        print(f"  paged / {name}: {lower}{ratio:.2f}x")
    unresolved = [n for n, c in curves.items() if n != "paged" and not c["reached_threshold"]]
    if unresolved:
        print(f"  not resolved (never reached the threshold): {', '.join(unresolved)}")
    done_when = {"paged_at_least_2x_max": ratios["max"] >= 2 if "max" in ratios else None,
                 "paged_above_oracle": ratios["oracle"] > 1 if "oracle" in ratios else None}
    print(f"done-when (None: not resolved at this threshold): {done_when}")
    env = {**environment(), "loadavg_before": [round(x, 2) for x in load_before],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "wall_s": round(time.perf_counter() - started, 1)}
    write_result(args.json, "load_latency.py", env, {
        "benchmark": "load_latency",
        "config": {"model": "shipped tiny_shakespeare", "num_requests": args.num_requests,
                   "scale": args.scale, "max_model_len": args.max_model_len,
                   "block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
                   "threshold_s_per_token": args.threshold, "stop_at": args.stop_at,
                   "ttft_rate": args.ttft_rate,
                   "seed": args.seed, "settings": {n: SETTINGS[n] for n in args.settings},
                   "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
                   "mean_output_len": sum(r.output_len for r in requests) / len(requests)},
        "curves": curves,
        "ratios_at_threshold": ratios,
        "ratios_are_lower_bounds": bool(lower),
        "done_when": done_when,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
