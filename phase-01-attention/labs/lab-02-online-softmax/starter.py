"""Lab 01-02: online softmax. Fill in every function that raises NotImplementedError.

Per query row the state keeps ``max_logit`` (largest score so far, ``-inf`` before any key),
``exp_sum`` (sum of ``exp(s - max_logit)``) and ``acc`` (sum of ``exp(s - max_logit) * v``, not yet
divided). Shapes: ``max_logit`` and ``exp_sum`` are ``S`` (here ``[num_heads, q_len]``), ``acc`` and
``out`` are ``S + [head_size]``. Work in the state's dtype, and never modify an argument: return
new tensors. The README has the formulas; run ``LAB_IMPL=starter pytest <this folder> -q``.

You may use lab 01's reference (``mini_vllm.attention.reference``); do not import
``mini_vllm.attention.online_softmax`` (that is the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mini_vllm.attention.reference import attention_scores, repeat_kv

__all__ = [
    "SoftmaxState",
    "Partial",
    "online_update",
    "finalize",
    "merge_partials",
    "reduce_partials",
    "blockwise_attention",
    "split_kv_attention",
]


class SoftmaxState(NamedTuple):
    """Running state of an online softmax (complete: nothing to write here)."""

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
    """Attention over a subset of the keys, normalised by its own sum (complete).

    ``out = acc / exp_sum``; an empty or fully masked subset has ``out = 0``, ``exp_sum = 0`` and
    ``max_logit = -inf``.
    """

    out: torch.Tensor
    max_logit: torch.Tensor
    exp_sum: torch.Tensor

    @property
    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the subset's scores, ``max_logit + log(exp_sum)`` (``-inf`` if empty)."""
        return self.max_logit + torch.log(self.exp_sum)


def online_update(state: SoftmaxState, scores: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """Fold one block into the state and return the new state.

    ``scores``: ``S + [block_len]``, ``-inf`` where masked; ``values``:
    ``[num_heads, block_len, head_size]`` (so ``p @ values`` is ``S + [head_size]``).

    1. Raise ValueError if ``scores.shape[:-1]`` is not the state's shape or ``values`` does not
       match ``[..., block_len, head_size]``.
    2. An empty block (``block_len == 0``) returns the state unchanged (``amax`` of nothing fails).
    3. New max = max(old max, block max). Rescale the old sum and accumulator by
       ``exp(old_max - new_max)``, add ``exp(scores - new_max)`` and its product with the values.
    4. If the new max is still ``-inf`` (all keys so far masked), ``-inf - -inf`` is nan: subtract
       0 instead in that row (every term is ``exp(-inf) = 0`` anyway).
    """
    raise NotImplementedError("lab 01-02, task 1: implement online_update")


def finalize(state: SoftmaxState) -> Partial:
    """``Partial(acc / exp_sum, max_logit, exp_sum)``, with ``out = 0`` (not nan) where
    ``exp_sum == 0``."""
    raise NotImplementedError("lab 01-02, task 2: implement finalize")


def merge_partials(a: Partial, b: Partial) -> Partial:
    """The partial over the union of two disjoint key sets.

    Weight each side by ``exp_sum * exp(max_logit - new_max)`` with ``new_max`` the larger max;
    ``out`` is the weighted mean of the two outs, ``exp_sum`` the sum of the weights. An empty side
    (``exp_sum == 0``, ``max_logit == -inf``) contributes nothing; both empty gives an empty
    partial without nan. Raise ValueError when the two partials' shapes differ.
    """
    raise NotImplementedError("lab 01-02, task 3: implement merge_partials")


def reduce_partials(out: torch.Tensor, max_logit: torch.Tensor, exp_sum: torch.Tensor) -> Partial:
    """Combine ``P`` partials at once (the v2 kernel's reduce step).

    ``out``: ``S + [P, head_size]``; ``max_logit``, ``exp_sum``: ``S + [P]``. The same weights as
    ``merge_partials``, with the maximum over all ``P``. Raise ValueError if ``P == 0`` or the
    shapes do not fit together.
    """
    raise NotImplementedError("lab 01-02, task 4: implement reduce_partials")


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
    """Lab 01's attention, computed by ONE online-softmax pass over the key blocks in order.

    ``_prepare`` gives you the scores ``[H, q_len, kv_len]``, the values ``[H, kv_len, D]`` and
    the blocks ``[(start, end), ...]``. Start from ``SoftmaxState.initial((H, q_len), D,
    dtype=scores.dtype)``, update with each block, finalize, and return ``out`` as
    ``[q_len, H, D]`` in ``query.dtype``.
    """
    raise NotImplementedError("lab 01-02, task 5: implement blockwise_attention")


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
    """Lab 01's attention as independent partials, one per block, combined by
    ``reduce_partials`` (stack the partials along a new ``P`` dimension). Same output as
    ``blockwise_attention``."""
    raise NotImplementedError("lab 01-02, task 6: implement split_kv_attention")


# ---------------------------------------------------------------------------------------------
# complete helpers


def _blocks(boundaries: Sequence[int], kv_len: int) -> list[tuple[int, int]]:
    """``[(0, b0), (b0, b1), ..., (b_last, kv_len)]``; ValueError unless sorted within bounds."""
    cuts = [int(b) for b in boundaries]
    if any(b < 0 or b > kv_len for b in cuts) or cuts != sorted(cuts):
        raise ValueError(f"boundaries must be sorted within [0, {kv_len}], got {cuts}")
    edges = [0, *cuts, kv_len]
    return list(zip(edges[:-1], edges[1:]))


def _prepare(query, key, value, boundaries, scale, alibi_slopes, causal):
    """Scores ``[H, q_len, kv_len]`` (lab 01), values ``[H, kv_len, D]``, and the blocks."""
    scores = attention_scores(query, key, scale=scale, alibi_slopes=alibi_slopes, causal=causal)
    values = repeat_kv(value, query.shape[1]).to(scores.dtype).transpose(0, 1)
    return scores, values, _blocks(boundaries, key.shape[0])
