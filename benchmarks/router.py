"""Cache-aware routing against round-robin over ``--dp-size`` engines: the prefix-cache hits
that routing decides.

The workload is chat sessions. Each of ``--num-system`` system prompts (``--system-len`` tokens,
several blocks) serves ``--users`` users; a user's session is ``--turns`` turns, each turn's
prompt the previous turn's prompt + the reply it got + a new user message, sent as soon as the
reply is complete (a closed loop per session; the sessions themselves start at Poisson times,
``--rate`` a second, in a shuffled, seeded order). Replies are greedy, ``--max-tokens`` long.

The same sessions, start times and order run through :class:`~mini_vllm.entrypoints.router.
RoutedEngines` twice per rate: with the prefix router (a request goes to the engine whose cache
holds the longest run of its prompt's block-hash chain, unless that engine is ``--threshold``
requests busier than the idlest) and with round-robin. Each engine's KV cache (``--kv-blocks``)
is as large as all the system prompts together: round-robin sends every system prompt to every
engine, and each turn of a chat to another engine than the turn before, so it evicts and
recomputes; the prefix router gives each engine about half the system prompts and keeps a chat
where its history is. The default rates are one below the engines' capacity (throughput is the
arrival rate; the difference is in TTFT) and one near it.

Reported per rate and policy: the prefix-cache hit rate over all engines (prompt tokens found /
looked up, as the engine cores count them, a preempted request's lookups again included; and
the requests' own ``num_cached_tokens`` share of prompt tokens), request and output-token
throughput, mean and median TTFT, preemptions. Correctness first: every run must give every
session the same tokens (greedy).

    python benchmarks/router.py --json benchmarks/results/router.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.benchmarks.serve import RequestResult, arrival_times, calculate_metrics  # noqa: E402
from mini_vllm.entrypoints.router import RoutedEngines  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402
from mini_vllm.tokenizers.tokenizer import ByteTokenizer  # noqa: E402

# The figures averaged over repeats in the summary.
SUMMED = ("prefix_cache_hit_rate", "cached_prompt_token_share", "request_throughput",
          "output_throughput", "mean_ttft_ms", "median_ttft_ms", "preemptions")
WORDS = ("king ghost sword night crown poison castle queen death player stage grave letter "
         "ship storm duke fool honour ring tower bell river forest").split()
ROLES = ("Chorus", "Fool", "Ghost", "Gravedigger", "Herald", "Nurse", "Porter", "Soothsayer",
         "Prologue", "Witch", "Jester", "Clown")


def sessions(args: argparse.Namespace) -> list[dict]:
    """Every session: its system prompt's index and its user messages (token ids), shuffled."""
    tok, rng = ByteTokenizer(), random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = []
    for i in range(args.num_system):
        text = f"You are the {ROLES[i % len(ROLES)]} ({i}). Answer in blank verse. "
        while len(text) < args.system_len:
            text += words(6).capitalize() + ". "
        systems.append(tok.encode(text[:args.system_len]))
    out = [{"system": systems[s],
            "messages": [tok.encode(f"\nUser: {words(rng.randint(3, args.user_words))}?\n")
                         for _ in range(args.turns)]}
           for s in range(args.num_system) for _ in range(args.users)]
    rng.shuffle(out)
    return out


async def drive(engines: RoutedEngines, trace: list[dict], starts: list[float],
                params: SamplingParams) -> tuple[list[RequestResult], list[int], list, float]:
    """Run every session (its turns in order) from its start time; return each request's
    result and cached prompt tokens, each session's replies, and the run's duration."""
    results: list[RequestResult] = []
    cached: list[int] = []
    replies: list[list[list[int]]] = [[] for _ in trace]
    t0 = time.perf_counter()

    async def session(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
        prompt = list(trace[i]["system"])
        for message in trace[i]["messages"]:
            prompt += message
            result = RequestResult(len(prompt), params.max_tokens, time.perf_counter())
            results.append(result)
            reply: list[int] = []
            async for out in engines.generate({"prompt_token_ids": list(prompt)}, params):
                result.chunks.append((time.perf_counter(), len(out.outputs[0].token_ids)))
                reply += out.outputs[0].token_ids
                num_cached = out.metrics.get("num_cached_tokens", 0)
            cached.append(num_cached)
            replies[i].append(reply)
            prompt += reply

    await asyncio.gather(*(session(i) for i in range(len(trace))))
    return results, cached, replies, time.perf_counter() - t0


def run(policy: str, trace: list[dict], starts: list[float], args: argparse.Namespace) -> tuple:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with RoutedEngines(args.model, dp_size=args.dp_size, policy=policy,
                       balance_abs_threshold=args.threshold, num_gpu_blocks=args.kv_blocks,
                       block_size=args.block_size, max_model_len=512,
                       num_threads=args.threads) as engines:

        async def warm_up() -> None:  # outside the router: its view of the caches stays clean
            for engine in engines.engines:
                async for _ in engine.generate({"prompt_token_ids": [0] * 40}, params):
                    pass

        asyncio.run(warm_up())
        before = engines.prefix_cache_stats()
        results, cached, replies, duration = asyncio.run(drive(engines, trace, starts, params))
        after = engines.prefix_cache_stats()
        routed = list(engines.routed)
        preemptions = [e.stat_logger.load.num_preemptions for e in engines.engines]
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    m = calculate_metrics(results, duration)
    row = {
        "policy": policy,
        "requests": m["completed"], "failed": m["failed"], "duration_s": duration,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "cached_prompt_token_share": sum(cached) / m["total_input_tokens"],
        "per_engine_hit_rate": [(a["hits"] - b["hits"]) / max(1, a["queries"] - b["queries"])
                                for a, b in zip(after, before)],
        "requests_per_engine": routed, "preemptions_per_engine": preemptions,
        "preemptions": sum(preemptions),
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "mean_ttft_ms": m["ttft"]["mean"] * 1e3, "median_ttft_ms": m["ttft"]["median"] * 1e3,
        "mean_input_tokens": m["total_input_tokens"] / m["completed"],
    }
    return row, replies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="LLM's model (default: the shipped one)")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--num-system", type=int, default=8)
    p.add_argument("--system-len", type=int, default=128, help="tokens (bytes) per system prompt")
    p.add_argument("--users", type=int, default=24, help="sessions per system prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--user-words", type=int, default=8, help="most words in a user message")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, nargs="+", default=[40.0, 60.0],
                   help="sessions started per second (one run per rate and policy)")
    p.add_argument("--kv-blocks", type=int, default=64, help="each engine's KV blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threshold", type=int, default=8, help="the prefix router's balance_abs_"
                   "threshold (outstanding requests)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per rate and policy (mean)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    trace = sessions(args)
    runs, replies = [], []
    for rate in args.rate:
        starts = arrival_times(len(trace), rate, seed=args.seed)
        for repeat in range(args.repeats):
            # Alternate which policy goes first: the machine's load drifts between runs.
            for policy in ("round_robin", "prefix")[::1 if repeat % 2 == 0 else -1]:
                row, got = run(policy, trace, starts, args)
                runs.append({"rate": rate, "repeat": repeat, **row})
                replies.append(got)
    if any(r != replies[0] for r in replies):
        raise SystemExit("the runs gave different tokens: routing must not change them")
    longest = max(len(s["system"]) + sum(map(len, s["messages"])) + (args.turns - 1)
                  * args.max_tokens for s in trace)
    summary = []
    for rate in args.rate:
        for policy in ("round_robin", "prefix"):
            mine = [r for r in runs if r["rate"] == rate and r["policy"] == policy]
            summary.append({"rate": rate, "policy": policy, **{
                k: statistics.fmean(r[k] for r in mine) for k in SUMMED}})

    print(f"{len(trace)} sessions x {args.turns} turns over {args.dp_size} engines of "
          f"{args.kv_blocks} blocks x {args.block_size} tokens; longest prompt {longest} tokens; "
          f"mean of {args.repeats} runs each")
    print(f"{'sessions/s':>10} {'policy':>12} {'hit rate':>9} {'req/s':>7} {'out tok/s':>10} "
          f"{'mean TTFT':>10} {'median TTFT':>12} {'preempted':>9}")
    for r in summary:
        print(f"{r['rate']:>10g} {r['policy']:>12} {100 * r['prefix_cache_hit_rate']:>8.1f}% "
              f"{r['request_throughput']:>7.1f} {r['output_throughput']:>10.0f} "
              f"{r['mean_ttft_ms']:>7.1f} ms {r['median_ttft_ms']:>9.1f} ms "
              f"{r['preemptions']:>9.1f}")
    write_result(args.json, "router.py", environment(), {
        "model": args.model or "shipped",
        "workload": {k: getattr(args, k) for k in (
            "dp_size", "num_system", "system_len", "users", "turns", "user_words", "max_tokens",
            "kv_blocks", "block_size", "threshold", "threads", "seed", "repeats")},
        "num_requests": len(trace) * args.turns, "longest_prompt_tokens": longest,
        "same_tokens": True,
        "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
