"""Preemption by recomputation versus by swapping (lab 03-03), after the paper's §7.3.

Two measurements, each at several block sizes:

* **micro**: the cost of bringing back one preempted sequence of ``L`` tokens. *Swap* copies its
  KV blocks from the GPU cache to the CPU pool and back (``swap_blocks`` twice, keys and values);
  *recompute* runs the toy model's prefill over the ``L`` tokens (projections, writing the KV
  with ``reshape_and_cache`` and chunked-prefill attention). Reported per token, in microseconds.
* **end to end**: a fixed workload that overflows a small cache runs to completion with the
  scheduler and the toy runner (real paged caches, real attention), once per mode, with the same
  cache capacity *in tokens* at every block size. Reported: wall time, steps, preemptions,
  tokens recomputed, blocks and bytes copied.

Correctness first: before timing, both modes must generate exactly the tokens of a run whose
cache is large enough for no preemption, and every running request's KV must be exact after
every step. The toy model has one attention layer and no MLP, so its recompute is far cheaper
than a real model's; the hardware-independent columns (tokens recomputed, bytes copied) carry
over, the times only show shapes. Timing uses ``time.perf_counter``: the best of repeats for
the micro benchmark, one run per configuration end to end (there the counts are exact and the
seconds only indicative).

    python benchmarks/preemption.py                   # print the tables
    python benchmarks/preemption.py --json benchmarks/results/preemption.json
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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm.attention.cache_ops import reshape_and_cache, swap_blocks  # noqa: E402
from mini_vllm.attention.chunked_prefill import chunked_prefill_attention  # noqa: E402
from mini_vllm.attention.metadata import build_attention_metadata  # noqa: E402
from mini_vllm.config import SchedulerConfig  # noqa: E402
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256  # noqa: E402
from mini_vllm.core.sched.scheduler import Scheduler  # noqa: E402
from mini_vllm.request import Request  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402
from mini_vllm.worker.toy_runner import ToyModelRunner, run_engine  # noqa: E402

BLOCK_SIZES = (4, 8, 16, 32, 64)
HEADS, KV_HEADS, HEAD_SIZE = 4, 4, 32
CAPACITY_TOKENS = 512  # GPU cache size for the end-to-end run, the same at every block size
SEQ_LEN = 512  # the sequence brought back in the micro benchmark


def _runner(bs: int, num_gpu_blocks: int, num_cpu_blocks: int) -> ToyModelRunner:
    return ToyModelRunner(bs, num_gpu_blocks, num_cpu_blocks, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, max_model_len=2048)


def _workload(bs: int, seed: int = 0) -> dict[int, list[Request]]:
    """Ten requests, 32-96 prompt tokens and 32-96 output tokens, one arriving per step."""
    init_none_hash(sha256)
    rng = random.Random(seed)
    hasher = get_request_block_hasher(bs, sha256)
    arrivals: dict[int, list[Request]] = {}
    for i in range(10):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randint(32, 96))]
        params = SamplingParams(max_tokens=rng.randint(32, 96), ignore_eos=True)
        request = Request(f"r{i}", prompt, params, eos_token_id=None, block_hasher=hasher)
        arrivals.setdefault(i, []).append(request)
    return arrivals


def _run(mode: str, bs: int, capacity_tokens: int, check: bool) -> dict[str, Any]:
    num_gpu_blocks = capacity_tokens // bs + 1
    num_cpu_blocks = 4 * capacity_tokens // bs + 1
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=2048,
                             block_size=bs, num_gpu_blocks=num_gpu_blocks,
                             enable_prefix_caching=False, preemption_mode=mode,
                             num_cpu_blocks=num_cpu_blocks)
    scheduler = Scheduler(config)
    runner = _runner(bs, num_gpu_blocks, num_cpu_blocks)
    arrivals = _workload(bs)
    requests = [r for rs in arrivals.values() for r in rs]

    def on_step(step, so, sch):
        for request in sch.running:
            state = runner.requests[request.request_id]
            n = request.num_computed_tokens
            k, v = runner.cached_kv(state.block_ids, n)
            ek, ev = runner.expected_kv(state.token_ids[:n])
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                raise AssertionError(f"{mode} bs={bs}: wrong KV for {request.request_id}")

    start = time.perf_counter()
    records = run_engine(scheduler, runner, arrivals, on_step=on_step if check else None)
    seconds = time.perf_counter() - start
    s = scheduler.stats
    block_bytes = 2 * runner.key_cache[0].numel() * runner.key_cache.element_size()
    return {
        "mode": mode, "block_size": bs, "seconds": seconds, "steps": len(records),
        "preemptions": s.num_preemptions, "recomputed_tokens": s.num_recomputed_tokens,
        "blocks_copied": s.num_blocks_swapped_out + s.num_blocks_swapped_in,
        "bytes_copied": (s.num_blocks_swapped_out + s.num_blocks_swapped_in) * block_bytes,
        "outputs": [list(r.output_token_ids) for r in requests],
    }


def check_correctness(bs: int) -> None:
    """Both modes must preempt and must generate exactly what a roomy cache generates."""
    roomy = _run("recompute", bs, 16384, check=False)
    assert roomy["preemptions"] == 0
    for mode in ("recompute", "swap"):
        got = _run(mode, bs, CAPACITY_TOKENS, check=True)
        assert got["preemptions"] > 0, f"{mode} bs={bs}: the workload did not preempt"
        assert got["outputs"] == roomy["outputs"], f"{mode} bs={bs}: different tokens"


def _best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs: on a shared machine, noise only ever adds time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def micro(bs: int, repeats: int) -> dict[str, Any]:
    """Per-token cost of swapping a SEQ_LEN-token sequence out and in, and of recomputing it."""
    num_blocks = SEQ_LEN // bs
    runner = _runner(bs, 2 * num_blocks + 1, num_blocks + 1)
    gpu_ids = list(range(num_blocks + 1, 2 * num_blocks + 1))  # not 0..n: a real table is scattered
    random.Random(bs).shuffle(gpu_ids)
    out_map = torch.tensor([(g, c + 1) for c, g in enumerate(gpu_ids)], dtype=torch.int64)
    in_map = out_map.flip(1).contiguous()

    def swap() -> None:
        swap_blocks(runner.key_cache, runner.cpu_key_cache, out_map)
        swap_blocks(runner.value_cache, runner.cpu_value_cache, out_map)
        swap_blocks(runner.cpu_key_cache, runner.key_cache, in_map)
        swap_blocks(runner.cpu_value_cache, runner.value_cache, in_map)

    tokens = torch.randint(1, 100, (SEQ_LEN,))
    positions = torch.arange(SEQ_LEN)
    md = build_attention_metadata(["s"], {"s": SEQ_LEN}, {"s": 0}, {"s": gpu_ids}, bs)

    def recompute() -> None:
        q = runner.project("q", tokens, positions)
        k = runner.project("k", tokens, positions)
        v = runner.project("v", tokens, positions)
        reshape_and_cache(k, v, runner.key_cache, runner.value_cache, md.slot_mapping)
        chunked_prefill_attention(q, runner.key_cache, runner.value_cache, md)

    return {
        "block_size": bs, "seq_len": SEQ_LEN,
        "swap_us_per_token": _best_time(swap, repeats) / SEQ_LEN * 1e6,
        "recompute_us_per_token": _best_time(recompute, repeats) / SEQ_LEN * 1e6,
    }


def _git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], check=False)
        return out.stdout.strip() or None
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="recompute vs swap (lab 03-03)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a shared 2-core machine: keep timings comparable

    check_correctness(16)
    print("correctness: both modes generate the no-preemption tokens; KV exact every step")

    micro_rows = [micro(bs, args.repeats) for bs in BLOCK_SIZES]
    print(f"\nmicro: bring back one {SEQ_LEN}-token sequence (us per token, best of repeats)")
    print(f"{'block':>6} {'swap out+in':>12} {'recompute':>10}")
    for r in micro_rows:
        print(f"{r['block_size']:>6} {r['swap_us_per_token']:>12.2f} "
              f"{r['recompute_us_per_token']:>10.2f}")

    e2e_rows = []
    for bs in BLOCK_SIZES:
        for mode in ("recompute", "swap"):
            row = _run(mode, bs, CAPACITY_TOKENS, check=False)
            e2e_rows.append({k: v for k, v in row.items() if k != "outputs"})
    print(f"\nend to end: 10 requests, cache of {CAPACITY_TOKENS} tokens (one run each)")
    print(f"{'block':>6} {'mode':>10} {'seconds':>8} {'steps':>6} {'preempt':>8} "
          f"{'recomputed':>11} {'MiB copied':>11}")
    for r in e2e_rows:
        print(f"{r['block_size']:>6} {r['mode']:>10} {r['seconds']:>8.2f} {r['steps']:>6} "
              f"{r['preemptions']:>8} {r['recomputed_tokens']:>11} "
              f"{r['bytes_copied'] / 2**20:>11.1f}")

    if args.json:
        result = {
            "benchmark": "preemption",
            "device": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_revision": _git_revision(),
            "model": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                      "dtype": "float32", "layers": 1},
            "micro": micro_rows,
            "end_to_end": e2e_rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
