"""Prefix caching on a workload whose requests share one long system prompt.

Every request is ``system prompt + its own question``. With prefix caching the system prompt's
full blocks are computed once and reused by every later request (a block hash names its whole
prefix, so a hit is exact). Reported with and without caching: prompt tokens actually computed,
time to first token (mean and median, from submission), throughput, the prefix-cache hit rate.

Correctness first: both runs must produce identical greedy outputs. All requests are submitted at
once; the token budget (``--max-num-batched-tokens``) admits a few per step, as a server would.

    python benchmarks/prefix_caching.py
    python benchmarks/prefix_caching.py --json benchmarks/results/engine_prefix_caching.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment, load_model  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402
from mini_vllm.tokenizers.tokenizer import ByteTokenizer  # noqa: E402

SYSTEM = (
    "You are the Chorus. Speak in blank verse, in the manner of the plays: short lines, old words, "
    "and no modern names. Answer the question that follows as a player would, addressing the "
    "audience directly, and end with a rhyming couplet.\n"
)


def make_prompts(n: int, system_len: int, seed: int) -> list[list[int]]:
    tok = ByteTokenizer()
    system = tok.encode((SYSTEM * (1 + system_len // len(SYSTEM)))[:system_len])
    rng = random.Random(seed)
    words = ["king", "ghost", "sword", "night", "crown", "poison", "castle", "queen", "death"]
    return [system + tok.encode(f"Q{i}: " + " ".join(rng.choice(words) for _ in range(
        rng.randint(3, 8))) + "?\n") for i in range(n)]


def run(model, prompts, caching: bool, args):
    llm = LLM(model, block_size=args.block_size, num_gpu_blocks=args.kv_blocks,
              enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    s = llm.last_stats
    return outs, {
        "prefix_caching": caching,
        "prompt_tokens": s.num_prompt_tokens,
        "prompt_tokens_computed": s.num_prompt_tokens_computed,
        "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
        "ttft_median_ms": round(1000 * statistics.median(ttft), 1),
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "tokens_per_s": round(s.num_generated_tokens / elapsed, 1),
        "hit_rate": round(s.prefix_cache_hit_rate, 4),
        "steps": s.num_steps,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=384, help="system prompt bytes (= tokens)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--model", choices=("shipped", "random"), default="shipped")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, model_name = load_model(args.model)
    prompts = make_prompts(args.requests, args.system_len, args.seed)
    LLM(model, num_gpu_blocks=8, num_threads=args.threads).generate(
        [prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2),
        use_tqdm=False)  # warm-up
    off_out, off = run(model, prompts, False, args)
    on_out, on = run(model, prompts, True, args)
    if [o.outputs[0].token_ids for o in off_out] != [o.outputs[0].token_ids for o in on_out]:
        raise SystemExit("correctness check failed: outputs differ with and without caching")

    print(f"workload: {args.requests} requests = {args.system_len}-token system prompt + a "
          f"5-40 token question, {args.max_tokens} output tokens each; model: {model_name}")
    cols = ("prefix_caching", "prompt_tokens", "prompt_tokens_computed", "ttft_mean_ms",
            "ttft_median_ms", "requests_per_s", "tokens_per_s", "hit_rate")
    print(" | ".join(cols))
    for r in (off, on):
        print(" | ".join(str(r[c]) for c in cols))
    saved = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    print(f"prefill tokens saved: {saved:.1%}"
          f", throughput x{on['requests_per_s'] / off['requests_per_s']:.2f}, "
          f"mean TTFT x{off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f} faster")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python benchmarks/prefix_caching.py " + " ".join(sys.argv[1:]),
            "benchmark": "prefix_caching", "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": model_name, "results": [off, on],
            "correctness": "identical greedy outputs with and without caching",
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
