"""How much KV-cache memory sharing saves, for parallel sampling and beam search (lab 02-05).

Every request of a synthetic trace runs alone on a real KV cache manager with fork and
copy-on-write (``mini_vllm.block_sharing.SharingKVCacheManager``), one decode step at a time:

* **parallel sampling, n samples**: the prompt is prefilled once, the request is forked into
  ``n`` sequences, and each sample decodes until its own output length (drawn per sample);
* **beam search, width k**: the prompt is prefilled once and forked into ``k`` beams; after every
  step each beam proposes ``k`` continuations with random log-probabilities and the ``k`` best
  candidates by cumulative log-probability survive: a beam with no survivor is freed, a beam
  with ``m`` survivors continues as one of them and is forked ``m - 1`` times. All beams stop
  together.

At every step we count the blocks actually held (shared blocks once) and the blocks the same
sequences would hold without sharing (the sum of their block-table lengths). The saving is
``1 - sum(held) / sum(unshared)`` over all steps of all requests: the fraction of block-steps
that sharing removes. Copy-on-write is included (a copied block counts for each holder).

Two traces: ``short`` prompts (lengths like the Alpaca trace of the PagedAttention paper: a few
dozen prompt tokens, longer outputs) and ``long`` prompts (a few hundred prompt tokens, as with
a system prompt or a document). Lengths are drawn from log-normal distributions with a fixed
seed; nothing is read from disk.

    python benchmarks/sharing.py                       # print the table
    python benchmarks/sharing.py --json benchmarks/results/sharing.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm.block_sharing import SharingKVCacheManager as KVCacheManager  # noqa: E402
from mini_vllm.request import Request  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
MAX_LEN = 2048

# name -> (prompt median, prompt sigma, output median, output sigma), log-normal in tokens
TRACES = {
    "short": (20, 0.6, 60, 0.8),
    "long": (400, 0.5, 120, 0.8),
}


@dataclass
class Row:
    trace: str
    mode: str  # "parallel" or "beam"
    width: int  # n or k
    requests: int
    mean_prompt: float
    mean_output: float
    saved: float  # fraction of block-steps saved by sharing
    copies: int  # copy-on-write block copies performed


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def make_trace(name: str, num_requests: int, seed: int) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` pairs."""
    p_med, p_sig, o_med, o_sig = TRACES[name]
    rng = random.Random(seed)
    return [
        (lognormal_int(rng, p_med, p_sig, 1, 1024), lognormal_int(rng, o_med, o_sig, 1, 512))
        for _ in range(num_requests)
    ]


class Meter:
    """Counts held and unshared block-steps on one manager."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.held = 0
        self.unshared = 0
        self.copies = 0

    def sample(self, live: dict[str, Request]) -> None:
        pool = self.mgr.block_pool
        self.held += pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        self.unshared += sum(len(self.mgr.req_to_blocks[rid]) for rid in live)


def _request(rid: str, tokens: list[int], num_prompt: int) -> Request:
    req = Request(rid, tokens[:num_prompt], SamplingParams(max_tokens=MAX_LEN), None)
    if len(tokens) > num_prompt:
        req.append_output_token_ids(tokens[num_prompt:])
    return req


def _fork(mgr: KVCacheManager, parent: Request, child_id: str, token: int) -> Request:
    n = parent.num_computed_tokens
    tokens = list(parent.all_token_ids[:n]) + [token]
    child = _request(child_id, tokens, parent.num_prompt_tokens)
    child.num_computed_tokens = n
    mgr.fork(parent, child)
    return child


def _step(mgr: KVCacheManager, meter: Meter, req: Request, token: int) -> None:
    copies = mgr.append_slots(req, 1)
    assert copies is not None, "the manager is sized for one request; it cannot run out"
    meter.copies += len(copies)
    req.num_computed_tokens += 1
    req.append_output_token_ids(token)


def _new_manager(width: int, prompt: int, output: int) -> KVCacheManager:
    per_seq = -(-(prompt + output + 1) // BLOCK_SIZE) + 1
    return KVCacheManager(2 + 2 * width * per_seq, BLOCK_SIZE, MAX_LEN, enable_caching=False)


def _prefill(mgr: KVCacheManager, prompt: int, rng: random.Random) -> Request:
    root = _request("r0", [rng.randrange(1000) for _ in range(prompt)], prompt)
    assert mgr.allocate_slots(root, prompt) is not None
    root.num_computed_tokens = prompt
    root.append_output_token_ids(rng.randrange(1000))
    return root


def run_parallel(mgr: KVCacheManager, meter: Meter, n: int, prompt: int, out_med: float,
                 out_sig: float, rng: random.Random) -> None:
    root = _prefill(mgr, prompt, rng)
    live = {"r0": root}
    for i in range(1, n):
        live[f"r{i}"] = _fork(mgr, root, f"r{i}", rng.randrange(1000))
    # Each sample stops at its own length: samples of one prompt differ in length too.
    stop = {rid: lognormal_int(rng, out_med, out_sig, 1, 512) for rid in live}
    generated = dict.fromkeys(live, 1)
    while live:
        meter.sample(live)
        for rid in list(live):
            if generated[rid] >= stop[rid]:
                mgr.free(live.pop(rid))
                continue
            _step(mgr, meter, live[rid], rng.randrange(1000))
            generated[rid] += 1


def run_beam(mgr: KVCacheManager, meter: Meter, k: int, prompt: int, output: int,
             rng: random.Random) -> None:
    root = _prefill(mgr, prompt, rng)
    beams = [root] + [_fork(mgr, root, f"r{i}", rng.randrange(1000)) for i in range(1, k)]
    scores = [0.0] * k  # cumulative log-probability of each beam
    next_id = k
    for _ in range(output - 1):
        meter.sample({b.request_id: b for b in beams})
        for beam in beams:
            _step(mgr, meter, beam, rng.randrange(1000))
        # Pruning: each beam proposes k continuations with random log-probabilities; the k
        # best candidates overall survive. A beam may have several survivors, or none.
        candidates = sorted(
            ((scores[i] - rng.expovariate(1.0), i) for i in range(len(beams)) for _ in range(k)),
            reverse=True,
        )[:k]
        survivors, new_scores = [], []
        for score, i in sorted(candidates, key=lambda c: c[1]):
            beam = beams[i]
            if beam in survivors:  # a second survivor of the same beam: a fork
                beam = _fork(mgr, beam, f"r{next_id}", rng.randrange(1000))
                next_id += 1
            survivors.append(beam)
            new_scores.append(score)
        picked = {i for _, i in candidates}
        for i, beam in enumerate(beams):
            if i not in picked:
                mgr.free(beam)
        beams, scores = survivors, new_scores
    meter.sample({b.request_id: b for b in beams})
    for beam in beams:
        mgr.free(beam)


def measure(trace: str, mode: str, width: int, num_requests: int, seed: int) -> Row:
    pairs = make_trace(trace, num_requests, seed)
    _, _, o_med, o_sig = TRACES[trace]
    rng = random.Random(seed + 1)
    held = unshared = copies = 0
    for prompt, output in pairs:
        mgr = _new_manager(width, prompt, 512 if mode == "parallel" else output)
        meter = Meter(mgr)
        if mode == "parallel":
            run_parallel(mgr, meter, width, prompt, o_med, o_sig, rng)
        else:
            run_beam(mgr, meter, width, prompt, output, rng)
        # Everything was freed: sharing left no block behind.
        assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_gpu_blocks - 1
        held, unshared, copies = held + meter.held, unshared + meter.unshared, copies + meter.copies
    return Row(
        trace=trace, mode=mode, width=width, requests=num_requests,
        mean_prompt=sum(p for p, _ in pairs) / len(pairs),
        mean_output=sum(o for _, o in pairs) / len(pairs),
        saved=1.0 - held / unshared, copies=copies,
    )


def _git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    rows = [
        measure(trace, mode, width, args.requests, args.seed)
        for trace in TRACES
        for mode in ("parallel", "beam")
        for width in (2, 4, 6)
    ]
    print(f"block_size={BLOCK_SIZE}, {args.requests} requests per trace, seed {args.seed}")
    header = ("trace", "prompt", "output", "mode", "n/k", "saved", "copies")
    print("{:6} {:>7} {:>7} {:9} {:>3} {:>7} {:>7}".format(*header))
    for r in rows:
        print(f"{r.trace:6} {r.mean_prompt:7.1f} {r.mean_output:7.1f} {r.mode:9} {r.width:3d} "
              f"{100 * r.saved:6.1f}% {r.copies:7d}")
    if args.json:
        result = {
            "benchmark": "sharing",
            "block_size": BLOCK_SIZE,
            "seed": args.seed,
            "device": "none (block accounting only)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "git_revision": _git_revision(),
            "rows": [asdict(r) for r in rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
