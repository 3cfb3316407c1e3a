"""Tensor parallelism on a CPU, measured, and the same split on paper over real interconnects.

For each model, tensor-parallel size and batch size, ``--batch`` greedy requests decode
``--tokens`` tokens each (after a 5-token prompt) on ``LLM(tensor_parallel_size=tp)``; the
tokens must equal tp 1's. Measured on rank 0 (the engine's process): milliseconds per decode
step, the all-reduces per step and their payload bytes per token, and the time spent inside
them. Each figure is the best of ``--repeats`` runs.

On paper: a decode step at tp ranks costs the tp-1 step's compute split ``tp`` ways plus its
all-reduces, each ``latency + 2 (tp-1)/tp * payload / bandwidth`` (a ring all-reduce sends and
receives that much per rank). Bandwidths are the links' specifications per direction; the
latencies are assumptions of this model (a small all-reduce's fixed cost), written beside them.
The point the table makes: a decode step's payload is a few kilobytes, so the fixed cost of each
of its ``2 x layers + 1`` all-reduces, not bandwidth, decides whether splitting pays.

    python benchmarks/tensor_parallel.py --json benchmarks/results/tensor_parallel.json
    python benchmarks/tensor_parallel.py --eager \
        --json benchmarks/results/tensor_parallel_eager.json
    python benchmarks/tensor_parallel.py --model smollm2 --tp 1 3 \
        --json benchmarks/results/tensor_parallel_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.distributed import parallel_state  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

PROMPT = [5, 6, 7, 8, 9]
# name: (bandwidth per direction in GB/s, from the specification; latency in µs, assumed)
LINKS = {
    "NVLink 4 (H100 SXM, 18 links)": (450.0, 10.0),
    "PCIe 5.0 x16": (64.0, 20.0),
    "100 Gb Ethernet (RDMA)": (12.5, 30.0),
}


def run(llm: LLM, batch: int, tokens: int) -> dict:
    """One timed decode of ``batch`` requests; rank 0's counters over it."""
    group = parallel_state.get_tp_group()
    spent = [0.0]
    reduce = group.all_reduce

    def timed(x):
        start = time.perf_counter()
        try:
            return reduce(x)
        finally:
            spent[0] += time.perf_counter() - start

    group.all_reduce = timed
    before = (group.stats.all_reduces, group.stats.all_reduce_bytes)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del group.all_reduce
    steps = llm.last_stats.num_steps
    return {"seconds": elapsed, "steps": steps, "in_all_reduce_s": spent[0],
            "all_reduces": group.stats.all_reduces - before[0],
            "all_reduce_bytes": group.stats.all_reduce_bytes - before[1],
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def on_paper(step_ms_tp1: float, tp: int, per_step: int, payload_bytes: int) -> dict:
    """A decode step at ``tp`` ranks on each link: compute split ``tp`` ways, plus
    ``per_step`` all-reduces of ``payload_bytes`` each."""
    out = {}
    for name, (gb_s, latency_us) in LINKS.items():
        wire = 2 * (tp - 1) / tp * payload_bytes
        reduce_ms = latency_us / 1e3 + wire / (gb_s * 1e9) * 1e3
        out[name] = {"step_ms": step_ms_tp1 / tp + per_step * reduce_ms,
                     "all_reduce_us": reduce_ms * 1e3}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="LLM's model (default: the shipped one)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true",
                   help="every engine op by op (enforce_eager): tp 1 without the fused decode "
                   "step, which a tensor-parallel shard never takes")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.tp[0] != 1:
        p.error("--tp must start with 1: every other size is compared with it")

    rows, expected = [], {}
    for tp in args.tp:
        llm = LLM(args.model, tensor_parallel_size=tp, num_gpu_blocks=512,
                  enforce_eager=args.eager)
        cfg = llm.model.config
        try:
            for batch in args.batch:
                run(llm, batch, 4)  # warm-up
                best = min((run(llm, batch, args.tokens) for _ in range(args.repeats)),
                           key=lambda r: r["seconds"])
                if tp == 1:
                    expected[batch] = best["tokens"]
                elif best["tokens"] != expected[batch]:
                    raise SystemExit(f"tp={tp} batch={batch}: tokens differ from tp=1")
                decode_steps = best["steps"] - 1  # the first step is the prefill
                rows.append({
                    "tp": tp, "batch": batch, "steps": best["steps"],
                    "step_ms": best["seconds"] / best["steps"] * 1e3,
                    "all_reduces_per_step": best["all_reduces"] / best["steps"],
                    "all_reduce_bytes_per_token": (
                        best["all_reduce_bytes"] / (batch * (len(PROMPT) + decode_steps))
                        if tp > 1 else 0),
                    "in_all_reduce_ms_per_step": best["in_all_reduce_s"] / best["steps"] * 1e3,
                })
        finally:
            llm.engine.shutdown()
    per_step = 2 * cfg.num_hidden_layers + 1
    for row in rows:
        base = next(r for r in rows if r["tp"] == 1 and r["batch"] == row["batch"])
        row["on_paper"] = (on_paper(base["step_ms"], row["tp"], per_step,
                                    row["batch"] * cfg.hidden_size * 4) if row["tp"] > 1 else {})

    print(f"model {args.model or 'shipped'}: {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}; {per_step} all-reduces a step, each batch x hidden x 4 bytes")
    print(f"{'tp':>3} {'batch':>5} {'ms/step':>8} {'in all-reduce':>14} {'bytes/token':>12}")
    for r in rows:
        print(f"{r['tp']:>3} {r['batch']:>5} {r['step_ms']:>8.2f} "
              f"{r['in_all_reduce_ms_per_step']:>11.2f} ms "
              f"{r['all_reduce_bytes_per_token']:>12.0f}")
    for r in rows:
        for name, paper in r["on_paper"].items():
            print(f"  on paper, tp {r['tp']}, batch {r['batch']}, {name}: "
                  f"{paper['step_ms']:.2f} ms/step ({paper['all_reduce_us']:.1f} µs an all-reduce)")
    write_result(args.json, "tensor_parallel.py", environment(), {
        "model": args.model or "shipped", "tokens": args.tokens, "eager": args.eager,
        "links": {k: {"bandwidth_gb_s_per_direction": v[0], "assumed_latency_us": v[1]}
                  for k, v in LINKS.items()},
        "rows": rows})


if __name__ == "__main__":
    main()
