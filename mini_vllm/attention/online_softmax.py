"""Online softmax: attention over keys that arrive block by block, and merging partial results.

Softmax needs the maximum and the sum over *all* keys, yet a kernel sees the keys one block at a
time (one KV-cache page, one partition of a long sequence). The trick is to keep, per query row,

* ``max_logit``: the largest score seen so far (``-inf`` while nothing has been seen),
* ``exp_sum``:   ``sum_j exp(s_j - max_logit)`` over the keys seen so far,
* ``acc``:       ``sum_j exp(s_j - max_logit) * v_j`` (not yet divided by ``exp_sum``),

and, whenever a block raises the maximum, multiply ``exp_sum`` and ``acc`` by
``exp(old_max - new_max)`` so that every term is relative to the same maximum. After the last
block, ``acc / exp_sum`` is exactly ``softmax(s) @ V``.

Two partial results over disjoint key sets, each already normalised by its own sum
(``out = acc / exp_sum``), combine the same way: weight each by ``exp_sum * exp(max - new_max)``.
This is the reduce step of the PagedAttention v2 kernel and of ``merge_attn_states``. Its
log-sum-exp form uses ``lse = max_logit + log(exp_sum)``: the weights are ``exp(lse - max(lse))``.

Shapes: the state's ``max_logit`` and ``exp_sum`` share any leading shape ``S`` (here
``[num_heads, q_len]``); ``acc`` and ``out`` are ``S + [head_size]``. A block's scores are
``S + [block_len]`` with ``-inf`` where masked; its values ``[num_heads, block_len, head_size]``.
Everything runs in the compute dtype (float32, or float64 for float64 inputs). No function
modifies its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mini_vllm.attention.reference import _check_qkv, compute_dtype, repeat_kv

__all__ = [
    "Partial",
    "SoftmaxState",
    "blockwise_attention",
    "finalize",
    "merge_partials",
    "online_update",
    "reduce_partials",
    "split_kv_attention",
]


class SoftmaxState(NamedTuple):
    """Running state of an online softmax (see the module docstring for the invariants).

    upstream: vllm/attention/ops/triton_unified_attention.py:145 @ v0.11.0
    """

    max_logit: torch.Tensor
    exp_sum: torch.Tensor
    acc: torch.Tensor

    @classmethod
    def initial(
        cls,
        shape: Sequence[int],
        head_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> SoftmaxState:
        """The state before any key: max ``-inf``, sum 0, accumulator 0."""
        shape = tuple(shape)
        return cls(
            torch.full(shape, float("-inf"), dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros((*shape, head_size), dtype=dtype, device=device),
        )


class Partial(NamedTuple):
    """Attention over a subset of the keys, normalised by its own sum.

    ``out = acc / exp_sum`` (zero where the subset was empty or fully masked, where
    ``exp_sum == 0`` and ``max_logit == -inf``).

    upstream: csrc/attention/attention_kernels.cuh:562 @ v0.11.0
    """

    out: torch.Tensor
    max_logit: torch.Tensor
    exp_sum: torch.Tensor

    @property
    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the subset's scores, ``max_logit + log(exp_sum)`` (``-inf`` if empty)."""
        return self.max_logit + torch.log(self.exp_sum)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    # exp(-inf - (-inf)) is nan; where nothing has been seen yet any finite reference point gives
    # the right answer (all terms are exp(-inf) = 0), so subtract 0 there instead. Upstream's
    # Triton kernel does the same (triton_unified_attention.py, "to avoid NaN").
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def online_update(state: SoftmaxState, scores: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """Fold one block of keys into the state; returns a new state.

    ``scores``: ``S + [block_len]`` (``-inf`` where masked); ``values``: broadcastable so that
    ``p @ values`` is ``S + [head_size]`` (``[num_heads, block_len, head_size]`` here). An empty
    or fully masked block leaves the state's values unchanged.

    upstream: vllm/attention/ops/triton_unified_attention.py:300 @ v0.11.0
    """
    if scores.shape[:-1] != state.max_logit.shape:
        raise ValueError(
            f"online_update: scores {tuple(scores.shape)} must be the state's shape "
            f"{tuple(state.max_logit.shape)} plus a block dimension"
        )
    if values.shape[-2] != scores.shape[-1] or values.shape[-1] != state.acc.shape[-1]:
        raise ValueError(
            f"online_update: values {tuple(values.shape)} must be [..., block_len="
            f"{scores.shape[-1]}, head_size={state.acc.shape[-1]}]"
        )
    if scores.shape[-1] == 0:
        return state  # amax of an empty block is undefined; an empty block changes nothing
    scores = scores.to(state.acc.dtype)
    new_max = torch.maximum(state.max_logit, scores.amax(dim=-1))
    ref = _finite_or_zero(new_max)
    alpha = torch.exp(state.max_logit - ref)  # rescales what was summed under the old max
    p = torch.exp(scores - ref[..., None])
    exp_sum = state.exp_sum * alpha + p.sum(dim=-1)
    acc = state.acc * alpha[..., None] + p @ values.to(state.acc.dtype)
    return SoftmaxState(new_max, exp_sum, acc)


def finalize(state: SoftmaxState) -> Partial:
    """Normalise the accumulator: ``out = acc / exp_sum`` (0 where no key was visible).

    upstream: vllm/attention/ops/triton_unified_attention.py:313 @ v0.11.0
    """
    denom = torch.where(state.exp_sum > 0, state.exp_sum, torch.ones_like(state.exp_sum))
    return Partial(state.acc / denom[..., None], state.max_logit, state.exp_sum)


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Combine two partials over disjoint key sets into the partial over their union.

    Each side is weighted by its sum rescaled to the common maximum; an empty side (sum 0)
    contributes nothing, so merging with it returns the other side.

    upstream: vllm/attention/ops/triton_merge_attn_states.py:12 @ v0.11.0
    """
    if a.out.shape != b.out.shape or a.max_logit.shape != b.max_logit.shape:
        raise ValueError(
            f"merge_partials: shapes differ: out {tuple(a.out.shape)} vs {tuple(b.out.shape)}"
        )
    new_max = torch.maximum(a.max_logit, b.max_logit)
    ref = _finite_or_zero(new_max)
    weight_a = a.exp_sum * torch.exp(a.max_logit - ref)
    weight_b = b.exp_sum * torch.exp(b.max_logit - ref)
    total = weight_a + weight_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (a.out * weight_a[..., None] + b.out * weight_b[..., None]) / denom[..., None]
    return Partial(out, new_max, total)


def reduce_partials(out: torch.Tensor, max_logit: torch.Tensor, exp_sum: torch.Tensor) -> Partial:
    """Combine ``P`` partials at once, as the v2 kernel's reduce step does.

    ``out``: ``S + [P, head_size]``; ``max_logit``, ``exp_sum``: ``S + [P]``; ``P >= 1``.

    upstream: csrc/attention/attention_kernels.cuh:641 @ v0.11.0
    """
    if max_logit.dim() == 0 or max_logit.shape[-1] == 0:
        raise ValueError("reduce_partials: need at least one partial (a last dimension P >= 1)")
    if exp_sum.shape != max_logit.shape or out.shape[:-1] != max_logit.shape:
        raise ValueError(
            f"reduce_partials: out {tuple(out.shape)}, max_logit {tuple(max_logit.shape)} and "
            f"exp_sum {tuple(exp_sum.shape)} must be S+[P, head_size], S+[P], S+[P]"
        )
    global_max = max_logit.amax(dim=-1)
    ref = _finite_or_zero(global_max)
    rescaled = exp_sum * torch.exp(max_logit - ref[..., None])
    total = rescaled.sum(dim=-1)
    denom = torch.where(total > 0, total, torch.ones_like(total))
    merged = (out * rescaled[..., None]).sum(dim=-2) / denom[..., None]
    return Partial(merged, global_max, total)


def _blocks(boundaries: Sequence[int], kv_len: int) -> list[tuple[int, int]]:
    """``[(0, b0), (b0, b1), ..., (b_last, kv_len)]``; boundaries sorted within [0, kv_len]."""
    cuts = [int(b) for b in boundaries]
    if any(b < 0 or b > kv_len for b in cuts) or cuts != sorted(cuts):
        raise ValueError(
            f"boundaries must be sorted split points within [0, kv_len={kv_len}], got {cuts}"
        )
    edges = [0, *cuts, kv_len]
    return list(zip(edges[:-1], edges[1:]))


def _prepare(query, key, value, boundaries, alibi_slopes):
    """Lab 01's input checks, then the blocks ``[(start, end), ...]`` the keys are cut into."""
    _check_qkv(query, key, value, alibi_slopes)
    return _blocks(boundaries, key.shape[0])


def _block_scores(query, key, value, start, end, scale, alibi_slopes, causal):
    """Scores ``[H, q_len, end - start]`` of every query against keys ``start .. end - 1`` and
    their values ``[H, end - start, D]``, in the compute dtype.

    The scores are columns ``start:end`` of lab 01's ``attention_scores`` (scale, ALiBi bias
    from absolute positions, ``-inf`` after each query's position), computed from those keys
    alone: a block never needs the other keys, so at most one block's scores exist at a time.
    """
    q_len, num_heads, head_size = query.shape
    kv_len = key.shape[0]
    dtype = compute_dtype(query.dtype)
    if scale is None:
        scale = head_size**-0.5
    k = repeat_kv(key[start:end], num_heads).to(dtype)
    scores = scale * torch.einsum("qhd,khd->hqk", query.to(dtype), k)
    query_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    key_pos = torch.arange(start, end, device=query.device)
    if alibi_slopes is not None:
        distance = (key_pos[None, :] - query_pos[:, None]).to(dtype)
        scores = scores + alibi_slopes.to(query.device, dtype)[:, None, None] * distance
    if causal:
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    values = repeat_kv(value[start:end], num_heads).to(dtype).transpose(0, 1)
    return scores, values


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: Sequence[int],
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """``ref_attention`` computed by one online-softmax pass over the key blocks in order.

    The keys are cut at ``boundaries`` (sorted, within ``[0, kv_len]``, repeats give empty
    blocks). Returns ``[q_len, num_heads, head_size]`` in ``query.dtype``. Only one block's
    scores exist at a time: memory O(num_heads * q_len * (largest block + head_size)), where
    ``ref_attention`` holds all ``num_heads * q_len * kv_len`` scores.

    upstream: vllm/attention/ops/triton_unified_attention.py:52 @ v0.11.0
    """
    blocks = _prepare(query, key, value, boundaries, alibi_slopes)
    q_len, num_heads, head_size = query.shape
    state = SoftmaxState.initial(
        (num_heads, q_len), head_size, dtype=compute_dtype(query.dtype), device=query.device
    )
    for start, end in blocks:
        scores, values = _block_scores(query, key, value, start, end, scale, alibi_slopes, causal)
        state = online_update(state, scores, values)
    return finalize(state).out.transpose(0, 1).to(query.dtype)


def split_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: Sequence[int],
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """``ref_attention`` computed as independent partials, one per key block, then reduced.

    This is the shape of PagedAttention v2: each partition is attended on its own (in parallel on
    a GPU) and a reduce step combines the partials with :func:`reduce_partials`. Memory: one
    block's scores at a time, plus every block's partial (``num_heads * q_len * head_size`` each).

    upstream: vllm/attention/ops/triton_unified_attention.py:330 @ v0.11.0
    """
    blocks = _prepare(query, key, value, boundaries, alibi_slopes)
    q_len, num_heads, head_size = query.shape
    partials = []
    for start, end in blocks:
        scores, values = _block_scores(query, key, value, start, end, scale, alibi_slopes, causal)
        state = SoftmaxState.initial(
            (num_heads, q_len), head_size, dtype=scores.dtype, device=query.device
        )
        partials.append(finalize(online_update(state, scores, values)))
    merged = reduce_partials(
        torch.stack([p.out for p in partials], dim=-2),
        torch.stack([p.max_logit for p in partials], dim=-1),
        torch.stack([p.exp_sum for p in partials], dim=-1),
    )
    return merged.out.transpose(0, 1).to(query.dtype)
