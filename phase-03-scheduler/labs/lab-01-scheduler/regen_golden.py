"""The golden-trace workload of lab 03-01, and the tool that regenerates its trace on purpose.

The test runs :func:`make_workload` through the lab's scheduler and compares every step with
``golden_trace.json``. When the reference scheduler changes *on purpose*, regenerate the file
from ``mini_vllm.core.sched.scheduler`` and review the diff before committing it::

    python phase-03-scheduler/labs/lab-01-scheduler/regen_golden.py          # rewrite the file
    python phase-03-scheduler/labs/lab-01-scheduler/regen_golden.py --check  # compare only

The workload is small but exercises every decision: four arrival times, a shared prefix (cache
hits on admission), chunked prefills under a 24-token budget, ``max_num_seqs`` and a cache too
small for everyone (preemptions), EOS, a stop token and ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).with_name("golden_trace.json")
VOCAB = 101


def make_workload() -> tuple[Any, dict[int, list[Any]]]:
    """The fixed configuration and arrivals (``{step: [requests added before it]}``)."""
    from mini_vllm.config import SchedulerConfig
    from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    init_none_hash(sha256)
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=128,
        block_size=4,
        num_gpu_blocks=24,
        enable_prefix_caching=True,
    )
    hasher = get_request_block_hasher(config.block_size, sha256)
    rng = random.Random(2024)
    shared = [rng.randrange(1, VOCAB) for _ in range(8)]
    # (arrival step, prompt length, shares the prefix, max_tokens, how it stops): "eos" stops at
    # its 4th output token (made the EOS id), "stop" at its 3rd (made a stop token id).
    specs = [
        (0, 30, False, 12, "length"),
        (0, 10, True, 8, "length"),
        (0, 6, False, 10, "eos"),
        (2, 13, True, 9, "length"),
        (3, 21, False, 12, "length"),
        (5, 9, True, 6, "length"),
        (8, 17, False, 12, "length"),
        (8, 5, False, 10, "stop"),
    ]
    arrivals: dict[int, list[Any]] = {}
    for i, (step, n, share, max_tokens, how) in enumerate(specs):
        prompt = (shared if share else []) + [rng.randrange(1, VOCAB) for _ in range(n)]
        future = _toy_continuation(prompt, 4)
        eos = future[3] if how == "eos" else None
        stops = [future[2]] if how == "stop" else []
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stops, ignore_eos=eos is None)
        arrivals.setdefault(step, []).append(
            Request(f"r{i}", prompt, params, eos_token_id=eos, block_hasher=hasher)
        )
    return config, arrivals


def _toy_continuation(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` tokens the toy runner will sample after ``prompt``."""
    from mini_vllm.worker.toy_runner import toy_next_token

    tokens = list(prompt)
    for _ in range(n):
        tokens.append(toy_next_token(tokens, VOCAB))
    return tokens[len(prompt):]


def trace(scheduler_cls: Any) -> list[dict[str, Any]]:
    """Run the workload with ``scheduler_cls`` and the toy runner; one dict per step."""
    from mini_vllm.worker.toy_runner import ToyModelRunner, run_engine

    config, arrivals = make_workload()
    scheduler = scheduler_cls(config)
    runner = ToyModelRunner(config.block_size, config.num_gpu_blocks, with_kv=False,
                            vocab_size=VOCAB)
    records = run_engine(scheduler, runner, arrivals, max_steps=500)
    return [r.to_json() for r in records]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file, write nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from mini_vllm.core.sched.scheduler import Scheduler

    steps = trace(Scheduler)
    text = json.dumps({"workload": "lab 03-01 golden", "steps": steps}, indent=1) + "\n"
    if args.check:
        same = GOLDEN.is_file() and GOLDEN.read_text(encoding="utf-8") == text
        print("golden trace is up to date" if same else "golden trace differs from the reference")
        return 0 if same else 1
    GOLDEN.write_text(text, encoding="utf-8")
    print(f"wrote {len(steps)} steps to {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
