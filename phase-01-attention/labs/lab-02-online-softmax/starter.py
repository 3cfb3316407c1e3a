"""Lab 01-02 starter: online softmax, and attention over keys that arrive block by block.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold, which errors, and the cost.
How to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint
01-02 N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea,
and the tests that check it), then ``--level 4`` (the upstream lines to read).

Per query row the running state keeps ``max_logit`` (the largest score so far, ``-inf`` before
any key), ``exp_sum`` (the sum of ``exp(s - max_logit)`` over the keys so far) and ``acc`` (the
sum of ``exp(s - max_logit) * v``, not yet divided). Shapes: ``max_logit`` and ``exp_sum`` are
``S`` (here ``[num_heads, q_len]``), ``acc`` and ``out`` are ``S + [head_size]``. No function
modifies its arguments: each returns new tensors.

You may use lab 01's reference (``mini_vllm.attention.reference``). From
``mini_vllm.attention.online_softmax``, the module that holds the answers, this file takes two
given helpers and nothing else: ``_prepare`` (lab 01's input checks and the cut of the keys into
blocks) and ``_block_scores`` (one block's scaled, biased, masked scores and its values), because
they are lab 01's work again, not this lab's. Import nothing more from that module: its other
functions are the tasks. ``SoftmaxState``, ``Partial`` and the helpers at the bottom are complete.

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-01-attention/labs/lab-02-online-softmax -q
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# Given helpers (complete; read them in mini_vllm/attention/online_softmax.py): the input checks
# and the cut into blocks (_prepare), and one block's scores and values (_block_scores).
from mini_vllm.attention.online_softmax import _block_scores, _prepare  # noqa: F401

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
    """Fold one block of keys into the running state; return the new state.

    Inputs: ``scores`` ``S + [block_len]``, ``-inf`` where a key is masked for that row;
    ``values`` ``[num_heads, block_len, head_size]`` (so ``p @ values`` is ``S + [head_size]``
    for ``p`` of the scores' shape). Any floating dtypes: the work is done in the state's dtype.

    Output: the state over the keys seen before plus this block, equal (up to rounding) to
    the state of one pass over all of them at once: ``max_logit`` the maximum over all of them,
    ``exp_sum`` and ``acc`` both taken relative to that maximum. An empty block
    (``block_len == 0``) leaves the state unchanged, and a block whose keys are all masked in a
    row leaves that row's three values exactly unchanged, whatever finite values those keys
    hold. A row that has seen only masked keys keeps ``max_logit = -inf``, ``exp_sum = 0``,
    ``acc = 0`` (never NaN). Finite for scores of any size (``1e4`` included).

    Errors: ValueError when ``scores.shape[:-1]`` is not the state's ``S``, or ``values`` is not
    ``[..., block_len, head_size]``. The state and the inputs are not modified. Cost:
    O(size of S * block_len * head_size).
    """
    raise NotImplementedError(
        "lab 01-02, task 1: implement online_update (hint: python -m course hint 01-02 1)"
    )


def finalize(state: SoftmaxState) -> Partial:
    """The state as a partial result: ``Partial(acc / exp_sum, max_logit, exp_sum)``.

    A row that saw no visible key (``exp_sum == 0``) gets ``out = 0`` (not NaN) and keeps
    ``max_logit = -inf``, ``exp_sum = 0``. The state is not modified. Cost: O(size of acc).
    """
    raise NotImplementedError(
        "lab 01-02, task 2: implement finalize (hint: python -m course hint 01-02 2)"
    )


def merge_partials(a: Partial, b: Partial) -> Partial:
    """The partial over the union of two disjoint key sets, from the two partials.

    Output: exactly the partial that ``finalize`` would give after folding both key sets into
    one state: ``max_logit`` the larger maximum, ``exp_sum`` the total sum relative to it, and
    ``out`` the mean of ``a.out`` and ``b.out`` weighted by their sums, each rescaled to the
    common maximum. An empty side (``exp_sum == 0``, ``max_logit == -inf``) contributes nothing,
    so merging with it returns the other side; two empty sides give an empty partial (out 0,
    sum 0, max ``-inf``; no NaN). Commutative.

    Errors: ValueError when the shapes of ``a`` and ``b`` differ. Inputs are not modified. Cost:
    O(size of out).
    """
    raise NotImplementedError(
        "lab 01-02, task 3: implement merge_partials (hint: python -m course hint 01-02 3)"
    )


def reduce_partials(out: torch.Tensor, max_logit: torch.Tensor, exp_sum: torch.Tensor) -> Partial:
    """Combine ``P`` partials at once (the reduce step of PagedAttention v2).

    Inputs: partial ``p`` is ``(out[..., p, :], max_logit[..., p], exp_sum[..., p])``: ``out``
    ``S + [P, head_size]``, ``max_logit`` and ``exp_sum`` ``S + [P]``, with ``P >= 1``.

    Output: the ``Partial`` over the union of the ``P`` key sets, the same as merging them two at
    a time with ``merge_partials``: shapes ``S + [head_size]``, ``S``, ``S``. Rows where every
    partial is empty give out 0, sum 0, max ``-inf`` (no NaN).

    Errors: ValueError when ``P == 0``, or the three shapes do not fit together. Inputs are not
    modified. Cost: O(size of out), one pass (no loop over P in Python).
    """
    raise NotImplementedError(
        "lab 01-02, task 4: implement reduce_partials (hint: python -m course hint 01-02 4)"
    )


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
    """Lab 01's ``ref_attention``, computed in ONE online-softmax pass over the key blocks.

    Inputs: as ``ref_attention`` (same ``scale``, ``alibi_slopes``, ``causal`` and defaults);
    the keys are cut at ``boundaries``, sorted split points in ``[0, kv_len]`` (repeats give
    empty blocks): blocks ``[0, b_0), [b_0, b_1), ..., [b_last, kv_len)``, visited in order.

    Output: ``[q_len, num_heads, head_size]`` in ``query.dtype`` on the query's device, equal
    to ``ref_attention`` within rounding, for any boundaries. Memory: at most one block's scores
    at a time (the helper ``_block_scores`` gives them), never the whole
    ``[num_heads, q_len, kv_len]``.

    Errors (ValueError, before any block): lab 01's input checks and bad boundaries, both done
    by the helper ``_prepare``. Inputs are not modified.
    """
    raise NotImplementedError(
        "lab 01-02, task 5: implement blockwise_attention (hint: python -m course hint 01-02 5)"
    )


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
    """The same attention as ``blockwise_attention``, structured as PagedAttention v2 is:
    every block becomes an independent ``Partial`` (as if on its own processor), then ONE call
    of ``reduce_partials`` combines them all.

    Inputs, output, errors and defaults as ``blockwise_attention``. Memory: one block's scores
    at a time plus one partial per block.
    """
    raise NotImplementedError(
        "lab 01-02, task 6: implement split_kv_attention (hint: python -m course hint 01-02 6)"
    )
