"""FP8 (e4m3) KV cache against the model-dtype cache: what it costs in accuracy, what it buys in
capacity. Measured on the engine, not assumed.

Accuracy, per model, over a fixed prompt set (one prompt at a time, greedy): the unquantized
engine (``kv_cache_dtype="auto"``) generates ``--max-tokens`` tokens; the fp8 engine (scales
calibrated once, on the first step, which holds every prompt of the set) is then *teacher
forced* along the same tokens (its sampler gets the auto run's token), so that both score the
same contexts. Reported: the largest and the mean absolute logit difference over every scored
position and vocabulary entry (and the mean as a fraction of the auto logits' standard
deviation); the teacher-forced top-1 agreement (the fp8 argmax equals the auto token); and
free-running agreement (both generate freely; the fraction of positions with the same token).

Capacity, per model and dtype: a fixed KV budget (``--budget-mib``) in blocks of 16 tokens,
requests of ``--prompt-len + --gen-len`` tokens, and more requests than could fit; the largest
number of requests running at once is read from the scheduler after every step (no prefix
caching, so nothing is shared). Also printed: the blocks the budget holds and the batch that
fits on paper, ``(blocks - 1) // ceil(len / 16)`` (block 0 is reserved).

    python benchmarks/kv_fp8.py
    python benchmarks/kv_fp8.py --json benchmarks/results/kv_fp8.json
    python benchmarks/kv_fp8.py --models shipped --max-tokens 16
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_plain import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.config import kv_block_bytes
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

SHIPPED_PROMPTS = [
    "HAMLET.\n", "KING.\nMy lord, ", "QUEEN.\nAlas, ", "OPHELIA.\n", "First Clown.\n",
    "HORATIO.\nWhat, has this thing ", "POLONIUS.\nThese are ", "LAERTES.\nO, ",
]
SMOLLM2_PROMPTS = [
    "The capital of France is", "Water boils at", "The three primary colors are",
    "A good way to learn programming is", "The largest planet in the solar system",
    "Once upon a time, in a small village,", "The main ingredients of bread are",
    "Photosynthesis is the process by which",
]


class LogitTap:
    """Wraps ``model.compute_logits``: records every logits row; optionally forces the sampler
    to a given token per step (teacher forcing) by making it the only finite choice."""

    def __init__(self, model) -> None:
        self.model, self.real = model, model.compute_logits
        self.rows: list[torch.Tensor] = []
        self.force: list[int] | None = None

    def __enter__(self) -> LogitTap:
        def tapped(hidden):
            logits = self.real(hidden)
            self.rows.append(logits.detach().float().clone())
            if self.force is not None:
                forced = torch.full_like(logits, float("-inf"))
                forced[:, self.force[len(self.rows) - 1]] = 0.0
                return forced
            return logits

        self.model.compute_logits = tapped
        return self

    def __exit__(self, *exc) -> None:
        del self.model.compute_logits


def load(name: str):
    if name == "shipped":
        from mini_vllm.entrypoints.llm import ByteTokenizer
        from mini_vllm.model_executor.model_loader.loader import load_default_model

        return load_default_model(), ByteTokenizer(), SHIPPED_PROMPTS
    loaded = LLM("smollm2", num_gpu_blocks=4)  # the loader, once; engines get the objects
    return loaded.model, loaded.tokenizer, SMOLLM2_PROMPTS


def accuracy(model, tok, prompts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kw = dict(tokenizer=tok, num_gpu_blocks=256, enable_prefix_caching=False)
    auto, fp8 = LLM(model, **kw), LLM(model, kv_cache_dtype="fp8", **kw)
    fp8.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    max_err, sum_err, count, std_sum = 0.0, 0.0, 0, 0.0
    forced_agree = free_agree = total = 0
    for prompt in prompts:
        with LogitTap(model) as tap:
            ref = auto.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        ref_rows = torch.cat(tap.rows)
        with LogitTap(model) as tap:
            tap.force = list(ref)
            fp8.generate(prompt, params, use_tqdm=False)
        rows = torch.cat(tap.rows)
        free = fp8.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        diff = (rows - ref_rows).abs()
        max_err = max(max_err, float(diff.max()))
        sum_err += float(diff.sum())
        count += diff.numel()
        std_sum += float(ref_rows.std(dim=-1).sum())
        forced_agree += int((rows.argmax(dim=-1) == torch.tensor(ref)).sum())
        free_agree += sum(a == b for a, b in zip(free, ref))
        total += len(ref)
    mean_err = sum_err / count
    return {
        "prompts": len(prompts),
        "tokens_per_prompt": max_tokens,
        "kv_scales": [list(s) for s in fp8.engine.model_runner.kv_scales],
        "max_abs_logit_error": max_err,
        "mean_abs_logit_error": mean_err,
        "mean_error_over_logit_std": mean_err / (std_sum / total),
        "teacher_forced_top1_agreement": forced_agree / total,
        "free_running_token_agreement": free_agree / total,
    }


def capacity(model, tok, budget: int, prompt_len: int, gen_len: int, kv_cache_dtype: str,
             seed: int = 0) -> dict:
    block = 16
    llm = LLM(model, tokenizer=tok, kv_cache_memory=budget, block_size=block,
              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, max_num_seqs=1024,
              max_num_batched_tokens=max(512, prompt_len * 8))
    blocks = llm._scheduler_config.num_gpu_blocks
    per_seq = math.ceil((prompt_len + gen_len) / block)
    fits = (blocks - 1) // per_seq
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    n = 2 * fits + 2
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}
               for _ in range(n)]
    engine = llm.engine
    peak = 0
    real_step = engine.step

    def step():
        nonlocal peak
        out = real_step()
        peak = max(peak, len(engine.scheduler.running))
        return out

    engine.step = step
    start = time.perf_counter()
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen_len,
                                             ignore_eos=True), use_tqdm=False)
    finally:
        del engine.step
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "budget_bytes": budget,
        "block_bytes": kv_block_bytes(model, block, kv_cache_dtype),
        "blocks": blocks,
        "seq_len": prompt_len + gen_len,
        "batch_that_fits": fits,
        "measured_peak_running": peak,
        "preemptions": llm.last_stats.num_preemptions,
        "requests": n,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["shipped", "smollm2"],
                   choices=["shipped", "smollm2"])
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt (accuracy)")
    p.add_argument("--budget-mib", type=float, default=4.0,
                   help="KV budget of the shipped model (capacity)")
    p.add_argument("--smollm2-budget-mib", type=float, default=16.0,
                   help="KV budget of SmolLM2 (its blocks are 22x the shipped model's)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    results: dict = {"accuracy": {}, "capacity": {}, "skipped": {}}
    for name in args.models:
        try:
            model, tok, prompts = load(name)
        except (ImportError, FileNotFoundError, ValueError) as exc:
            results["skipped"][name] = str(exc)
            print(f"{name}: skipped ({exc})")
            continue
        model_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        results["accuracy"][name] = {model_dtype: accuracy(model, tok, prompts,
                                                           args.max_tokens)}
        rows = []
        budget = int((args.budget_mib if name == "shipped" else args.smollm2_budget_mib) * 2**20)
        # SmolLM2 in bfloat16 on a CPU is slow; its 2x is the same arithmetic as the shipped
        # model's bfloat16 rows.
        for dtype in ((torch.float32, torch.bfloat16) if name == "shipped" else (torch.float32,)):
            m = model.to(dtype)
            for kv in ("auto", "fp8"):
                rows.append(capacity(m, tok, budget, args.prompt_len, args.gen_len, kv))
        model.to(torch.float32)
        if name == "shipped":
            results["accuracy"][name]["bfloat16"] = accuracy(
                model.to(torch.bfloat16), tok, prompts, args.max_tokens)
            model.to(torch.float32)
        results["capacity"][name] = rows

    print("\nAccuracy: fp8 KV cache against the model-dtype cache (greedy, teacher forced)")
    print(f"{'model':<9} {'dtype':<9} {'max |dlogit|':>12} {'mean |dlogit|':>13} "
          f"{'mean/std':>9} {'top-1 forced':>12} {'free-running':>12}")
    for name, per_dtype in results["accuracy"].items():
        for dtype, a in per_dtype.items():
            print(f"{name:<9} {dtype:<9} {a['max_abs_logit_error']:>12.4f} "
                  f"{a['mean_abs_logit_error']:>13.5f} {a['mean_error_over_logit_std']:>9.4f} "
                  f"{100 * a['teacher_forced_top1_agreement']:>11.1f}% "
                  f"{100 * a['free_running_token_agreement']:>11.1f}%")
    print(f"\nCapacity: a fixed KV budget, requests of {args.prompt_len}+{args.gen_len} tokens, "
          "block size 16")
    print(f"{'model':<9} {'budget':>7} {'dtype':<9} {'kv cache':<9} {'bytes/block':>11} "
          f"{'blocks':>7} {'fits':>5} {'peak running':>12} {'preempt':>7}")
    for name, rows in results["capacity"].items():
        for r in rows:
            print(f"{name:<9} {r['budget_bytes'] / 2**20:>5g}Mi {r['model_dtype']:<9} "
                  f"{r['kv_cache_dtype']:<9} "
                  f"{r['block_bytes']:>11} {r['blocks']:>7} {r['batch_that_fits']:>5} "
                  f"{r['measured_peak_running']:>12} {r['preemptions']:>7}")
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_result(args.json, "kv_fp8.py", environment(args.threads),
                     {"settings": settings, **results}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
