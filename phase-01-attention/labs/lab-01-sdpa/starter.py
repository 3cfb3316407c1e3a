"""Lab 01-01: scaled dot-product attention. Fill in every function that raises NotImplementedError.

Layout of one sequence (token-major, like vLLM): query ``[q_len, num_heads, head_size]``,
key/value ``[kv_len, num_kv_heads, head_size]``. The queries are the LAST ``q_len`` tokens of the
sequence: query ``i`` sits at absolute position ``kv_len - q_len + i``. Read the lab README for the
formulas and the order of the tasks; run ``LAB_IMPL=starter pytest <this folder> -q``.

Rules: do not call ``torch.nn.functional.scaled_dot_product_attention`` (the tests read this file
to check), and do not import from ``mini_vllm.attention`` (that is the answer).
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
    """Boolean ``[q_len, kv_len]`` mask, True where query ``i`` may attend key ``j``.

    Query ``i`` sits at position ``kv_len - q_len + i`` and sees every key at or before it.
    Hint: compare a column of query positions with a row of key positions (broadcasting).
    Call ``_check_lengths(q_len, kv_len)`` first so that bad lengths raise ValueError.
    """
    raise NotImplementedError("lab 01-01, task 1: implement causal_mask")


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """ALiBi bias ``[num_heads, q_len, kv_len]``: entry ``[h, i, j]`` is
    ``slopes[h] * (j - (kv_len - q_len + i))``.

    Compute in float32 (float64 if ``slopes`` is float64). Raise ValueError if ``slopes`` is
    not 1-D, and call ``_check_lengths`` for the lengths.
    """
    raise NotImplementedError("lab 01-01, task 2: implement alibi_bias")


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Expand ``[tokens, num_kv_heads, head_size]`` to ``[tokens, num_heads, head_size]``.

    Query head ``h`` must get KV head ``h // (num_heads // num_kv_heads)``: each KV head repeated
    ``group`` times in a row. Raise ValueError when ``x`` is not 3-D or ``num_heads`` is not a
    multiple of ``num_kv_heads``.
    """
    raise NotImplementedError("lab 01-01, task 3: implement repeat_kv")


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Logits ``[num_heads, q_len, kv_len]``: ``scale * q.k`` (+ ALiBi bias), masked to ``-inf``.

    * ``scale`` defaults to ``head_size ** -0.5``.
    * Work in ``_compute_dtype(query.dtype)`` (float32, or float64 for float64 inputs): cast the
      inputs up BEFORE the matmul, so float16 products do not round.
    * Masked entries are ``-inf`` (``masked_fill``), so that softmax gives them zero weight.
    * Start with ``_check_qkv(query, key, key, alibi_slopes)``.
    """
    raise NotImplementedError("lab 01-01, task 4: implement attention_scores")


def ref_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for one sequence: ``softmax(attention_scores) @ V``.

    Returns ``[q_len, num_heads, head_size]`` in ``query.dtype``. Softmax and the weighted sum run
    in the compute dtype; cast only the final result. Validate with ``_check_qkv`` first; an empty
    query (``q_len == 0``) returns an empty tensor.
    """
    raise NotImplementedError("lab 01-01, task 5: implement ref_attention")


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

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key/value rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``. Attend each sequence on its own with ``ref_attention``.
    Check everything before computing anything: ``_check_qkv(..., allow_long_query=True)``,
    ``_check_cu_seqlens`` for both offset tensors, the same number of sequences in both, and
    ``q_len <= kv_len`` for every sequence (ValueError otherwise).
    """
    raise NotImplementedError("lab 01-01, task 6: implement ref_varlen_attention")


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
