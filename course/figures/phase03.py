"""Phase 03's pictures: the scheduler's timeline, KV blocks under recompute and swap, the token
budget, and the batch the model sees in a chunked-prefill step.

The scheduler, the runner and the metadata builder are looked up when a function is called
(``scheduler.Scheduler``), so a notebook's ``YOURS`` switch draws the student's pieces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from mini_vllm import request
from mini_vllm.attention import metadata
from mini_vllm.config import SchedulerConfig
from mini_vllm.core import kv_cache_utils
from mini_vllm.core.sched import scheduler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker import toy_runner

STATES = ["absent", "waiting", "prefill chunk", "decode", "preempted", "swapped"]
COLORS = ["white", "#d9d9d9", "#1f4e9c", "#8fb8ff", "#d62728", "#ff9f1c"]
PALETTE = plt.get_cmap("tab10").colors


def workload(block_size: int, seed: int = 0, n: int = 8, gap: int = 2) -> dict[int, list]:
    """``n`` requests: prompts of 8-40 tokens, 6-20 output tokens, one arriving every ``gap``
    steps (``{step: [requests]}``)."""
    kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
    rng = random.Random(seed)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, kv_cache_utils.sha256)
    arrivals: dict[int, list] = {}
    for i in range(n):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randint(8, 40))]
        params = SamplingParams(max_tokens=rng.randint(6, 20), ignore_eos=True)
        req = request.Request(f"r{i}", prompt, params, eos_token_id=None, block_hasher=hasher)
        arrivals.setdefault(gap * i, []).append(req)
    return arrivals


@dataclass
class Run:
    """A finished run of the scheduler with the toy runner: its requests and step records."""

    scheduler: object
    requests: list
    records: list


def run(block_size: int = 4, num_gpu_blocks: int = 24, budget: int = 32, mode: str = "recompute",
        seed: int = 0, n: int = 8, gap: int = 2) -> Run:
    """Run the workload through the scheduler (preemption by ``mode``) and the toy runner."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                             block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                             enable_prefix_caching=False, preemption_mode=mode,
                             num_cpu_blocks=256)
    sched = scheduler.Scheduler(config)
    runner = toy_runner.ToyModelRunner(block_size, num_gpu_blocks, 256, with_kv=False)
    arrivals = workload(block_size, seed, n, gap)
    requests = [r for rs in arrivals.values() for r in rs]
    return Run(sched, requests, toy_runner.run_engine(sched, runner, arrivals))


def timeline_grid(requests, records) -> tuple[list[str], np.ndarray]:
    """One row per request, one column per step: an index into ``STATES``."""
    ids = [r.request_id for r in requests]
    grid = np.zeros((len(ids), len(records)), dtype=int)
    for rec in records:
        for i, rid in enumerate(ids):
            if rid in rec.preempted:
                grid[i, rec.step] = 4
            elif rid in rec.num_scheduled_tokens:
                grid[i, rec.step] = 3 if rec.num_scheduled_tokens[rid] == 1 else 2
            elif rid in rec.swapped:
                grid[i, rec.step] = 5
            elif rid in rec.waiting or rid in rec.running:
                grid[i, rec.step] = 1
    return ids, grid


def draw_timeline(ax, requests, records, title: str) -> None:
    ids, grid = timeline_grid(requests, records)
    ax.pcolormesh(grid, cmap=ListedColormap(COLORS), vmin=-0.5, vmax=len(COLORS) - 0.5,
                  edgecolors="white", linewidth=0.3)
    ax.set_ylim(len(ids), 0)
    ax.set_yticks([i + 0.5 for i in range(len(ids))], ids)
    ax.set_xlabel("step")
    ax.set_title(title)


def legend_handles() -> list[Patch]:
    return [Patch(color=c, label=s) for s, c in zip(STATES[1:], COLORS[1:])]


def timeline(result: Run | None = None) -> Figure:
    """Who runs at each step: prefill chunks, decodes, preemptions (recompute)."""
    result = result or run()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    draw_timeline(ax, result.requests, result.records,
                  "recompute: 24 blocks of 4 tokens, budget 32 tokens/step")
    ax.legend(handles=legend_handles(), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def preemption_modes() -> dict[str, Run]:
    """The same workload with preemption by recompute and by swap."""
    return {mode: run(mode=mode) for mode in ("recompute", "swap")}


def recompute_vs_swap(runs: dict[str, Run] | None = None) -> Figure:
    """GPU blocks in use over time under both modes, and the swap run's timeline."""
    runs = runs or preemption_modes()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1.2, 1]})
    usable = None
    for mode, r in runs.items():
        pool = r.scheduler.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1  # block 0 is the null block
        steps = [rec.step for rec in r.records]
        axes[0].plot(steps, [rec.num_blocks_in_use for rec in r.records], label=mode,
                     drawstyle="steps-post")
        for rec in r.records:
            if rec.preempted:
                axes[0].axvline(rec.step, color="C0" if mode == "recompute" else "C1",
                                alpha=0.25)
    axes[0].axhline(usable, color="k", ls=":", label="usable blocks")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("GPU blocks in use")
    axes[0].legend()
    swap = runs["swap"]
    draw_timeline(axes[1], swap.requests, swap.records, "swap: who runs")
    fig.tight_layout()
    return fig


@dataclass
class BudgetRow:
    budget: int
    steps: int
    tokens_per_step: float
    steps_to_first_token: float


def budget_sweep(budgets=(8, 16, 32, 64, 128, 256, 512)) -> list[BudgetRow]:
    """Twelve requests arrive together in a cache large enough that nobody is preempted; only
    the token budget changes."""
    rows = []
    for budget in budgets:
        r = run(budget=budget, num_gpu_blocks=200, n=12, gap=0)
        prompt_len = {q.request_id: q.num_prompt_tokens for q in r.requests}
        done: dict[str, int] = {}
        first_token: dict[str, int] = {}
        for rec in r.records:
            for rid, n in rec.num_scheduled_tokens.items():
                done[rid] = done.get(rid, 0) + n
                if rid not in first_token and done[rid] >= prompt_len[rid]:
                    first_token[rid] = rec.step + 1  # sampled at the end of this step
        rows.append(BudgetRow(
            budget, len(r.records),
            float(np.mean([sum(rec.num_scheduled_tokens.values()) for rec in r.records])),
            float(np.mean(list(first_token.values()))),
        ))
    return rows


def token_budget(rows: list[BudgetRow] | None = None) -> Figure:
    """Steps to finish, tokens per step and steps to the first token against the budget."""
    rows = rows or budget_sweep()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    series = [("steps to finish", [r.steps for r in rows]),
              ("tokens per step (mean)", [r.tokens_per_step for r in rows]),
              ("steps to first token (mean)", [r.steps_to_first_token for r in rows])]
    for ax, (label, values) in zip(axes, series):
        ax.plot([r.budget for r in rows], values, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_title(label)
    fig.tight_layout()
    return fig


# A step of a chunked-prefill engine, block size 4: A and B decode, C runs the second chunk of
# its prompt, D the first chunk of a new one. Listed in the runner's persistent order; the
# decodes-first reorder moves the decodes to the front.
CHUNKED_BATCH = {
    # request: (tokens already computed, tokens this step, block table)
    "C": (8, 6, [3, 9, 4, 12]),
    "A": (9, 1, [5, 1, 7]),
    "D": (0, 7, [2, 10]),
    "B": (5, 1, [8, 6]),
}


def chunked_batch_metadata(batch: dict | None = None, block_size: int = 4):
    """Lab 03-02's metadata of ``batch`` after the decodes-first reorder."""
    batch = batch or CHUNKED_BATCH
    order = list(batch)
    scheduled = {r: q for r, (_, q, _) in batch.items()}
    metadata.reorder_batch_to_split_decodes_and_prefills(order, scheduled)
    return metadata.build_attention_metadata(
        order, scheduled, {r: c for r, (c, _, _) in batch.items()},
        {r: t for r, (_, _, t) in batch.items()}, block_size,
    )


def chunked_prefill_batch(md=None) -> Figure:
    """The flat batch of one mixed step (decodes first): each new token with its sequence,
    position and cache slot, cut by ``query_start_loc``; below, which keys each query token
    attends to (its own sequence's, up to its position: a causal triangle shifted right by the
    context)."""
    md = md or chunked_batch_metadata()
    qsl = md.query_start_loc.tolist()
    positions = md.positions.tolist()
    slots = md.slot_mapping.tolist()
    seq_lens = md.seq_lens.tolist()
    n = md.num_actual_tokens
    seq_of = [s for s in range(md.num_reqs) for _ in range(qsl[s], qsl[s + 1])]
    key_start = np.concatenate([[0], np.cumsum(seq_lens)]).tolist()
    total_keys = key_start[-1]

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 7.4), gridspec_kw={"height_ratios": [1.05, 3]}
    )
    # The flat batch: one column per new token of the step.
    for t in range(n):
        s = seq_of[t]
        top.add_patch(Rectangle((t, 1), 1, 1, color=PALETTE[s], alpha=0.8, lw=0))
        top.add_patch(Rectangle((t, 1), 1, 1, fill=False, ec="white", lw=1))
        top.text(t + 0.5, 1.5, str(positions[t]), ha="center", va="center", fontsize=8)
        top.text(t + 0.5, 0.5, str(slots[t]), ha="center", va="center", fontsize=7)
    top.vlines(qsl, 0, 2.05, color="black", lw=1.2)
    for s, start in enumerate(qsl):
        top.text(start, 2.2, str(start), ha="center", fontsize=8)
        if s < md.num_reqs:
            kind = "decode" if s < md.num_decodes else "prefill"
            top.text((qsl[s] + qsl[s + 1]) / 2, 2.75,
                     f"{md.req_ids[s]} {kind}\nctx {int(md.context_lens[s])} "
                     f"+{int(md.query_lens[s])}", ha="center", fontsize=7)
    top.text(-0.3, 1.5, "position", ha="right", va="center", fontsize=8)
    top.text(-0.3, 0.5, "slot_mapping", ha="right", va="center", fontsize=8)
    top.text(-0.3, 2.25, "query_start_loc", ha="right", fontsize=8)
    top.set_xlim(-4, n + 0.5)
    top.set_ylim(0, 3.6)
    top.axis("off")

    # The attention each query token computes: rows are the flat tokens, columns every
    # sequence's keys (positions 0 .. seq_len - 1), grouped by sequence.
    # 0: another sequence's key, 1: own key but masked, 2 + s: attended by sequence s.
    grid = np.zeros((n, total_keys), dtype=int)
    for t in range(n):
        s = seq_of[t]
        for j in range(seq_lens[s]):
            grid[t, key_start[s] + j] = 2 + s if j <= positions[t] else 1
    cmap = ListedColormap(["white", "#e6e6e6", *[PALETTE[s] for s in range(md.num_reqs)]])
    bottom.pcolormesh(grid, cmap=cmap, vmin=-0.5, vmax=md.num_reqs + 1.5, alpha=0.8,
                      edgecolors="white", linewidth=0.4)
    bottom.set_ylim(n, 0)
    for s in range(md.num_reqs):
        bottom.axvline(key_start[s], color="black", lw=0.8)
        bottom.axhline(qsl[s], color="black", lw=0.8)
        ctx = int(md.context_lens[s])
        if ctx:
            bottom.add_patch(Rectangle((key_start[s], qsl[s]), ctx, qsl[s + 1] - qsl[s],
                                       fill=False, hatch="///", ec="0.35", lw=0))
    bottom.set_yticks([t + 0.5 for t in range(n)],
                      [f"{md.req_ids[seq_of[t]]} pos {positions[t]}" for t in range(n)],
                      fontsize=7)
    bottom.set_xticks([key_start[s] + seq_lens[s] / 2 for s in range(md.num_reqs)],
                      [f"{md.req_ids[s]}'s keys 0..{seq_lens[s] - 1}"
                       for s in range(md.num_reqs)], fontsize=8)
    bottom.set_title("keys each query token attends to (hatched: the context, read from the "
                     "paged cache; grey: masked)", fontsize=9)
    fig.tight_layout()
    return fig
