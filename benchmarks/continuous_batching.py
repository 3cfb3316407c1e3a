"""Continuous batching against static batching, at the same KV-cache memory.

The workload has long-tailed output lengths: most requests want a few dozen tokens, a few want
hundreds (``--long-fraction`` of them). Both systems get the same number of KV blocks.

* **static, worst-case reservation** (what came before PagedAttention): a batch is formed, and
  runs until its *longest* request ends; only then is the next batch formed. The cache is
  reserved per seat for the longest sequence any request might reach (the longest prompt + the
  workload's largest ``max_tokens``), so the batch size is ``KV blocks // blocks per seat``.
* **static, per-request reservation**: the same, but each request reserves only what it can
  reach itself (its prompt + its own ``max_tokens``), and a batch takes requests in order while
  their reservations fit (and ``--max-num-seqs``). This is the strongest static batcher that
  knows every output length in advance; it shows how much of continuous batching's gain is
  paging (no reservation at all) and how much is not waiting for a batch's longest request.

Both static systems run on the same engine, batch after batch, with ``max_num_seqs`` set to the
batch's size.
* **continuous** (mini_vllm): every request is queued at once; the scheduler admits a request as
  soon as a seat and blocks are free, and blocks are allocated as sequences grow.

Correctness first: greedy outputs of both runs must be identical token for token (the engine is
deterministic and requests are independent). Timing is wall-clock (``time.perf_counter``) of the
whole workload, after one warm-up request.

    python benchmarks/continuous_batching.py
    python benchmarks/continuous_batching.py \
        --json benchmarks/results/engine_continuous_batching.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.loader import DEFAULT_CHECKPOINT  # noqa: E402
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402


def environment() -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_revision": run(["git", "rev-parse", "HEAD"]) or "unknown",
    }


def load_model(which: str) -> tuple[LlamaForCausalLM, str]:
    """The shipped checkpoint, or a random model of the same shape if it is absent."""
    if which == "shipped" and DEFAULT_CHECKPOINT.with_suffix(".safetensors").exists():
        from mini_vllm.model_executor.model_loader.hf_loader import load_checkpoint

        return load_checkpoint(DEFAULT_CHECKPOINT), "shipped tiny_shakespeare"
    model = LlamaForCausalLM(ModelConfig())
    init_weights(model, seed=0)
    return model.eval().requires_grad_(False), "random init, shipped shape"


def make_workload(n: int, long_fraction: float, short: tuple[int, int], long: tuple[int, int],
                  seed: int):
    """Prompts of 16-32 tokens; output lengths long-tailed: a ``long_fraction`` of the requests
    draw from ``long``, the others from ``short`` (inclusive ranges)."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(32, 127) for _ in range(rng.randint(16, 32))])
        span = long if rng.random() < long_fraction else short
        max_tokens.append(rng.randint(*span))
    return prompts, max_tokens


def _run_batches(model, prompts, max_tokens, batches, num_blocks, block_size, threads):
    llm = LLM(model, block_size=block_size, num_gpu_blocks=num_blocks + 1, num_threads=threads,
              max_num_seqs=max(len(b) for b in batches), enable_prefix_caching=False)
    outputs, steps = [], 0
    t0 = time.perf_counter()
    for batch in batches:
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
                  for i in batch]
        outputs += llm.generate([prompts[i] for i in batch], params, use_tqdm=False)
        steps += llm.last_stats.num_steps
        assert llm.last_stats.num_preemptions == 0, "a static batch must fit its reservation"
    return time.perf_counter() - t0, outputs, steps


def run_static(model, prompts, max_tokens, num_blocks, block_size, threads):
    """Worst-case reservation: every seat reserves the longest prompt + the largest max_tokens."""
    reserve = -(-(max(len(p) for p in prompts) + max(max_tokens)) // block_size)
    batch_size = max(1, num_blocks // reserve)
    batches = [list(range(s, min(s + batch_size, len(prompts))))
               for s in range(0, len(prompts), batch_size)]
    t, outputs, steps = _run_batches(model, prompts, max_tokens, batches, num_blocks, block_size,
                                     threads)
    return t, outputs, steps, batch_size


def run_static_per_request(model, prompts, max_tokens, num_blocks, block_size, max_num_seqs,
                           threads):
    """Per-request reservation: FCFS batches while the requests' own reservations fit."""
    batches, current, used = [], [], 0
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        need = -(-(len(p) + m) // block_size)
        if current and (used + need > num_blocks or len(current) == max_num_seqs):
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += need
    batches.append(current)
    t, outputs, steps = _run_batches(model, prompts, max_tokens, batches, num_blocks, block_size,
                                     threads)
    return t, outputs, steps, sum(len(b) for b in batches) / len(batches)


def run_continuous(model, prompts, max_tokens, num_blocks, block_size, max_num_seqs, threads):
    llm = LLM(model, block_size=block_size, num_gpu_blocks=num_blocks + 1, num_threads=threads,
              max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outputs, llm.last_stats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--short", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    p.add_argument("--long", type=int, nargs=2, default=(96, 128), metavar=("MIN", "MAX"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=60, help="usable KV blocks for both")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--model", choices=("shipped", "random"), default="shipped")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model, model_name = load_model(args.model)
    prompts, max_tokens = make_workload(args.requests, args.long_fraction, tuple(args.short),
                                        tuple(args.long), args.seed)
    # Warm-up (allocator, first-call overheads), not timed.
    LLM(model, num_gpu_blocks=8, num_threads=args.threads).generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    s_time, s_out, s_steps, batch_size = run_static(
        model, prompts, max_tokens, args.kv_blocks, args.block_size, args.threads)
    r_time, r_out, r_steps, r_seats = run_static_per_request(
        model, prompts, max_tokens, args.kv_blocks, args.block_size, args.max_num_seqs,
        args.threads)
    c_time, c_out, c_stats = run_continuous(
        model, prompts, max_tokens, args.kv_blocks, args.block_size, args.max_num_seqs,
        args.threads)

    c_ids = [o.outputs[0].token_ids for o in c_out]
    for name, out in (("static (worst case)", s_out), ("static (per request)", r_out)):
        if [o.outputs[0].token_ids for o in out] != c_ids:
            raise SystemExit(f"correctness check failed: {name} and continuous outputs differ")
    gen_tokens = sum(len(t) for t in c_ids)

    rows = [
        ("static-worst-case", s_time, s_steps, batch_size, 0),
        ("static-per-request", r_time, r_steps, round(r_seats, 1), 0),
        ("continuous", c_time, c_stats.num_steps, args.max_num_seqs, c_stats.num_preemptions),
    ]
    print(f"workload: {args.requests} requests, prompts 16-32 tokens, output lengths "
          f"{min(max_tokens)}-{max(max_tokens)} (mean {gen_tokens / args.requests:.0f}); "
          f"KV cache {args.kv_blocks} blocks x {args.block_size} tokens; model: {model_name}")
    print(f"{'system':<19} {'seats':>5} {'steps':>6} {'time s':>8} {'req/s':>7} "
          f"{'tok/s':>8} {'preempt':>7}")
    results = []
    for name, t, steps, seats, preempt in rows:
        print(f"{name:<19} {seats:>5} {steps:>6} {t:>8.2f} {args.requests / t:>7.2f} "
              f"{gen_tokens / t:>8.1f} {preempt:>7}")
        results.append({"system": name, "seats": seats, "steps": steps, "seconds": round(t, 3),
                        "requests_per_s": round(args.requests / t, 3),
                        "tokens_per_s": round(gen_tokens / t, 1), "preemptions": preempt})
    speedup, speedup_per_request = s_time / c_time, r_time / c_time
    print(f"continuous / static throughput: {speedup:.2f}x against worst-case reservation, "
          f"{speedup_per_request:.2f}x against per-request reservation "
          f"(peak KV blocks in use, continuous: {c_stats.peak_kv_blocks_in_use}; "
          "per-request seats: mean batch size)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "continuous_batching", "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "command": "python benchmarks/continuous_batching.py " + " ".join(sys.argv[1:]),
            "model": model_name, "generated_tokens": gen_tokens, "results": results,
            "speedup": round(speedup, 3),
            "speedup_vs_per_request_static": round(speedup_per_request, 3),
            "correctness": "static (both) == continuous outputs",
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
