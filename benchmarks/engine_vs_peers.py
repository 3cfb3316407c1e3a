"""mini_vllm against what a user would run instead, on the same SmolLM2-135M-Instruct weights.

Contenders (greedy, EOS ignored, so every run makes the tokens asked for):

* mini_vllm with fp32 weights, with bf16 weights (``weight_dtype="bfloat16"``: the linear
  layers' weights in bf16, widened to fp32 as read; activations and KV cache fp32), and with
  GGUF blocks (``"q4_1"``: the file's own Q4_1 layers and Q8_0 head, the fp32 run's values;
  ``"q8_0"``: quantized from fp32 at load), dequantized in registers as read;
* ``transformers`` on the same converted folder, fp32: one padded batch (left padding, as many
  new tokens as the longest request asks for) and one request at a time;
* llama.cpp through ``llama-cpp-python`` on the package's GGUF file (Q4_1), one request at a
  time, when ``llama_cpp`` is installed; otherwise skipped with a sentence (its build from
  source takes about 12 minutes on 2 cores, so it is an optional extra, not a requirement).

Scenarios: one stream (a short prompt, ``--tokens`` new tokens) at 1 thread and at 2 threads,
in tokens per second; and ``--requests`` mixed requests (prompts of 8-256 random tokens, 16-256
new tokens, fixed seed) at 2 threads, in seconds and output tokens per second. Every repeat runs
every contender once, in turn (alternating, so a change in the machine's load hits all alike);
the median of ``--repeats`` is reported, with the one-minute load average before each run.

Correctness first: the contenders' greedy tokens for one prompt are compared before any timing,
and bf16 and quantized weights are measured like the FP8 KV cache (``benchmarks/kv_fp8.py``):
teacher-forced along the fp32 model's greedy tokens, the largest and mean logit difference and
the top-1 agreement, and free-running token agreement.

    python benchmarks/engine_vs_peers.py --json benchmarks/results/engine_vs_peers.json
    python benchmarks/engine_vs_peers.py --quick          # small settings: proves it runs
    python benchmarks/engine_vs_peers.py --accuracy-only --json \
        benchmarks/results/weights_accuracy.json     # the README's bf16 / q4_1 / q8_0 figures
    python benchmarks/engine_vs_peers.py --model path/to/converted_folder --gguf path/to/x.gguf
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_vs_plain import environment  # noqa: E402
from benchmarks.kv_fp8 import SMOLLM2_PROMPTS  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

STREAM_PROMPT = "The capital of France is"


def mixed_requests(n: int, vocab: int, seed: int, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt token ids, new tokens) pairs: prompts of 8-256 tokens, outputs of 16-256."""
    rng = random.Random(seed)
    top = 32 if quick else 256
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(8, top))],
             rng.randint(16 if not quick else 4, top)) for _ in range(n)]


WEIGHT_NAMES = {"auto": "fp32", "bfloat16": "bf16", "q4_1": "q4_1", "q8_0": "q8_0"}


class MiniVLLM:
    def __init__(self, path: str, weight_dtype: str) -> None:
        self.weights = WEIGHT_NAMES[weight_dtype]
        self.name = f"mini_vllm ({self.weights} weights)"
        self.llm = LLM(path, weight_dtype=weight_dtype, num_threads=1)
        self.vocab = self.llm.model.config.vocab_size

    def _run(self, prompts: list[list[int]], new: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in new]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def stream(self, ids: list[int], n: int, threads: int) -> list[int]:
        torch.set_num_threads(threads)
        return self._run([ids], [n])[0]

    def batch(self, requests: list[tuple[list[int], int]], threads: int) -> int:
        torch.set_num_threads(threads)
        outs = self._run([p for p, _ in requests], [n for _, n in requests])
        return sum(len(o) for o in outs)


class Transformers:
    def __init__(self, path: str, padded: bool) -> None:
        from transformers import AutoModelForCausalLM

        self.padded = padded
        self.name = "transformers, " + ("one padded batch" if padded else "one by one")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cfg = self.model.generation_config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False,
                                      pad_token_id=self.pad)
        return out[:, ids.shape[1]:]

    def stream(self, ids: list[int], n: int, threads: int) -> list[int]:
        torch.set_num_threads(threads)
        t = torch.tensor([ids])
        return self._generate(t, torch.ones_like(t), n)[0].tolist()

    def batch(self, requests: list[tuple[list[int], int]], threads: int) -> int:
        torch.set_num_threads(threads)
        if not self.padded:
            for ids, n in requests:
                self.stream(ids, n, threads)
            return sum(n for _, n in requests)
        width = max(len(p) for p, _ in requests)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p, _ in requests])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests])
        self._generate(ids, mask, max(n for _, n in requests))
        return sum(n for _, n in requests)  # the tokens asked for; the rest is padding's waste


class LlamaCpp:
    def __init__(self, gguf: str, weights: str) -> None:
        from llama_cpp import Llama

        self.name = f"llama.cpp (llama-cpp-python) {weights}, one by one"
        self.gguf = gguf
        self.llms: dict[int, object] = {}
        self._llama = Llama

    def _llm(self, threads: int):
        if threads not in self.llms:
            self.llms[threads] = self._llama(model_path=self.gguf, n_threads=threads,
                                             n_threads_batch=threads, n_ctx=1024,
                                             verbose=False)
        return self.llms[threads]

    def stream(self, ids: list[int], n: int, threads: int) -> list[int]:
        llm = self._llm(threads)
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # never stops by itself
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    def batch(self, requests: list[tuple[list[int], int]], threads: int) -> int:
        return sum(len(self.stream(ids, n, threads)) for ids, n in requests)


def weights_accuracy(fp32: MiniVLLM, bf16: MiniVLLM, prompts: list[str], n: int) -> dict:
    """Other weights (bf16, q4_1, q8_0) against fp32, as benchmarks/kv_fp8.py measures the fp8
    cache."""
    tok = fp32.llm.tokenizer
    torch.set_num_threads(2)
    max_err = sum_err = std_sum = 0.0
    count = forced = free = total = 0
    for prompt in prompts:
        ids = tok.encode(prompt)
        ref = fp32.stream(ids, n, 2)
        seq = torch.tensor(ids + ref)
        with torch.no_grad():
            want = fp32.llm.model.forward_reference(seq)[len(ids) - 1:-1]
            got = bf16.llm.model.forward_reference(seq)[len(ids) - 1:-1]
        diff = (got - want).abs()
        max_err, sum_err = max(max_err, float(diff.max())), sum_err + float(diff.sum())
        count += diff.numel()
        std_sum += float(want.std(dim=-1).sum())
        forced += int((got.argmax(-1) == torch.tensor(ref)).sum())
        free += sum(a == b for a, b in zip(bf16.stream(ids, n, 2), ref))
        total += len(ref)
    return {"prompts": len(prompts), "tokens_per_prompt": n, "max_abs_logit_error": max_err,
            "mean_abs_logit_error": sum_err / count,
            "mean_error_over_logit_std": sum_err / count / (std_sum / total),
            "teacher_forced_top1_agreement": forced / total,
            "free_running_token_agreement": free / total}


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2",
                   help="mini_vllm's name or a converted Hugging Face folder (default smollm2)")
    p.add_argument("--gguf", default=None, help="llama.cpp's file (default: the package's)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens of the one-stream runs")
    p.add_argument("--requests", type=int, default=32, help="requests of the mixed batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="16 tokens, 4 short requests, 1 repeat, 2 accuracy prompts: proves it runs")
    p.add_argument("--accuracy-only", action="store_true",
                   help="the correctness checks and the weights' accuracy, no timing")
    p.add_argument("--skip", nargs="+", default=[], metavar="WORDS",
                   help="leave out contenders whose name contains WORDS (e.g. 'transformers, "
                        "one by one', about 7 minutes a repeat)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.requests, args.repeats = 16, 4, 1
    from mini_vllm.model_executor.model_loader.gguf_loader import (
        cache_dir,
        named_model_file,
        resolve_model_name,
    )

    path = str(resolve_model_name(args.model))
    contenders: list = [MiniVLLM(path, w) for w in WEIGHT_NAMES]
    contenders.append(Transformers(path, padded=True))
    if not args.accuracy_only:
        contenders.append(Transformers(path, padded=False))
    skipped: dict[str, str] = {}
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        skipped["llama.cpp"] = ("llama-cpp-python is not installed (pip install "
                                "llama-cpp-python; it builds from source, about 12 minutes)")
    else:
        try:
            gguf = Path(args.gguf or named_model_file("smollm2"))
            contenders.append(LlamaCpp(str(gguf), "Q4_1"))
            # The same values in F32: what mini_vllm's fp32 weights are (the fair race).
            f32 = cache_dir() / f"{gguf.stem}.F32.gguf"
            if not f32.is_file():
                from benchmarks.gguf_f32 import write_f32_copy

                write_f32_copy(gguf, f32.with_suffix(".tmp")).replace(f32)
            contenders.append(LlamaCpp(str(f32), "F32 (same values)"))
        except FileNotFoundError as exc:
            skipped["llama.cpp"] = f"no GGUF file: {exc}"
    dropped = [c.name for c in contenders if any(word in c.name for word in args.skip)]
    contenders = [c for c in contenders if c.name not in dropped]
    for name in dropped:
        skipped[name] = "left out with --skip"
    for name, why in skipped.items():
        print(f"{name}: skipped, {why}")

    # Correctness first: every contender's greedy tokens for one prompt.
    ids = contenders[0].llm.tokenizer.encode(STREAM_PROMPT)
    n_check = min(args.tokens, 32)
    tokens = {c.name: c.stream(ids, n_check, 2) for c in contenders}
    reference = tokens[contenders[0].name]
    # Up to the reference's first EOS: past it, transformers' min_new_tokens forbids EOS while
    # the others may pick it, which is a difference of setting, not of arithmetic.
    eos = contenders[0].llm.tokenizer.eos_token_id
    n_check = reference.index(eos) if eos in reference else n_check
    agreement = {name: sum(a == b for a, b in zip(t[:n_check], reference)) / max(n_check, 1)
                 for name, t in tokens.items()}
    for name, share in agreement.items():
        print(f"greedy tokens equal to mini_vllm fp32 (first {n_check}, to EOS): "
              f"{share:6.1%}  {name}")
    accuracy = {}
    for c in contenders[1:len(WEIGHT_NAMES)]:
        accuracy[c.weights] = weights_accuracy(
            contenders[0], c, SMOLLM2_PROMPTS[:2 if args.quick else 8], 8 if args.quick else 32)
        print(f"{c.weights} weights vs fp32: " + "max |dlogit| {max_abs_logit_error:.3f}, mean "
              "{mean_abs_logit_error:.4f}, top-1 (forced) {teacher_forced_top1_agreement:.1%}, "
              "tokens equal (free-running) {free_running_token_agreement:.1%}".format(
                  **accuracy[c.weights]))

    if args.accuracy_only:
        args.repeats = 0
    requests = mixed_requests(args.requests, contenders[0].vocab, args.seed, args.quick)
    scenarios = [("one stream, 1 thread", 1), ("one stream, 2 threads", 2),
                 (f"{args.requests} mixed requests, 2 threads", 2)]
    runs: dict[str, dict[str, list[dict]]] = {c.name: {s: [] for s, _ in scenarios}
                                              for c in contenders}
    for _ in range(args.repeats):
        for scenario, threads in scenarios:
            for c in contenders:
                if scenario.startswith("one stream") and isinstance(c, Transformers) \
                        and not c.padded:
                    continue  # one stream is a batch of one: the padded row has it
                load = load_average()
                start = time.perf_counter()
                if scenario.startswith("one stream"):
                    made = len(c.stream(ids, args.tokens, threads))
                else:
                    made = c.batch(requests, threads)
                seconds = time.perf_counter() - start
                runs[c.name][scenario].append({"seconds": seconds, "tokens": made,
                                               "load_average": load})
    table = {}
    if not args.accuracy_only:
        print(f"\n{'contender':<44}" + "".join(f"{s:>34}" for s, _ in scenarios))
    for c in contenders:
        row, cells = {}, []
        for scenario, _ in scenarios:
            got = runs[c.name][scenario]
            if not got:
                cells.append(f"{'':>34}")
                continue
            seconds = statistics.median(r["seconds"] for r in got)
            rate = got[0]["tokens"] / seconds
            row[scenario] = {"median_seconds": seconds, "tokens": got[0]["tokens"],
                             "tokens_per_s": rate}
            text = (f"{rate:.1f} tok/s" if scenario.startswith("one stream")
                    else f"{seconds:.1f} s, {rate:.1f} out tok/s")
            cells.append(f"{text:>34}")
        table[c.name] = row
        if not args.accuracy_only:
            print(f"{c.name:<44}" + "".join(cells))
    loads = [r["load_average"] for c in runs.values() for s in c.values() for r in s]
    if loads:
        print(f"load average during the runs: {min(loads)} - {max(loads)} (1 minute)")
    if args.json:
        from benchmarks.record import write_result

        write_result(args.json, "engine_vs_peers.py", environment(2), {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "skipped": skipped, "greedy_agreement_with_mini_vllm_fp32": agreement,
            "weights_accuracy_vs_fp32": accuracy, "table": table, "runs": runs}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
