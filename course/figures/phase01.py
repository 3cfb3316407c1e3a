"""Phase 01's pictures: the causal mask, the online-softmax state, the flat cache's waste.

Every function looks the course's pieces up when it is called (``reference.causal_mask``, not a
name imported at load time), so that a notebook's ``YOURS`` switch, which rebinds the names in
``mini_vllm``, draws the student's pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from mini_vllm.attention import online_softmax as osm
from mini_vllm.attention import reference

# Errors below this are float64 rounding; they are drawn on this floor so that the picture does
# not depend on the last bits a particular CPU's kernels produce.
ROUNDING_FLOOR = 1e-12


def _mask_panel(ax, mask: torch.Tensor, title: str) -> None:
    q_len, kv_len = mask.shape
    ax.pcolormesh(mask.float().numpy(), cmap="Greens", vmin=0, vmax=1.4, edgecolors="white",
                  linewidth=0.5)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key position")
    ax.set_ylabel("query (absolute position)")
    ax.set_xticks([j + 0.5 for j in range(kv_len)], [str(j) for j in range(kv_len)])
    ax.set_yticks([i + 0.5 for i in range(q_len)],
                  [f"q{i} ({kv_len - q_len + i})" for i in range(q_len)])
    for i in range(q_len):
        for j in range(kv_len):
            if not mask[i, j]:
                ax.text(j + 0.5, i + 0.5, "-inf", ha="center", va="center", fontsize=7)


def masks() -> Figure:
    """The causal mask of a prefill and of a chunk after a context (aligned bottom-right), and an
    ALiBi bias under the mask (lab 01-01)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    cases = [("prefill: q_len 6, kv_len 6", 6, 6),
             ("chunk after a context: q_len 3, kv_len 8", 3, 8)]
    for ax, (title, q_len, kv_len) in zip(axes, cases):
        _mask_panel(ax, reference.causal_mask(q_len, kv_len), title)

    q_len, kv_len = 3, 8
    bias = reference.alibi_bias(reference.alibi_slopes(8), q_len, kv_len)[0]  # head 0, slope 1/2
    shown = bias.masked_fill(~reference.causal_mask(q_len, kv_len), float("nan"))
    ax = axes[2]
    mesh = ax.pcolormesh(shown.numpy(), cmap="viridis", edgecolors="white", linewidth=0.5)
    ax.invert_yaxis()
    ax.set_title("ALiBi bias + mask, head 0 (slope 0.5)", fontsize=10)
    ax.set_xlabel("key position")
    ax.set_xticks([j + 0.5 for j in range(kv_len)], [str(j) for j in range(kv_len)])
    ax.set_yticks([i + 0.5 for i in range(q_len)],
                  [f"q{i} ({kv_len - q_len + i})" for i in range(q_len)])
    fig.colorbar(mesh, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


@dataclass
class OnlineSoftmaxRun:
    """One query row read block by block: the scores, and the state after each block."""

    scores: torch.Tensor
    block: int
    ends: list[int]
    max_logit: list[float]
    exp_sum: list[float]
    rescaled: list[bool]
    error: list[float]  # max |acc / l - softmax(s) V| after each block


def online_softmax_run(num_keys: int = 32, block: int = 4, head_size: int = 8,
                       seed: int = 0) -> OnlineSoftmaxRun:
    """Feed ``num_keys`` keys to the online softmax ``block`` at a time (lab 01-02)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_keys, generator=gen, dtype=torch.float64) * 2.0
    scores[13] = scores.max() + 1.5  # a late, larger score forces a rescale
    values = torch.randn(num_keys, head_size, generator=gen, dtype=torch.float64)
    final = torch.softmax(scores, dim=0) @ values

    state = osm.SoftmaxState.initial((1,), head_size, dtype=torch.float64)
    run = OnlineSoftmaxRun(scores, block, [], [], [], [], [])
    for start in range(0, num_keys, block):
        old_max = float(state.max_logit[0])
        state = osm.online_update(state, scores[None, start:start + block],
                                  values[None, start:start + block])
        partial = osm.finalize(state)
        run.ends.append(start + block)
        run.max_logit.append(float(state.max_logit[0]))
        run.exp_sum.append(float(state.exp_sum[0]))
        run.rescaled.append(start > 0 and float(state.max_logit[0]) > old_max)
        run.error.append(float((partial.out[0] - final).abs().max()))
    return run


def online_softmax(run: OnlineSoftmaxRun | None = None) -> Figure:
    """The running max, the running sum (rescaled when a larger score arrives) and the distance
    of the partial output from full softmax, block after block."""
    run = run or online_softmax_run()
    num_keys = len(run.scores)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    axes[0].bar(range(num_keys), run.scores.numpy(), color="tab:blue")
    for b in range(run.block, num_keys, run.block):
        axes[0].axvline(b - 0.5, color="gray", lw=0.6)
    axes[0].set_title("scores (gray lines: block edges)", fontsize=10)
    axes[0].set_xlabel("key")
    axes[1].step(run.ends, run.max_logit, where="post")
    axes[1].set_title("running max m", fontsize=10)
    axes[2].plot(run.ends, run.exp_sum, marker="o")
    for end, m, s, rescaled in zip(run.ends, run.max_logit, run.exp_sum, run.rescaled):
        if rescaled:
            axes[1].plot(end, m, "o", color="tab:red")
            axes[2].plot(end, s, "o", color="tab:red")
    axes[2].set_title("running sum l (red: rescaled)", fontsize=10)
    axes[3].semilogy(run.ends, [max(e, ROUNDING_FLOOR) for e in run.error], marker="o")
    axes[3].axhline(ROUNDING_FLOOR, color="gray", ls=":", lw=0.8)
    axes[3].set_title("max |acc/l - softmax(s) V|", fontsize=10)
    axes[3].set_ylim(ROUNDING_FLOOR / 10, 10)
    for ax in axes[1:]:
        ax.set_xlabel("keys seen")
    fig.tight_layout()
    return fig


@dataclass
class FlatCacheBatch:
    """A long-tailed batch on a Llama-8B-like model: what a flat cache reserves and uses."""

    final_lens: torch.Tensor  # sorted, longest first
    bytes_per_token: int
    max_seq_len: int
    block_size: int

    def mib(self, tokens: torch.Tensor | float) -> torch.Tensor:
        return torch.as_tensor(tokens, dtype=torch.float64) * self.bytes_per_token / 2**20

    @property
    def reserved(self) -> torch.Tensor:
        return self.mib(torch.full((len(self.final_lens),), float(self.max_seq_len)))

    @property
    def used(self) -> torch.Tensor:
        return self.mib(self.final_lens.double())

    @property
    def paged(self) -> torch.Tensor:
        blocks = torch.ceil(self.final_lens.double() / self.block_size)
        return self.mib(blocks * self.block_size)


def flat_cache_batch(num_seqs: int = 48, max_seq_len: int = 4096, block_size: int = 16,
                     seed: int = 1) -> FlatCacheBatch:
    """48 requests whose final lengths (prompt plus output) follow a log-normal, chat-like
    distribution; 32 layers, 8 KV heads of 128, float16: 128 KiB of KV per token."""
    num_layers, num_kv_heads, head_size, dtype_bytes = 32, 8, 128, 2
    g = torch.Generator().manual_seed(seed)
    prompt = torch.exp(torch.randn(num_seqs, generator=g) * 0.8 + 5.5)  # median ~250 tokens
    output = torch.exp(torch.randn(num_seqs, generator=g) * 0.9 + 5.0)  # median ~150 tokens
    final_lens = (prompt + output).round().clamp(1, max_seq_len).long()
    final_lens, _ = final_lens.sort(descending=True)
    return FlatCacheBatch(final_lens, 2 * num_layers * num_kv_heads * head_size * dtype_bytes,
                          max_seq_len, block_size)


def flat_cache(batch: FlatCacheBatch | None = None) -> Figure:
    """Reserved by a flat cache, used, and what blocks of 16 would hold, per sequence."""
    batch = batch or flat_cache_batch()
    n = len(batch.final_lens)
    x = list(range(n))
    fig, ax = plt.subplots(figsize=(13, 3.8))
    ax.bar(x, batch.reserved.numpy(), color="lightgray", label="reserved by the flat cache")
    ax.bar(x, batch.used.numpy(), color="tab:blue", label="used (final length)")
    ax.plot(x, batch.paged.numpy(), "_", color="tab:orange", markersize=9,
            label=f"paged, blocks of {batch.block_size} (phase 02)")
    ax.set_xlabel("sequence (sorted by final length)")
    ax.set_ylabel("KV memory (MiB)")
    ax.set_title(f"{n} sequences, max_seq_len {batch.max_seq_len}", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
