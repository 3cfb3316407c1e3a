"""Asynchronous scheduling on a CPU: milliseconds per engine step, planning the next step while
the model runs (``EngineCore.step_with_batch_queue``) against one step at a time (``step()``).

For each model, torch thread count and batch size, the same requests (greedy, ``--tokens``
tokens each after a 5-token prompt) run to the end both ways, as the busy loop steps them
(outputs collected, nothing sent). Correctness first: both ways must give the same tokens.
Each figure is the best of ``--repeats`` runs, divided by the tokens per request.

What there is to win: the busy loop's own work per step (``schedule()`` and
``update_from_output()``, timed in the synchronous run) can hide behind the model's step, whose
torch and C kernels release the GIL. What it costs: handing each step to the model thread and
waiting for it (a thread wake-up each way), and a core taken from the model's threads while the
two overlap.

    python benchmarks/async_scheduling.py
    python benchmarks/async_scheduling.py --model smollm2 --tokens 40 \
        --json benchmarks/results/async_scheduling_smollm2.json
"""

from __future__ import annotations

import argparse
import os
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

PROMPT = [5, 6, 7, 8, 9]


def run(llm: LLM, batch: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    """Step ``batch`` requests of ``tokens`` tokens to the end the busy loop's way. Returns
    (seconds in all, seconds inside schedule() and update_from_output(), each one's tokens)."""
    core = llm.engine
    watch = Stopwatch()
    if not core.async_scheduling:  # timed in the synchronous run only: no extra cost there
        watch.wrap(core.scheduler, "schedule", "update_from_output")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(batch)]
    for rid in ids:
        core.add_request(core.make_request(rid, PROMPT, params))
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    while core.has_unfinished_requests() or core.batch_queue:
        for out in core.step_fn() or []:
            got[out.request_id] += out.new_token_ids
    elapsed = time.perf_counter() - start
    watch.unwrap()
    return elapsed, watch.seconds, [got[rid] for rid in ids]


def measure(model: str, threads: int, batch: int, tokens: int, repeats: int) -> dict:
    row: dict = {"model": model, "threads": threads, "batch": batch}
    answers = {}
    for mode in (False, True):
        llm = LLM(model, num_threads=threads, async_scheduling=mode, max_num_seqs=max(batch, 1))
        torch.set_num_threads(threads)
        run(llm, batch, 4)  # warm-up: the compiled decode step, the model thread
        best = min((run(llm, batch, tokens) for _ in range(repeats)), key=lambda r: r[0])
        llm.engine.drain_batch_queue()
        answers[mode] = best[2]
        key = "async" if mode else "sync"
        row[f"{key}_ms_per_step"] = round(best[0] / tokens * 1e3, 3)
        if not mode:
            row["loop_work_ms_per_step"] = round(best[1] / tokens * 1e3, 3)
    if answers[False] != answers[True]:
        raise SystemExit(f"{model}, {threads} thread(s), batch {batch}: async scheduling gave "
                         "other tokens than the synchronous loop; fix that before timing it")
    row["saved_ms_per_step"] = round(row["sync_ms_per_step"] - row["async_ms_per_step"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mini_vllm/checkpoints/tiny_shakespeare",
                        help="a checkpoint path or a known name (smollm2)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+",
                        default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'threads':>7} {'batch':>5} {'sync ms':>8} {'async ms':>8} {'saved':>7} "
          f"{'loop work':>9}   (per step)")
    for threads in args.threads:
        for batch in args.batch:
            row = measure(args.model, threads, batch, args.tokens, args.repeats)
            rows.append(row)
            print(f"{threads:>7} {batch:>5} {row['sync_ms_per_step']:>8.3f} "
                  f"{row['async_ms_per_step']:>8.3f} {row['saved_ms_per_step']:>7.3f} "
                  f"{row['loop_work_ms_per_step']:>9.3f}")
    write_result(args.json, "async_scheduling.py", environment(),
                 {"model": args.model, "tokens": args.tokens, "cpu_count": os.cpu_count(),
                  "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
