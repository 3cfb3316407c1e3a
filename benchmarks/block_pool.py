"""Benchmark mini_vllm's BlockPool: get_new_blocks(n) then free_blocks, as upstream measures it.

The workload is upstream's ``benchmarks/benchmark_block_pool.py`` (v0.11.0): a pool of 100,000
blocks with prefix caching on; for each n in 10, 50, 100, 500, 1000, 1,000 iterations of
``blocks = pool.get_new_blocks(n)`` then ``pool.free_blocks(blocks)``, each call timed on its own
with ``time.perf_counter_ns``; the table reports the average and the maximum microseconds per
call, plus the median, and with ``--repeats R`` the average of the best of R rounds (on a busy
machine the mean is dominated by a few calls that lost the CPU). Correctness is checked first
(block ids, reference counts, free-queue order, the same for both implementations).

Run it from the repository root::

    python benchmarks/block_pool.py                      # mini_vllm only (course venv)
    python benchmarks/block_pool.py --json benchmarks/results/block_pool.json

Against upstream (same process, alternating iteration by iteration, so both see the same machine
noise; each "ratio" row divides mini_vllm's figure by upstream's, below 1 = mini_vllm faster)::

    python benchmarks/block_pool.py --vllm-src /root/.cache/vllm-src/v0.11.0 --repeats 5 \
        --json benchmarks/results/block_pool.json

``--vllm-src`` imports ``vllm.v1.core.block_pool`` from a vLLM *source tree* (for example the one
``../shared/tools/get-vllm-src.sh 0.11.0`` prints). That import needs a few of vLLM's
dependencies, which must never go into the course's own environment. Use a separate virtualenv
outside the repository, e.g.::

    python3.11 -m venv /root/upstream-venv
    /root/upstream-venv/bin/pip install torch==2.13.0 cachetools cbor2 cloudpickle psutil \\
        regex setproctitle pyyaml pyzmq transformers msgspec aiohttp requests blake3 pillow \\
        prometheus_client fastapi openai openai_harmony pybase64 diskcache py-cpuinfo
    /root/upstream-venv/bin/python benchmarks/block_pool.py --vllm-src DIR --json OUT.json

(torch is the CPU wheel; the import takes ~30 s and prints one "No platform detected" line.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mini_vllm.core.block_pool import BlockPool as MiniBlockPool  # noqa: E402


def load_upstream_block_pool(vllm_src: Path) -> type:
    """Import upstream's BlockPool from a source tree (its own dependencies must be installed)."""
    if not (vllm_src / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        raise SystemExit(f"--vllm-src {vllm_src}: no vllm/v1/core/block_pool.py there")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(vllm_src))
    try:
        from vllm.v1.core.block_pool import BlockPool
    except ImportError as exc:
        raise SystemExit(
            f"cannot import upstream's BlockPool from {vllm_src} ({exc}). Run this script with a "
            "separate environment that has vLLM's light dependencies (see --help)."
        ) from None
    return BlockPool


def check_correctness(pool_cls: type, num_blocks: int, n: int) -> list[int]:
    """Allocate n, free them, allocate again: return the second allocation's ids (the queue
    order after a round trip). Also checks counts and reference counts on the way."""
    pool = pool_cls(num_gpu_blocks=num_blocks, enable_caching=True)
    blocks = pool.get_new_blocks(n)
    assert [b.block_id for b in blocks] == list(range(1, n + 1)), "allocation order"
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == num_blocks - 1 - n
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == num_blocks - 1
    again = pool.get_new_blocks(n)
    pool.free_blocks(again)
    return [b.block_id for b in again]


def time_row(pools: dict[str, Any], n: int, iterations: int) -> dict[str, dict[str, list[int]]]:
    """Time get_new_blocks(n) and free_blocks for every pool, alternating which goes first."""
    times = {name: {"get": [], "free": []} for name in pools}
    names = list(pools)
    clock = time.perf_counter_ns
    for i in range(iterations):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            pool = pools[name]
            t0 = clock()
            blocks = pool.get_new_blocks(n)
            t1 = clock()
            pool.free_blocks(blocks)
            t2 = clock()
            times[name]["get"].append(t1 - t0)
            times[name]["free"].append(t2 - t1)
    return times


def summarize(rounds: list[list[int]]) -> dict[str, float]:
    """Microseconds per call: the mean of all calls (upstream's "avg"), the mean of the best
    round (timeit's practice: the round least disturbed by other processes), the median and
    the maximum of all calls."""
    every = [ns for r in rounds for ns in r]
    return {
        "avg_us": statistics.fmean(every) / 1e3,
        "best_round_avg_us": min(statistics.fmean(r) for r in rounds) / 1e3,
        "median_us": statistics.median(every) / 1e3,
        "max_us": max(every) / 1e3,
        "calls": len(every),
    }


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=100_000)
    parser.add_argument("--num-iteration", type=int, default=1000)
    parser.add_argument("--allocate-blocks", type=int, nargs="+", default=[10, 50, 100, 500, 1000])
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of --num-iteration iterations per row (default 1, as upstream); with more, "
        "'best' is the lowest round average",
    )
    parser.add_argument("--vllm-src", type=Path, default=None, help="upstream source tree")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.num_gpu_blocks < 2 or args.num_iteration < 1 or args.repeats < 1:
        parser.error("--num-gpu-blocks must be >= 2, --num-iteration and --repeats >= 1")
    too_big = [n for n in args.allocate_blocks if not 0 < n < args.num_gpu_blocks]
    if too_big:
        parser.error(f"--allocate-blocks {too_big}: each must be in 1..{args.num_gpu_blocks - 1}")

    impls: dict[str, type] = {"mini_vllm": MiniBlockPool}
    if args.vllm_src is not None:
        impls["upstream"] = load_upstream_block_pool(args.vllm_src.resolve())

    for n in args.allocate_blocks:
        orders = {
            name: check_correctness(cls, args.num_gpu_blocks, n) for name, cls in impls.items()
        }
        if len(set(map(tuple, orders.values()))) != 1:
            raise SystemExit(f"n={n}: implementations disagree on the free-queue order")

    rows = []
    for n in args.allocate_blocks:
        pools = {
            name: cls(num_gpu_blocks=args.num_gpu_blocks, enable_caching=True)
            for name, cls in impls.items()
        }
        rounds = []
        for _ in range(args.repeats):
            gc.collect()  # as upstream: start every round from a collected heap
            rounds.append(time_row(pools, n, args.num_iteration))
        row: dict[str, Any] = {"allocate_blocks": n}
        for name in impls:
            row[name] = {op: summarize([r[name][op] for r in rounds]) for op in ("get", "free")}
        if "upstream" in impls:
            for stat in ("avg_us", "best_round_avg_us", "median_us"):
                row[f"ratio_{stat[:-3]}"] = {
                    op: row["mini_vllm"][op][stat] / row["upstream"][op][stat]
                    for op in ("get", "free")
                }
        rows.append(row)

    print_table(rows, impls, args)
    if args.json is not None:
        result = {
            "benchmark": "block_pool",
            "workload": "upstream benchmarks/benchmark_block_pool.py (v0.11.0)",
            "num_gpu_blocks": args.num_gpu_blocks,
            "num_iteration": args.num_iteration,
            "repeats": args.repeats,
            "enable_caching": True,
            "implementations": list(impls),
            "vllm_src": str(args.vllm_src) if args.vllm_src else None,
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                "python": sys.version.split()[0],
            },
            "git_revision": git_revision(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def print_table(rows: list[dict[str, Any]], impls: dict[str, type], args) -> None:
    stats = [("avg", "avg_us"), ("best", "best_round_avg_us"), ("med", "median_us")]
    header = ["n", "impl"]
    for op in ("get", "free"):
        header += [f"{op} {label}" for label, _ in stats] + [f"{op} max"]
    lines = []
    for row in rows:
        for name in impls:
            cells = [str(row["allocate_blocks"]), name]
            for op in ("get", "free"):
                r = row[name][op]
                cells += [f"{r[key]:.2f}" for _, key in stats] + [f"{r['max_us']:.1f}"]
            lines.append(cells)
        if "upstream" in impls:
            cells = ["", "ratio"]
            for op in ("get", "free"):
                cells += [f"{row['ratio_' + key[:-3]][op]:.3f}" for _, key in stats] + [""]
            lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    print(
        f"BlockPool: {args.num_gpu_blocks} blocks, caching on, {args.repeats} x "
        f"{args.num_iteration} iterations of get_new_blocks(n) then free_blocks; us per call "
        "(avg: all calls; best: best round's avg; med: median)"
    )
    if "upstream" in impls:
        print("ratio = mini_vllm / upstream (below 1: mini_vllm is faster)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for cells in lines:
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))


if __name__ == "__main__":
    raise SystemExit(main())
