"""Scheduler overhead: microseconds per ``schedule()`` call with 256 running requests, beside
the model's time per step.

Two measurements on the same decode-only steady state (every request running, one new token
each per step):

* **scheduler**: the real ``Scheduler`` with ``--running`` requests; each step times
  ``schedule()`` and ``update_from_output()`` (fed one dummy token per request) separately;
* **model**: one ``ModelRunner.execute_model`` on the same batch shape (all requests decoding,
  ``--context`` tokens of context each), with the model of ``--model``.

Correctness first: every ``schedule()`` must schedule exactly one token for each of the running
requests (the steady state being measured). Times are ``time.perf_counter`` medians.

    python benchmarks/scheduler_overhead.py
    python benchmarks/scheduler_overhead.py --json benchmarks/results/engine_scheduler_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment, load_model  # noqa: E402
from mini_vllm.config import SchedulerConfig  # noqa: E402
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256  # noqa: E402
from mini_vllm.core.sched.scheduler import Scheduler  # noqa: E402
from mini_vllm.outputs import ModelRunnerOutput  # noqa: E402
from mini_vllm.request import Request  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402
from mini_vllm.worker.model_runner import ModelRunner  # noqa: E402


def build(args, caching: bool) -> Scheduler:
    blocks_per_req = -(-(args.context + args.steps + 8) // args.block_size)
    config = SchedulerConfig(
        max_num_seqs=args.running, max_num_batched_tokens=max(2048, args.running * args.context),
        max_model_len=4096, block_size=args.block_size,
        num_gpu_blocks=args.running * blocks_per_req + 1, enable_prefix_caching=caching,
    )
    sched = Scheduler(config)
    hasher = get_request_block_hasher(args.block_size, sha256)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 100, ignore_eos=True)
    for i in range(args.running):
        prompt = [(i * 7 + j) % 250 for j in range(args.context)]
        sched.add_request(Request(f"r{i}", prompt, params, None, block_hasher=hasher))
    return sched


def feed(sched: Scheduler, out) -> float:
    ids = list(out.num_scheduled_tokens)
    runner_out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[1] for _ in ids])
    t0 = time.perf_counter()
    sched.update_from_output(out, runner_out)
    return time.perf_counter() - t0


def time_scheduler(args, caching: bool) -> dict:
    sched = build(args, caching)
    feed(sched, sched.schedule())  # the prefill step: admits everyone
    sched_t, update_t = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched_t.append(time.perf_counter() - t0)
        if len(out.num_scheduled_tokens) != args.running or out.total_num_scheduled_tokens != (
            args.running
        ):
            raise SystemExit("correctness check failed: not a decode step over every request")
        update_t.append(feed(sched, out))
    return {
        "prefix_caching": caching,
        "schedule_us_median": round(1e6 * statistics.median(sched_t), 1),
        "schedule_us_p90": round(1e6 * sorted(sched_t)[int(0.9 * len(sched_t))], 1),
        "update_us_median": round(1e6 * statistics.median(update_t), 1),
    }


def time_model(args) -> dict:
    model, name = load_model(args.model)
    sched = build(args, False)
    cfg = sched.scheduler_config
    runner = ModelRunner(model, block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks)
    out = sched.schedule()
    feed(sched, out)
    runner.execute_model(out)  # prefill of every request; not timed
    times = []
    for _ in range(args.model_steps):
        out = sched.schedule()
        t0 = time.perf_counter()
        runner.execute_model(out)
        times.append(time.perf_counter() - t0)
        feed(sched, out)
    return {"model": name, "model_ms_per_step_median": round(1e3 * statistics.median(times), 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--model-steps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", choices=("shipped", "random"), default="shipped")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    sched_rows = [time_scheduler(args, False), time_scheduler(args, True)]
    model_row = time_model(args)
    model_us = 1000 * model_row["model_ms_per_step_median"]
    print(f"{args.running} running requests, decode steps, {args.context} tokens of context; "
          f"model: {model_row['model']}")
    print(f"{'prefix cache':<13} {'schedule() us':>14} {'p90 us':>8} {'update us':>10} "
          f"{'model us/step':>14} {'sched share':>11}")
    for r in sched_rows:
        share = (r["schedule_us_median"] + r["update_us_median"]) / (
            model_us + r["schedule_us_median"] + r["update_us_median"])
        r["share_of_step"] = round(share, 4)
        print(f"{str(r['prefix_caching']):<13} {r['schedule_us_median']:>14.1f} "
              f"{r['schedule_us_p90']:>8.1f} {r['update_us_median']:>10.1f} {model_us:>14.0f} "
              f"{share:>10.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python benchmarks/scheduler_overhead.py " + " ".join(sys.argv[1:]),
            "benchmark": "scheduler_overhead", "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "scheduler": sched_rows, **model_row,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
