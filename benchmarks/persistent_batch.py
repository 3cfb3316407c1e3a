"""The persistent batch against the per-step rebuild: what the runner spends preparing a step.

For each model and batch size, the same requests (greedy, ``--tokens`` tokens each after a
``--prompt``-token prompt) run to the end on the per-step runner (lab 03-04) and on the
persistent batch (lab 04-03, ``persistent_batch=True``). Correctness first: both must give the
same tokens. Timed: the runner's ``_update_states`` and ``_prepare_inputs`` (the two steps the
persistent batch does differently: applying the scheduler's diff and building the inputs), and
the whole engine step; milliseconds per step, the best of ``--repeats`` runs.

    python benchmarks/persistent_batch.py --json benchmarks/results/persistent_batch.json
    python benchmarks/persistent_batch.py --model smollm2 --tokens 32 --batch 1 32 \
        --json benchmarks/results/persistent_batch_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from benchmarks.timing import Stopwatch  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402


def run(llm: LLM, batch: int, prompt: int, tokens: int) -> tuple[float, float, int,
                                                                   list[list[int]]]:
    """Step ``batch`` requests to the end. Returns (seconds in all, seconds in the runner's
    update and prepare steps, steps taken, each request's tokens)."""
    core = llm.engine
    watch = Stopwatch()
    watch.wrap(core.model_runner, "_update_states", "_prepare_inputs")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        core.add_request(core.make_request(rid, [5 + (i + j) % 50 for j in range(prompt)],
                                           params))
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
    elapsed = time.perf_counter() - start
    watch.unwrap()
    return elapsed, watch.seconds, steps, [got[rid] for rid in ids]


def measure(model: str, batch: int, prompt: int, tokens: int, repeats: int) -> dict:
    row: dict = {"model": model, "batch": batch}
    answers = {}
    for persistent in (False, True):
        llm = LLM(model, persistent_batch=persistent, max_num_seqs=max(batch, 1),
                  max_model_len=prompt + tokens + 16)
        run(llm, batch, prompt, 4)  # warm-up: the compiled decode step
        best = min((run(llm, batch, prompt, tokens) for _ in range(repeats)),
                   key=lambda r: r[0])
        answers[persistent] = best[3]
        key = "persistent" if persistent else "rebuild"
        row[f"{key}_prepare_ms_per_step"] = round(best[1] / best[2] * 1e3, 3)
        row[f"{key}_ms_per_step"] = round(best[0] / best[2] * 1e3, 3)
    if answers[False] != answers[True]:
        raise SystemExit(f"{model}, batch {batch}: the persistent batch gave other tokens than "
                         "the per-step rebuild; fix that before timing it")
    row["prepare_saved_ms_per_step"] = round(
        row["rebuild_prepare_ms_per_step"] - row["persistent_prepare_ms_per_step"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mini_vllm/checkpoints/tiny_shakespeare",
                        help="a checkpoint path or a known name (smollm2)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'batch':>5} {'prepare: rebuild':>16} {'persistent':>10} {'step: rebuild':>13} "
          f"{'persistent':>10}   (ms per step)")
    for batch in args.batch:
        row = measure(args.model, batch, args.prompt, args.tokens, args.repeats)
        rows.append(row)
        print(f"{batch:>5} {row['rebuild_prepare_ms_per_step']:>16.3f} "
              f"{row['persistent_prepare_ms_per_step']:>10.3f} "
              f"{row['rebuild_ms_per_step']:>13.3f} {row['persistent_ms_per_step']:>10.3f}")
    write_result(args.json, "persistent_batch.py", environment(),
                 {"model": args.model, "prompt": args.prompt, "tokens": args.tokens,
                  "torch_threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
