"""Reference attention in plain PyTorch: the yardstick every later kernel is checked against.

Conventions (shared by every function here, by the paged kernels of phase 02 and by the CUDA
kernel):

* One sequence is laid out token-major: ``query [q_len, num_heads, head_size]``,
  ``key``/``value`` ``[kv_len, num_kv_heads, head_size]``.
* The queries are the *last* ``q_len`` tokens of the sequence: query ``i`` sits at absolute
  position ``kv_len - q_len + i``. A full prefill has ``q_len == kv_len``, a decode step has
  ``q_len == 1``, a chunk of a chunked prefill sits in between. So ``q_len <= kv_len`` always.
* Causal: query ``i`` sees keys ``0 .. kv_len - q_len + i`` (itself included), never a later one.
  Every query sees at least key 0, so no row of a causal mask is empty.
* Grouped-query attention: ``num_heads`` is a multiple of ``num_kv_heads``; query head ``h`` reads
  KV head ``h // (num_heads // num_kv_heads)`` (consecutive query heads share a KV head).
* ALiBi: the score of query ``i`` against key ``j`` in head ``h`` gets
  ``slopes[h] * (j - pos_i)`` added, which is zero on the diagonal and negative into the past.
* Scores, softmax and the weighted sum run in float32 for float16/bfloat16/float32 inputs and in
  float64 for float64 inputs; the output is cast back to the query dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "attention_scores",
    "causal_mask",
    "compute_dtype",
    "ref_attention",
    "ref_varlen_attention",
    "repeat_kv",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates in: float64 stays float64, everything else is float32.

    upstream: tests/kernels/attention/test_attention.py:57 @ v0.11.0
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slopes for ``num_heads`` heads, as a float32 tensor ``[num_heads]``.

    For a power of two ``n`` the slopes are the geometric sequence ``2**(-8k/n)``, k = 1..n.
    Otherwise the first ``p`` (largest power of two below ``n``) heads use that sequence for ``p``
    and the rest take every other slope of the sequence for ``2p``.

    upstream: vllm/model_executor/models/bloom.py:52 @ v0.11.0
    """
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be a positive int, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        ratio = 2.0 ** (-8.0 / n)
        return [ratio ** (k + 1) for k in range(n)]

    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(p)
    if p != num_heads:
        slopes += geometric(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def causal_mask(
    q_len: int, kv_len: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean ``[q_len, kv_len]`` mask, True where query ``i`` may attend key ``j``.

    Query ``i`` sits at position ``kv_len - q_len + i`` and may see every key at or before it.
    (Upstream's test builds the prefill case, ``q_len == kv_len``, as an upper-triangular
    ``-inf`` matrix.)

    upstream: tests/kernels/attention/test_attention.py:370 @ v0.11.0
    """
    _check_lengths(q_len, kv_len)
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """ALiBi bias ``[num_heads, q_len, kv_len]`` in the slopes' compute dtype.

    Entry ``[h, i, j]`` is ``slopes[h] * (j - (kv_len - q_len + i))``: the distance from the query
    back to the key, times the head's slope (the convention of upstream's attention test).

    upstream: tests/kernels/attention/test_attention.py:112 @ v0.11.0
    """
    _check_lengths(q_len, kv_len)
    if slopes.dim() != 1:
        raise ValueError(f"alibi_bias: slopes must be 1-D [num_heads], got {tuple(slopes.shape)}")
    dtype = compute_dtype(slopes.dtype)
    query_pos = torch.arange(kv_len - q_len, kv_len, device=slopes.device, dtype=dtype)
    key_pos = torch.arange(kv_len, device=slopes.device, dtype=dtype)
    distance = key_pos[None, :] - query_pos[:, None]  # [q_len, kv_len], <= 0 where visible
    return slopes.to(dtype)[:, None, None] * distance[None, :, :]


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Expand ``[tokens, num_kv_heads, head_size]`` to ``[tokens, num_heads, head_size]``.

    Query head ``h`` gets KV head ``h // group`` with ``group = num_heads // num_kv_heads``,
    so each KV head is repeated ``group`` times in a row (not tiled).

    upstream: tests/kernels/attention/test_attention.py:105 @ v0.11.0
    """
    if x.dim() != 3:
        raise ValueError(
            f"repeat_kv: expected [tokens, num_kv_heads, head_size], got {tuple(x.shape)}"
        )
    num_kv_heads = x.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"repeat_kv: num_heads ({num_heads}) must be a multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )
    return x.repeat_interleave(num_heads // num_kv_heads, dim=1)


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Scaled, biased and masked logits ``[num_heads, q_len, kv_len]`` in the compute dtype.

    Masked entries are ``-inf`` so that softmax gives them exactly zero weight.

    upstream: tests/kernels/attention/test_attention.py:57 @ v0.11.0
    """
    q_len, num_heads, head_size = _check_qkv(query, key, key, alibi_slopes)
    kv_len = key.shape[0]
    if scale is None:
        scale = head_size**-0.5
    dtype = compute_dtype(query.dtype)
    q = query.to(dtype)
    k = repeat_kv(key, num_heads).to(dtype)
    scores = scale * torch.einsum("qhd,khd->hqk", q, k)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=query.device, dtype=dtype)
        scores = scores + alibi_bias(slopes, q_len, kv_len)
    if causal:
        visible = causal_mask(q_len, kv_len, device=query.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def ref_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for one sequence: ``softmax(scores) @ V`` with the module's conventions.

    Returns ``[q_len, num_heads, head_size]`` in ``query.dtype``; the softmax and the weighted
    sum run in float32 (float64 for float64 inputs).

    upstream: tests/kernels/attention/test_attention.py:50 @ v0.11.0
    """
    _, num_heads, _ = _check_qkv(query, key, value, alibi_slopes)
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    scores = attention_scores(query, key, scale=scale, alibi_slopes=alibi_slopes, causal=causal)
    weights = torch.softmax(scores, dim=-1)
    v = repeat_kv(value, num_heads).to(weights.dtype)
    out = torch.einsum("hqk,khd->qhd", weights, v)
    return out.to(query.dtype)


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
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; both offset tensors start at 0, never decrease, end at
    the packed length and have ``num_seqs + 1`` entries. Each sequence is attended on its own with
    :func:`ref_attention`; tokens of different sequences never see each other.

    upstream: tests/kernels/attention/test_attention.py:348 @ v0.11.0
    """
    _check_qkv(query, key, value, alibi_slopes, allow_long_query=True)
    starts_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.shape[0])
    starts_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, key.shape[0])
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"ref_varlen_attention: cu_seqlens_q has {len(starts_q)} entries but cu_seqlens_k has "
            f"{len(starts_k)}; both need num_seqs + 1"
        )
    for s in range(len(starts_q) - 1):
        q_len = starts_q[s + 1] - starts_q[s]
        kv_len = starts_k[s + 1] - starts_k[s]
        if q_len > kv_len:
            raise ValueError(
                f"ref_varlen_attention: sequence {s} has {q_len} queries but only {kv_len} keys; "
                "the queries are the last tokens of their sequence, so q_len <= kv_len"
            )
    out = query.new_empty(query.shape)
    for s in range(len(starts_q) - 1):
        qs, qe, ks, ke = starts_q[s], starts_q[s + 1], starts_k[s], starts_k[s + 1]
        out[qs:qe] = ref_attention(
            query[qs:qe],
            key[ks:ke],
            value[ks:ke],
            scale=scale,
            alibi_slopes=alibi_slopes,
            causal=causal,
        )
    return out


# ---------------------------------------------------------------------------------------------
# input checks: bad input raises before anything is computed


def _check_lengths(q_len: int, kv_len: int) -> None:
    if q_len < 0 or kv_len < 0 or q_len > kv_len:
        raise ValueError(
            f"need 0 <= q_len <= kv_len (the queries are the last q_len of kv_len tokens), "
            f"got q_len={q_len}, kv_len={kv_len}"
        )


def _check_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    *,
    allow_long_query: bool = False,
) -> tuple[int, int, int]:
    """Validate one sequence's (or a packed batch's) tensors.

    Returns ``(q_len, num_heads, head_size)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [tokens, heads, head_size], got shape {tuple(t.shape)}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            "query, key and value must share a dtype, "
            f"got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    q_len, num_heads, head_size = query.shape
    kv_len, num_kv_heads, kv_head_size = key.shape
    if head_size != kv_head_size:
        raise ValueError(f"query head_size {head_size} != key/value head_size {kv_head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not allow_long_query:
        _check_lengths(q_len, kv_len)
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
        raise ValueError(
            f"alibi_slopes must have shape [num_heads] = [{num_heads}], "
            f"got {tuple(alibi_slopes.shape)}"
        )
    return q_len, num_heads, head_size


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 1-D integer tensor [num_seqs + 1], got {cu!r}")
    starts = [int(x) for x in cu.tolist()]
    if starts[0] != 0 or starts[-1] != total or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the packed length {total}, "
            f"got {starts}"
        )
    return starts
