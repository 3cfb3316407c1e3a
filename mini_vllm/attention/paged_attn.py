"""PagedAttention for decode, written with PyTorch tensor operations.

This module is the data plane of phase 02 and the oracle that the CUDA kernels are graded
against. It follows upstream's split between ``vllm/attention/ops/paged_attn.py`` (cache shapes
and the v1/v2 choice) and the kernels in ``csrc/attention/`` (the maths), but everything here is
plain tensor code that runs on any device.

Cache layouts (``x = 16 // element_size``, the number of elements in one 16-byte vector)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size,      block_size]

Token ``t`` of a sequence lives in physical block ``block_table[t // block_size]`` at offset
``t % block_size``. Element ``d`` of its key for KV head ``h`` sits at
``key_cache[block, h, d // x, offset, d % x]``; of its value at
``value_cache[block, h, d, offset]``.

With ``kv_cache_dtype="fp8"`` the caches hold float8_e4m3fn (``x = 16``) and every op takes
per-layer ``k_scale``/``v_scale``: a cached key element ``q`` stands for ``q * k_scale`` (values
likewise), dequantized as it is read, so the maths after the gather is the same for both paths
(see ``mini_vllm.attention.fp8``).

Both kernels take one query token per sequence (decode). ``paged_attention_v1`` attends over the
whole context at once; ``paged_attention_v2`` cuts the context into partitions of
``PARTITION_SIZE`` tokens, writes each partition's max logit, exp sum and normalised partial output
into caller-provided buffers, then merges them. No Python loop runs per token or per sequence;
v2 loops over partitions only (the kernel's third grid dimension).
"""

from __future__ import annotations

import math

import torch

from mini_vllm.attention.fp8 import FP8_DTYPE, scaled_fp8_dequant
from mini_vllm.attention.paged_checks import (
    KV_CACHE_TORCH_DTYPES,
    _memo,
    _same_inputs,
    _tensor_key,
    check_decode_inputs,
    check_out,
    check_v2_buffers,
)

__all__ = [
    "PARTITION_SIZE",
    "V1_MAX_SEQ_LEN",
    "V1_MIN_PARALLEL_WORK",
    "kv_cache_x",
    "get_kv_cache_shape",
    "split_kv_cache",
    "num_partitions",
    "use_v1",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_v2_reduce",
    "forward_decode",
]

# Tokens per v2 partition. Must stay a multiple of every supported block size.
PARTITION_SIZE = 512
# The v1/v2 heuristic's constants (see ``use_v1``).
V1_MAX_SEQ_LEN = 8192
V1_MIN_PARALLEL_WORK = 512


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def kv_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector for ``dtype``: 4 for fp32, 8 for fp16/bf16, 16 for fp8.

    The key cache splits ``head_size`` into ``head_size // x`` chunks of ``x`` contiguous
    elements so that a GPU thread can fetch one chunk with a single 16-byte load.

    upstream: csrc/attention/attention_kernels.cuh:195 @ v0.11.0
    """
    if dtype not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(
            f"unsupported KV cache dtype {dtype}; use one of float32, float16, bfloat16, "
            "float8_e4m3fn"
        )
    return 16 // dtype.itemsize


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int]:
    """Shape of one layer's combined KV cache: ``(2, num_blocks, block_size * kv_heads * head)``.

    Index 0 holds keys, index 1 values; ``split_kv_cache`` views them in the paged layouts.

    upstream: vllm/attention/ops/paged_attn.py:48 @ v0.11.0
    """
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return (2, num_blocks, block_size * num_kv_heads * head_size)


def split_kv_cache(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """View a ``get_kv_cache_shape`` tensor as (key_cache, value_cache) without copying.

    Writes through the returned views land in ``kv_cache``.

    upstream: vllm/attention/ops/paged_attn.py:58 @ v0.11.0
    """
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must have shape (2, num_blocks, block_size * num_kv_heads * head_size), "
            f"got {tuple(kv_cache.shape)}; build it with get_kv_cache_shape"
        )
    x = kv_cache_x(kv_cache.dtype)
    per_block = kv_cache.shape[2]
    if head_size % x != 0:
        raise ValueError(f"head_size {head_size} must be a multiple of x={x} for {kv_cache.dtype}")
    if per_block % (num_kv_heads * head_size) != 0:
        raise ValueError(
            f"a block holds {per_block} elements, not a multiple of "
            f"num_kv_heads * head_size = {num_kv_heads * head_size}"
        )
    num_blocks = kv_cache.shape[1]
    key_cache = kv_cache[0].view(num_blocks, num_kv_heads, head_size // x, -1, x)
    value_cache = kv_cache[1].view(num_blocks, num_kv_heads, head_size, -1)
    return key_cache, value_cache


# --------------------------------------------------------------------------------------------
# The v1/v2 choice
# --------------------------------------------------------------------------------------------


def num_partitions(max_seq_len: int) -> int:
    """Partitions of ``PARTITION_SIZE`` tokens needed for ``max_seq_len`` (at least 1).

    upstream: vllm/attention/ops/paged_attn.py:126 @ v0.11.0
    """
    return max(1, -(-int(max_seq_len) // PARTITION_SIZE))


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """True when v0.11.0's heuristic picks ``paged_attention_v1`` over v2.

    v1 is chosen when the longest context is at most 8192 tokens and either it fits in one
    partition (a v2 reduce would be pure overhead) or there are more than 512 (sequence, head)
    pairs, which already give the GPU enough independent work without splitting the context.

    upstream: vllm/attention/ops/paged_attn.py:135 @ v0.11.0
    """
    return max_seq_len <= V1_MAX_SEQ_LEN and (
        num_partitions(max_seq_len) == 1 or num_seqs * num_heads > V1_MIN_PARALLEL_WORK
    )


# --------------------------------------------------------------------------------------------
# The shared core: logits over the gathered context
# --------------------------------------------------------------------------------------------


def _context_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    x: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What to read for a decode batch: ``(key_index, value_index, valid, bias)``.

    With ``ids [num_seqs, blocks]`` the blocks to read (padding columns of the table point at
    block 0): ``key_index`` lists, in ``[seqs, kv_heads, blocks, block_size, head_size // x]``
    order, the 16-byte key vectors of a contiguous key cache viewed as one flat run of them, so
    that one gather lands the keys token-major; ``value_index`` lists, in ``[seqs, kv_heads,
    head_size, blocks]`` order, the ``block_size``-long rows of the value cache viewed as
    ``[-1, block_size]``. ``valid [num_seqs, num_tokens]`` marks the positions inside each
    context and ``bias [num_seqs * num_kv_heads, 1, num_tokens]`` is 0 there and ``-inf``
    elsewhere.

    All of it depends only on the table, the lengths and the shapes, which the engine passes
    unchanged to every layer of a step, so the last plan is reused while those tensors are the
    same objects, unmodified (their version counters unchanged).
    """
    key = (*_tensor_key(block_tables), *_tensor_key(seq_lens), block_size, num_tokens,
           num_kv_heads, head_size, x, dtype)
    plan = _same_inputs("decode_plan", key)
    if plan is not None:
        return plan  # type: ignore[return-value]
    num_seqs, n_blk, dev = seq_lens.shape[0], num_tokens // block_size, seq_lens.device
    pos = torch.arange(num_tokens, device=dev)
    valid = pos[None, :] < seq_lens.to(torch.int64)[:, None]  # [num_seqs, num_tokens]
    # Table columns past a sequence's end are padding and may hold anything: point them at
    # block 0 so the gather stays in bounds, and let the mask drop what they bring in.
    table = block_tables[:, :n_blk].to(torch.int64)
    col_used = valid[:, ::block_size]
    ids = torch.where(col_used, table, torch.zeros_like(table))

    def ar(n: int, dim: int, ndim: int) -> torch.Tensor:
        return torch.arange(n, device=dev).view([n if d == dim else 1 for d in range(ndim)])

    heads = ids.view(num_seqs, 1, n_blk) * num_kv_heads + ar(num_kv_heads, 1, 3)
    chunks = head_size // x
    key_index = ((heads[..., None, None] * chunks + ar(chunks, 4, 5)) * block_size
                 + ar(block_size, 3, 5)).reshape(-1)
    value_index = (heads[:, :, None, :] * head_size + ar(head_size, 2, 4)).reshape(-1)
    bias = torch.zeros(num_seqs, 1, num_tokens, dtype=dtype, device=dev)
    bias.masked_fill_(~valid[:, None, :], float("-inf"))
    bias = bias.repeat_interleave(num_kv_heads, dim=0)
    plan = (key_index, value_index, valid, bias)
    _memo["decode_plan"] = (key, plan)
    return plan


def _gather_logits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_tokens: int,
    alibi_slopes: torch.Tensor | None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sanitize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled (ALiBi-biased, masked) logits and the gathered values, one row per KV head.

    Returns ``logits [num_seqs * num_kv_heads, group, num_tokens]`` (fp32; fp64 for fp64 input),
    ``-inf`` at positions ``>= seq_len``, and ``values [num_seqs * num_kv_heads, head_size,
    num_tokens]``, where ``group = num_heads // num_kv_heads``, row ``s * num_kv_heads + k``
    is sequence ``s``'s KV head ``k`` and query head ``h`` is KV head ``h // group``, member
    ``h % group``. ``num_tokens`` must be a multiple of ``block_size`` covering every context.

    With ``sanitize``, positions past a sequence's end are excluded whatever the cache holds
    there: their logits are exactly ``-inf`` and their values 0. Without it they only get a
    ``-inf`` bias, so a NaN or inf in a stale slot makes the result non-finite (and the caller
    redoes it sanitized). With ``k_scale``/``v_scale`` given the caches are fp8 and the gathered
    context is dequantized (``fp8 * scale``, in the accumulation dtype) before any arithmetic.

    Each cache is read once, by one gather (see :func:`_context_plan`) that lays the context out
    for one batched matmul per side over every (sequence, KV head) pair with its ``group``
    query heads. The keys move in units of their 16-byte ``x`` vectors (each viewed as one
    16-byte element), which is what the layout is for: the ``x`` lanes of a chunk stay
    together, only the chunk and token axes swap. The values move in rows of ``block_size``
    tokens, kept as they are (``[head_size, tokens]``; the matmul reads them transposed).
    """
    num_seqs, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    x = key_cache.shape[-1]
    rows = num_seqs * num_kv_heads
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    key_index, value_index, valid, bias = _context_plan(
        block_tables, seq_lens, block_size, num_tokens, num_kv_heads, head_size, x, acc)

    if not key_cache.is_contiguous() or key_cache.storage_offset() % x:
        # A contiguous, 16-byte aligned copy for the vector view (a plain clone() would keep
        # a strided view's memory order).
        key_cache = key_cache.clone(memory_format=torch.contiguous_format)
    vectors = key_cache.view(torch.complex128).view(-1)  # one element per 16-byte vector
    keys = vectors.index_select(0, key_index).view(key_cache.dtype)
    keys = keys.view(rows, num_tokens, head_size)
    values = value_cache.contiguous().view(-1, block_size).index_select(0, value_index)
    values = values.view(rows, head_size, num_tokens)
    if k_scale is not None:  # fp8: dequantize on read, only the context this batch uses
        keys = scaled_fp8_dequant(keys, k_scale, acc)
        values = scaled_fp8_dequant(values, v_scale, acc)
    elif keys.dtype != acc:
        keys, values = keys.to(acc), values.to(acc)
    if sanitize:
        # Stale slots past seq_len (and padding blocks) may hold NaN or inf, and a zero softmax
        # weight times NaN is NaN: zero those values (a fresh copy), as upstream's kernel does.
        values.view(num_seqs, -1, num_tokens).masked_fill_(~valid[:, None, :], 0.0)
    q = query.to(acc).view(rows, group, head_size)
    if alibi_slopes is not None:
        # The only query sits at position seq_len - 1, so key t gets slope * (t - seq_len + 1).
        pos = torch.arange(num_tokens, device=query.device)
        dist = pos[None, :] - (seq_lens.to(torch.int64)[:, None] - 1)  # [seqs, T]
        slopes = alibi_slopes.to(acc).view(1, num_kv_heads, group, 1)
        alibi = slopes * dist[:, None, None, :].to(acc)
        bias = bias + alibi.reshape(rows, group, num_tokens)
    logits = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
    if sanitize:
        logits = logits.view(num_seqs, -1, num_tokens).masked_fill(
            ~valid[:, None, :], float("-inf")).view(rows, group, num_tokens)
    return logits, values


def _weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_t weights[r, g, t] * values[r, :, t]`` -> ``[num_seqs * num_kv_heads, group, D]``.

    ``weights [num_seqs * num_kv_heads, group, T]`` and ``values [num_seqs * num_kv_heads,
    head_size, T]`` as :func:`_gather_logits` returns them (or a slice of their ``T``): one
    batched matmul, whose rows are already in query-head order (``.view(num_seqs, num_heads,
    head_size)`` puts head ``k * group + g`` in its place).
    """
    return torch.bmm(weights.to(values.dtype), values.transpose(1, 2))


def _cache_scales(
    key_cache: torch.Tensor, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor
) -> tuple[float | None, float | None]:
    """``(k_scale, v_scale)`` as floats for an fp8 cache, ``(None, None)`` otherwise.

    Called after the checks, which guarantee the scales are valid and the cache dtype matches.
    """
    if key_cache.dtype != FP8_DTYPE:
        return None, None
    return float(k_scale), float(v_scale)


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Decode attention over paged KV; writes ``out`` in place.

    For each sequence ``s`` and query head ``h``: softmax over the ``seq_lens[s]`` cached tokens
    of ``scale * q . k (+ alibi_slopes[h] * (key_pos - (seq_len - 1)))`` times the values, read
    from KV head ``h // (num_heads // num_kv_heads)``. Accumulation is fp32; ``out`` gets the
    query dtype. Nothing is written unless every input is valid.

    ``kv_cache_dtype="fp8"``: the caches are float8_e4m3fn and each key (value) element read
    is ``stored * k_scale`` (``* v_scale``); ``"auto"`` (default): the caches hold the query's
    dtype and the scales are ignored (but must still be finite and > 0).

    upstream: csrc/attention/paged_attention_v1.cu:46 @ v0.11.0
    """
    longest = check_decode_inputs(
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )
    check_out(out, query)
    scales = _cache_scales(key_cache, k_scale, v_scale)
    if longest == 0:
        return
    num_tokens = -(-longest // block_size) * block_size
    args = (query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            block_size, num_tokens, alibi_slopes, *scales)
    # Fast path: stale slots are masked by a -inf bias only. Should one hold NaN or inf, the
    # result is not finite, and the sanitized pass (the same maths) replaces it.
    logits, values = _gather_logits(*args, sanitize=False)
    result = _weighted_values(torch.softmax(logits, dim=-1), values)
    if not math.isfinite(result.sum().item()):
        logits, values = _gather_logits(*args, sanitize=True)
        result = _weighted_values(torch.softmax(logits, dim=-1), values)
    out.copy_(result.view(out.shape))


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Partitioned decode attention; same result as v1, written to ``out`` in place.

    Phase 1 fills, for partition ``p`` (tokens ``[p * PARTITION_SIZE, (p + 1) * PARTITION_SIZE)``):
    ``max_logits[s, h, p]`` = the partition's largest logit ``m_p``; ``exp_sums[s, h, p]`` =
    ``sum exp(logit - m_p)``; ``tmp_out[s, h, p]`` = the partition's own softmax-weighted values.
    Partitions that start past a sequence's end get ``m_p = -inf``, exp sum 0 and zeros (upstream
    leaves them unwritten). Phase 2 is ``paged_attention_v2_reduce``. ``kv_cache_dtype``,
    ``k_scale`` and ``v_scale`` as in ``paged_attention_v1``.

    upstream: csrc/attention/paged_attention_v2.cu:46 @ v0.11.0
    """
    longest = check_decode_inputs(
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )
    check_out(out, query)
    scales = _cache_scales(key_cache, k_scale, v_scale)
    if PARTITION_SIZE % block_size != 0:
        raise ValueError(f"block_size {block_size} must divide PARTITION_SIZE={PARTITION_SIZE}")
    parts = num_partitions(max_seq_len)
    check_v2_buffers(out, exp_sums, max_logits, tmp_out, parts)
    if longest == 0:
        return
    num_seqs, num_heads, head_size = query.shape
    used_parts = num_partitions(longest)
    num_tokens = -(-longest // block_size) * block_size
    logits, values = _gather_logits(
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        block_size,
        num_tokens,
        alibi_slopes,
        *scales,
    )
    # One step per partition, as the kernel's third grid dimension; all sequences and heads
    # at once. The last partition is as short as the longest context allows.
    for p in range(used_parts):
        part = slice(p * PARTITION_SIZE, (p + 1) * PARTITION_SIZE)
        chunk = logits[..., part]  # [seqs * kvh, group, <= P]
        part_max = chunk.amax(dim=-1)  # -inf where the partition starts past the sequence
        # Subtract a finite stand-in for empty partitions so exp() gives 0 rather than NaN.
        safe_max = torch.where(torch.isfinite(part_max), part_max, torch.zeros_like(part_max))
        weights = torch.exp(chunk - safe_max[..., None])
        part_sum = weights.sum(dim=-1)
        partial = _weighted_values(weights, values[..., part])  # [seqs * kvh, group, D]
        partial = partial / part_sum.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        exp_sums[:, :, p] = part_sum.view(num_seqs, num_heads)
        max_logits[:, :, p] = part_max.view(num_seqs, num_heads)
        tmp_out[:, :, p] = partial.view(num_seqs, num_heads, head_size)
    exp_sums[:, :, used_parts:] = 0.0
    max_logits[:, :, used_parts:] = float("-inf")
    tmp_out[:, :, used_parts:] = 0.0
    paged_attention_v2_reduce(out, exp_sums, max_logits, tmp_out, seq_lens)


def paged_attention_v2_reduce(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Merge per-partition results into ``out`` (phase 2 of v2).

    With ``M`` the largest ``m_p`` over a sequence's partitions, partition ``p`` weighs
    ``exp_sums[p] * exp(m_p - M)``: its exp sum rescaled from its own max to the common one. ``out``
    is the weighted mean of the partial outputs. Only the first ``ceil(seq_len / PARTITION_SIZE)``
    partitions of a sequence are read, so stale entries beyond them are harmless.

    upstream: csrc/attention/attention_kernels.cuh:562 @ v0.11.0
    """
    parts = exp_sums.shape[2]
    active = (
        torch.arange(parts, device=out.device)[None, :]
        < (-(-seq_lens.to(out.device, torch.int64) // PARTITION_SIZE))[:, None]
    )  # [seqs, parts]
    active = active[:, None, :]
    m = torch.where(active, max_logits, torch.full_like(max_logits, float("-inf")))
    global_max = m.amax(dim=-1, keepdim=True)
    global_max = torch.where(torch.isfinite(global_max), global_max, torch.zeros_like(global_max))
    rescaled = torch.where(active, exp_sums * torch.exp(m - global_max), torch.zeros_like(m))
    total = rescaled.sum(dim=-1, keepdim=True)
    weights = rescaled / total.clamp_min(torch.finfo(torch.float32).tiny)
    # Partitions past a sequence's end may hold anything, NaN included: never multiply them.
    partial = torch.where(active[..., None], tmp_out.float(), torch.zeros((), device=out.device))
    merged = (weights[..., None] * partial).sum(dim=2)
    out.copy_(merged)


def forward_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_kv_heads: int,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Allocate the output (and v2's buffers), pick v1 or v2 with ``use_v1``, and run it.

    upstream: vllm/attention/ops/paged_attn.py:96 @ v0.11.0
    """
    if query.dim() != 3 or value_cache.dim() != 4:
        raise ValueError(
            "query must be [num_seqs, num_heads, head_size] and value_cache "
            "[num_blocks, num_kv_heads, head_size, block_size]"
        )
    out = torch.empty_like(query)
    num_seqs, num_heads, head_size = query.shape
    block_size = value_cache.shape[-1]
    if use_v1(max_seq_len, num_seqs, num_heads):
        paged_attention_v1(
            out,
            query,
            key_cache,
            value_cache,
            num_kv_heads,
            scale,
            block_tables,
            seq_lens,
            block_size,
            max_seq_len,
            alibi_slopes,
            kv_cache_dtype,
            k_scale,
            v_scale,
        )
        return out
    parts = num_partitions(max_seq_len)
    exp_sums = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(
        num_seqs, num_heads, parts, head_size, dtype=query.dtype, device=query.device
    )
    paged_attention_v2(
        out,
        exp_sums,
        max_logits,
        tmp_out,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )
    return out
