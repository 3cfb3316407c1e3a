"""Lab 01-01 starter: scaled dot-product attention, as a serving engine needs it.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold, which errors, and the cost.
How to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint
01-01 N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea,
and the tests that check it), then ``--level 4`` (the upstream lines to read).

Conventions shared by every function here (and every later lab):

* one sequence is token-major: query ``[q_len, num_heads, head_size]``, key and value
  ``[kv_len, num_kv_heads, head_size]``;
* the queries are the LAST ``q_len`` of the ``kv_len`` tokens: query ``i`` sits at absolute
  position ``pos_i = kv_len - q_len + i`` (so ``0 <= q_len <= kv_len``);
* query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* float16, bfloat16 and float32 inputs are computed in float32, float64 inputs in float64
  (``_compute_dtype``).

Rules: do not call ``torch.nn.functional.scaled_dot_product_attention`` (the tests read this file
to check), and do not import from ``mini_vllm.attention`` (that is the answer). The ``_check_*``
helpers at the bottom are complete: they raise the ValueErrors the contracts ask for.

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-01-attention/labs/lab-01-sdpa -q
"""

from __future__ import annotations

import torch

__all__ = [
    "causal_mask",
    "alibi_bias",
    "repeat_kv",
    "attention_scores",
    "ref_attention",
    "ref_varlen_attention",
]


def causal_mask(
    q_len: int, kv_len: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Which keys each query may see.

    Output: a ``torch.bool`` tensor ``[q_len, kv_len]`` on ``device`` (``None``: torch's default
    device), True exactly where key ``j`` is at or before the query's position:
    ``j <= kv_len - q_len + i``. So the last query sees every key, and every query sees at least
    key 0 (no row is all False). ``q_len == 0`` gives an empty ``[0, kv_len]`` mask.

    Errors: ValueError unless ``0 <= q_len <= kv_len`` (``_check_lengths``; the message gives
    both numbers). Cost: O(q_len * kv_len), no Python loop over the entries.
    """
    raise NotImplementedError(
        "lab 01-01, task 1: implement causal_mask (hint: python -m course hint 01-01 1)"
    )


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The ALiBi bias of every (head, query, key).

    Inputs: ``slopes`` is 1-D ``[num_heads]`` (any floating dtype, any values).

    Output: ``[num_heads, q_len, kv_len]`` on the slopes' device, in
    ``_compute_dtype(slopes.dtype)``; entry ``[h, i, j]`` is ``slopes[h] * (j - pos_i)`` with
    ``pos_i = kv_len - q_len + i``: zero on the query's own key, ``-slopes[h]`` per step back,
    and positive for keys after the query (which a causal mask removes later). The distance
    is measured from the query's absolute position, not from its row index ``i``.

    Errors: ValueError if ``slopes`` is not 1-D, or unless ``0 <= q_len <= kv_len``. Cost:
    O(num_heads * q_len * kv_len).
    """
    raise NotImplementedError(
        "lab 01-01, task 2: implement alibi_bias (hint: python -m course hint 01-01 2)"
    )


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Give every query head its KV head.

    Inputs: ``x`` ``[tokens, num_kv_heads, head_size]``; ``num_heads`` a multiple of
    ``num_kv_heads``.

    Output: ``[tokens, num_heads, head_size]``, same dtype and device, with
    ``out[t, h] == x[t, h // (num_heads // num_kv_heads)]``: each KV head appears
    ``num_heads // num_kv_heads`` times in a row (heads 0, 0, 1, 1, ... for 4 over 2), never
    tiled (0, 1, 0, 1). ``x`` itself is not modified.

    Errors: ValueError when ``x`` is not 3-D, or ``num_heads`` is not a positive multiple of
    ``num_kv_heads`` (the message gives both numbers). Cost: O(tokens * num_heads * head_size).
    """
    raise NotImplementedError(
        "lab 01-01, task 3: implement repeat_kv (hint: python -m course hint 01-01 3)"
    )


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The logits of one sequence: ``[num_heads, q_len, kv_len]``.

    Entry ``[h, i, j]`` is ``scale * (query[i, h] . key[j, h // group])``, plus
    ``alibi_bias(alibi_slopes, q_len, kv_len)[h, i, j]`` when slopes are given, and exactly
    ``-inf`` where ``causal`` is True and ``causal_mask`` is False (every other entry is
    finite for finite inputs).

    Defaults: ``scale=None`` means ``head_size ** -0.5``; any float given is used as is
    (``0.0`` included: it makes every visible key equally likely). ``causal=True``; with
    ``causal=False`` nothing is masked. ``alibi_slopes=None`` adds no bias.

    Precision and place: the result is on the query's device, in
    ``_compute_dtype(query.dtype)``, and is what that dtype's arithmetic gives on the inputs'
    values: float16/bfloat16 inputs are converted before any product, so their scores equal the
    scores of the same values given as float32. ``alibi_slopes`` may come in any floating dtype
    and on another device (say the CPU, with the query on a GPU): they are converted to the
    query's device and compute dtype first.

    Errors (before any computation): ``_check_qkv(query, key, key, alibi_slopes)`` (shapes,
    dtypes, head counts, ``q_len <= kv_len``, slopes ``[num_heads]``). Inputs are not
    modified. Cost: O(num_heads * q_len * kv_len * head_size).
    """
    raise NotImplementedError(
        "lab 01-01, task 4: implement attention_scores (hint: python -m course hint 01-01 4)"
    )


def ref_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for one sequence.

    Output: ``[q_len, num_heads, head_size]`` in ``query.dtype``; row ``i`` of head ``h`` is
    the mean of the values of KV head ``h // group`` weighted by ``softmax`` of row ``[h, i]``
    of ``attention_scores`` (same ``scale``, ``alibi_slopes``, ``causal`` and defaults). The
    softmax and the weighted sum run in the compute dtype and only the result is cast to
    ``query.dtype``. Finite for any finite inputs, logits of ``1e4`` included. ``q_len == 0``
    returns an empty ``[0, num_heads, head_size]`` tensor in ``query.dtype``.

    Errors (before any computation): ``_check_qkv(query, key, value, alibi_slopes)``. Inputs are
    not modified. Cost: O(num_heads * q_len * kv_len * head_size); memory O(num_heads * q_len *
    kv_len) for the scores.
    """
    raise NotImplementedError(
        "lab 01-01, task 5: implement ref_attention (hint: python -m course hint 01-01 5)"
    )


def ref_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for a ragged batch packed along the token dimension.

    Inputs: sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key/value
    rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; both offset tensors hold ``num_seqs + 1``
    integers from 0 to the packed length. A sequence may have no queries.

    Output: a tensor like ``query`` (shape, dtype); the rows of sequence ``s`` equal
    ``ref_attention`` of its own rows with the same ``scale``, ``alibi_slopes`` and ``causal``.
    Rows of other sequences never affect them, whatever they hold (NaN included).

    Errors, all checked before any attention is computed (ValueError):
    ``_check_qkv(query, key, value, alibi_slopes, allow_long_query=True)``;
    ``_check_cu_seqlens`` for each offset tensor; both with the same number of entries; and
    ``q_len <= kv_len`` for every sequence (the message names the sequence and both lengths).
    Inputs are not modified. Cost: the sum of the sequences' ``ref_attention`` costs.
    """
    raise NotImplementedError(
        "lab 01-01, task 6: implement ref_varlen_attention (hint: python -m course hint 01-01 6)"
    )


# ---------------------------------------------------------------------------------------------
# complete helpers: you do not need to change these


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float16, bfloat16 and float32 are computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_lengths(q_len: int, kv_len: int) -> None:
    """ValueError unless 0 <= q_len <= kv_len."""
    if q_len < 0 or kv_len < 0 or q_len > kv_len:
        raise ValueError(f"need 0 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")


def _check_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    *,
    allow_long_query: bool = False,
) -> tuple[int, int, int]:
    """ValueError on inconsistent shapes or dtypes; returns ``(q_len, num_heads, head_size)``."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_size], got {tuple(t.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    q_len, num_heads, head_size = query.shape
    kv_len, num_kv_heads, kv_head_size = key.shape
    if head_size != kv_head_size:
        raise ValueError(f"query head_size {head_size} != key head_size {kv_head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not allow_long_query:
        _check_lengths(q_len, kv_len)
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
        raise ValueError(f"alibi_slopes must be [{num_heads}], got {tuple(alibi_slopes.shape)}")
    return q_len, num_heads, head_size


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """ValueError unless ``cu`` is 1-D integer, starts at 0, never decreases, ends at ``total``."""
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {cu!r}")
    starts = [int(x) for x in cu.tolist()]
    if starts[0] != 0 or starts[-1] != total or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{name} must go from 0 to {total} without decreasing, got {starts}")
    return starts
