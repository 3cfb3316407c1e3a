"""Serving under load (lab 03-06): normalised latency against request rate, one curve per KV
policy, and the distribution of the time to first token at one rate, from committed runs of
``benchmarks/load_latency.py``.

The figures draw measured numbers, not a scenario: they read
``benchmarks/results/load_latency.json`` and ``load_ttft.json`` (each holds the command that made
it), so they change only when those runs are made again.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from course.labs.catalog import REPO_ROOT
from mini_vllm.benchmarks.serve import nearest_rank

RESULTS = REPO_ROOT / "benchmarks" / "results" / "load_latency.json"
TTFT_RESULTS = REPO_ROOT / "benchmarks" / "results" / "load_ttft.json"
STYLES = {
    "paged": ("paged + continuous batching (vLLM)", "#1f4e9c", "o"),
    "oracle": ("reserve the oracle length", "#2ca02c", "s"),
    "pow2": ("reserve the next power of two", "#ff9f1c", "^"),
    "max": ("reserve max_model_len (Orca, max)", "#d62728", "v"),
    "static": ("static batching, reserve max (FasterTransformer)", "#7f7f7f", "x"),
}


def latency_vs_rate(path: Path = RESULTS) -> Figure:
    """Normalised latency (s per output token) against request rate, one curve per setting,
    with the threshold at which the sustained rates (in the legend) are compared."""
    run = json.loads(Path(path).read_text(encoding="utf-8"))
    config = run["config"]
    threshold = config["threshold_s_per_token"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, curve in run["curves"].items():
        label, color, marker = STYLES.get(name, (name, "black", "."))
        rates = [p["rate"] for p in curve["points"]]
        latency = [p["normalized_latency"] for p in curve["points"]]
        sustained = curve["sustained_rate"]
        if sustained is None:
            label += f": < {rates[0]:g} req/s"
        elif all(value < threshold for value in latency):
            label += f": >= {sustained:g} req/s (never crossed)"
        else:
            label += f": {sustained:.1f} req/s"
        ax.plot(rates, latency, marker=marker, color=color, label=label)
    ax.axhline(threshold, color="black", linestyle=":", linewidth=1)
    ax.text(ax.get_xlim()[1], threshold, f"threshold {threshold} s/token ",
            ha="right", va="bottom", fontsize=8)
    ax.set_ylim(0, 2.5 * threshold)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("normalised latency (s / output token)")
    ax.set_title(
        f"ShareGPT-shaped trace x{config['scale']}, {config['num_gpu_blocks'] - 1} KV blocks of "
        f"{config['block_size']} tokens, max_model_len {config['max_model_len']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def ttft_cdf(path: Path = TTFT_RESULTS) -> Figure:
    """The empirical distribution (CDF) of every request's time to first token at the run's
    ``ttft_rate``, one step curve per setting, on a log time axis (queueing behind reservations
    stretches the tail by orders of magnitude); the legend gives each median and p90."""
    run = json.loads(Path(path).read_text(encoding="utf-8"))
    config = run["config"]
    rate = config["ttft_rate"]
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for name, curve in run["curves"].items():
        ttfts = next((p["ttfts"] for p in curve["points"] if p.get("ttfts")), None)
        if not ttfts:
            continue  # this setting's curve stopped before the rate (past its knee)
        label, color, _ = STYLES.get(name, (name, "black", "."))
        n = len(ttfts)
        median, p90 = (ttfts[nearest_rank(p, n) - 1] for p in (50, 90))
        ax.step(ttfts, [(i + 1) / n for i in range(n)], where="post", color=color,
                label=f"{label}: median {_seconds(median)}, p90 {_seconds(p90)}")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(
        f"TTFT at {rate:g} req/s (Poisson), {config['num_requests']} ShareGPT-shaped requests, "
        f"{config['num_gpu_blocks'] - 1} KV blocks of {config['block_size']} tokens", fontsize=9)
    # Below the axes: the curves fill the plot from left to right.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
