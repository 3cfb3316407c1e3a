"""Phase 04's picture: why rejection sampling keeps the target's distribution.

For one draft position with target ``p`` and proposer ``q``, the token emitted is the draft when
it is accepted (probability ``min(p, q)`` of each token, summed over the proposer's choices) or a
token drawn from the recovered distribution ``max(0, p - q)`` after a rejection; the two parts
stack up to ``p`` exactly. The numbers come from mini_vllm's own ``recovered_distribution``.
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from mini_vllm.sample import rejection_sampler

TARGET = [0.45, 0.30, 0.15, 0.10]
PROPOSER = [0.10, 0.20, 0.30, 0.40]


def rejection_sampling() -> Figure:
    """Per token: the proposer's probability, the accepted share ``min(p, q)``, the recovered
    share ``P(reject) * normalise(max(0, p - q))`` stacked on it, and the target's ``p``."""
    p, q = torch.tensor(TARGET, dtype=torch.float64), torch.tensor(PROPOSER, dtype=torch.float64)
    accepted = torch.minimum(p, q)
    reject = 1 - float(accepted.sum())
    recovered = reject * rejection_sampler.recovered_distribution(p, q, 0)
    x = np.arange(len(TARGET))
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    ax.bar(x - 0.2, q.numpy(), width=0.36, color="#bbbbbb", label="q: the proposer drafts")
    ax.bar(x + 0.2, accepted.numpy(), width=0.36, color="#2ca02c",
           label="accepted: min(p, q)")
    ax.bar(x + 0.2, recovered.numpy(), width=0.36, bottom=accepted.numpy(), color="#ff7f0e",
           label=f"recovered after a rejection ({reject:.2f} of the time)")
    ax.scatter(x + 0.2, p.numpy(), marker="_", s=600, color="#1f4e9c", zorder=3,
               label="p: the target")
    ax.set_xticks(x, [f"token {i}" for i in x])
    ax.set_ylabel("probability")
    ax.set_ylim(0, 0.75)  # room for the legend above the bars
    ax.set_title("One draft position: what is emitted adds up to the target")
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
