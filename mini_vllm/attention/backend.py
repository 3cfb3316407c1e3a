"""The attention backend the model runner plugs into every layer: store the step's K/V in the paged
cache, then attend (PagedAttention for decodes, chunked-prefill attention for prefill chunks).

It picks the CUDA kernels of ``mini_vllm.csrc`` on a GPU where they are built, the compiled CPU
kernels while lab 02-04's reference pieces are in place, and the PyTorch ops otherwise.

upstream: vllm/v1/attention/backends/ (one backend per platform); the decode/prefill split is
vllm/attention/ops/chunked_prefill_paged_decode.py @ v0.11.0
"""

from __future__ import annotations

import dataclasses

import torch

from mini_vllm.attention import cache_ops, chunked_prefill, cpu_kernels, paged_attn
from mini_vllm.attention.chunked_prefill import chunked_prefill_attention
from mini_vllm.attention.fp8 import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    is_fp8,
    scaled_fp8_dequant,
)
from mini_vllm.attention.metadata import AttentionMetadata

__all__ = ["PagedAttentionBackend"]


# The lab 02-04 pieces whose work the compiled CPU kernels do. When a student's piece (or a test's
# stand-in) replaces one of these names, the engine runs that piece instead of the kernels.
_KERNEL_REPLACES = (
    (cache_ops, ("reshape_and_cache",)),
    (paged_attn, ("forward_decode", "paged_attention_v1", "paged_attention_v2",
                  "paged_attention_v2_reduce", "use_v1")),
)


def _is_reference(piece: object, module) -> bool:
    """Whether ``piece`` is a function whose code is in ``module``'s own file. (Not an identity
    check against objects remembered at import: a copy of this module imported after
    composition, as the exam's stand-in students make, would remember the stand-ins' pieces as
    the reference.)"""
    code = getattr(piece, "__code__", None)
    return code is not None and code.co_filename == module.__file__


def _reference_pieces_in_place(prefill: bool = False) -> bool:
    """Whether every piece above is the reference's and, for a step with prefill tokens (which
    the fused step also attends for), the lab 03-02 prefill attention this runner calls too."""
    return (all(_is_reference(getattr(module, name), module)
                for module, names in _KERNEL_REPLACES for name in names)
            and (not prefill or _is_reference(chunked_prefill_attention, chunked_prefill)))


def _prefill_part(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of the prefill sequences only (they follow the decodes in the batch)."""
    d, t = meta.num_decodes, meta.num_decode_tokens
    return dataclasses.replace(
        meta,
        req_ids=meta.req_ids[d:],
        num_reqs=meta.num_prefills,
        num_actual_tokens=meta.num_prefill_tokens,
        num_decodes=0,
        num_decode_tokens=0,
        query_start_loc=meta.query_start_loc[d:] - t,
        seq_start_loc=meta.seq_start_loc[d:] - meta.seq_start_loc[d],
        query_lens=meta.query_lens[d:],
        seq_lens=meta.seq_lens[d:],
        context_lens=meta.context_lens[d:],
        positions=meta.positions[t:],
        slot_mapping=meta.slot_mapping[t:],
        block_tables=meta.block_tables[d:],
        max_seq_len=meta.max_prefill_seq_len,
        max_decode_seq_len=0,
    )


class PagedAttentionBackend:
    """Store the step's K/V in the paged cache, then attend: PagedAttention for the decodes,
    chunked-prefill attention for the prefill chunks (the batch is decodes-first).

    Uses the CUDA kernels of ``mini_vllm.csrc`` when the cache is on a GPU and they are built;
    on a CPU with an fp32 cache, the compiled CPU kernels (``mini_vllm.attention.cpu_kernels``)
    while lab 02-04's reference pieces are the ones in place; the PyTorch ops of
    ``mini_vllm.attention`` otherwise (all three compute the same thing).

    FP8 cache (``kv_cache_dtype="fp8"``): each layer's ``(k_scale, v_scale)`` comes from
    ``kv_scales`` (one pair per layer, in the order of ``kv_caches``), or, where that is
    ``None``, is computed once from the first K/V the layer sees (the first step's tokens):
    ``amax(|k|) / K_SCALE_CONSTANT`` and ``amax(|v|) / V_SCALE_CONSTANT``, as upstream's
    ``calc_kv_scales``. With the CUDA ops, the cache write and the decodes run the kernels' fp8
    path (``mini_vllm.csrc.ops``); chunked-prefill attention, which has no kernel, reads a
    dequantized copy of the prefill blocks in either case.

    ``kernel="triton"``: after the same cache write, the whole batch (decodes and prefill
    chunks) goes through lab 02-07's one Triton kernel
    (:func:`mini_vllm.attention.triton_unified.unified_attention`), compiled on a GPU and
    interpreted on a CPU; not with an fp8 cache.

    upstream: vllm/attention/ops/chunked_prefill_paged_decode.py:227 @ v0.11.0
    """

    def __init__(
        self,
        num_kv_heads: int,
        cuda_ops: object | None = None,
        kv_cache_dtype: str = "auto",
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        kv_scales: list[tuple[float, float]] | None = None,
        kernel: str = "paged",
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.fp8 = is_fp8(kv_cache_dtype)
        self.triton = _load_triton_unified() if kernel == "triton" else None
        if kernel not in ("paged", "triton") or (self.triton and self.fp8):
            raise ValueError(f"PagedAttentionBackend: kernel must be 'paged' or 'triton' (the "
                             f"latter with a cache of the model's dtype), got {kernel!r} with "
                             f"kv_cache_dtype={kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.cuda_ops = cuda_ops
        self.cpu_kernels = (
            cpu_kernels.load()
            if cuda_ops is None and not self.fp8 and not self.triton and kv_caches
            and cpu_kernels.supports(kv_caches[0][0].dtype, *kv_caches[0]) else None
        )
        # Which layer a key cache belongs to: the model hands the backend caches, not indices.
        self._layer_of = {k.data_ptr(): i for i, (k, _) in enumerate(kv_caches or [])}
        n = len(self._layer_of)
        self.kv_scales: list[tuple[float, float] | None] = (
            list(kv_scales) if kv_scales is not None else [None] * n
        )

    def _scales(self, key, value, key_cache) -> tuple[float, float]:
        layer = self._layer_of.get(key_cache.data_ptr())
        if layer is None:
            raise ValueError("an fp8 key cache this backend was not built with")
        scales = self.kv_scales[layer]
        if scales is None:  # calibrate once, on the first K/V this layer sees
            tiny = torch.finfo(torch.float32).tiny
            k_amax = max(float(key.detach().abs().amax()), tiny) if key.numel() else 1.0
            v_amax = max(float(value.detach().abs().amax()), tiny) if value.numel() else 1.0
            scales = (k_amax / K_SCALE_CONSTANT, v_amax / V_SCALE_CONSTANT)
            self.kv_scales[layer] = scales
        return scales

    def __call__(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale):
        if self.triton is not None:
            cache_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
            return self.triton.unified_attention(
                query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                meta.block_tables, scale, num_segments=self.triton.choose_num_segments(
                    meta.num_reqs, meta.max_query_len, self.num_kv_heads, meta.max_seq_len))
        if self.fp8:
            return self._forward_fp8(query, key, value, key_cache, value_cache, meta, scale)
        if (self.cpu_kernels is not None and query.dtype == torch.float32
                and _reference_pieces_in_place()):
            return self._forward_cpu_kernels(query, key, value, key_cache, value_cache, meta,
                                             scale)
        ops = self.cuda_ops
        if ops is not None and hasattr(ops, "reshape_and_cache"):
            ops.reshape_and_cache(key, value, key_cache, value_cache,
                                  meta.slot_mapping.to(key.device))
        else:
            cache_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        nd, nt = meta.num_decodes, meta.num_decode_tokens
        if not meta.num_prefills and (ops is None or not hasattr(ops, "paged_attention_v1")):
            # A pure decode step (the common one): no output buffer to assemble.
            return paged_attn.forward_decode(
                query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                meta.max_decode_seq_len, self.num_kv_heads, scale,
            )
        if not nd:
            return chunked_prefill_attention(query, key_cache, value_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            block_tables, seq_lens = meta.block_tables[:nd], meta.seq_lens[:nd]
            if ops is not None and hasattr(ops, "paged_attention_v1"):
                decode_out = torch.empty_like(query[:nt])
                ops.paged_decode(  # v1, v2 or the GQA-aware kernel (ops.choose_decode_kernel)
                    decode_out, query[:nt].contiguous(), key_cache, value_cache,
                    self.num_kv_heads, scale, block_tables.to(query.device),
                    seq_lens.to(query.device), key_cache.shape[3], meta.max_decode_seq_len, None,
                )
                out[:nt] = decode_out
            else:
                out[:nt] = paged_attn.forward_decode(
                    query[:nt], key_cache, value_cache, block_tables, seq_lens,
                    meta.max_decode_seq_len, self.num_kv_heads, scale,
                )
        if meta.num_prefills:
            out[nt:] = chunked_prefill_attention(
                query[nt:], key_cache, value_cache, _prefill_part(meta), scale
            )
        return out

    def _forward_cpu_kernels(self, query, key, value, key_cache, value_cache, meta, scale):
        """The same step through the compiled CPU kernels (the prefill chunks still through
        chunked-prefill attention, which reads the cache the kernel has just written)."""
        cpu_kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        nd, nt = meta.num_decodes, meta.num_decode_tokens

        def decode(q: torch.Tensor) -> torch.Tensor:
            return cpu_kernels.paged_decode(q, key_cache, value_cache, meta.block_tables[:nd],
                                            meta.seq_lens[:nd], self.num_kv_heads, scale)

        if not meta.num_prefills:
            return decode(query)
        if not nd:
            return chunked_prefill_attention(query, key_cache, value_cache, meta, scale)
        out = torch.empty_like(query)
        out[:nt] = decode(query[:nt])
        out[nt:] = chunked_prefill_attention(
            query[nt:], key_cache, value_cache, _prefill_part(meta), scale)
        return out

    def _forward_fp8(self, query, key, value, key_cache, value_cache, meta, scale):
        """The same step on an fp8 cache: quantize on write, dequantize on read."""
        k_scale, v_scale = self._scales(key, value, key_cache)
        fp8 = (self.kv_cache_dtype, k_scale, v_scale)
        ops = self.cuda_ops
        if ops is not None:
            ops.reshape_and_cache(key, value, key_cache, value_cache,
                                  meta.slot_mapping.to(key.device), *fp8)
        else:
            cache_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping,
                                        *fp8)
        nd, nt = meta.num_decodes, meta.num_decode_tokens
        out = query.new_empty(query.shape) if meta.num_prefills else None
        if nd and ops is not None:
            decoded = torch.empty_like(query[:nt])
            ops.paged_decode(  # v1, v2 or the GQA kernel's scalar path, each reading fp8
                decoded, query[:nt].contiguous(), key_cache, value_cache, self.num_kv_heads,
                scale, meta.block_tables[:nd].to(query.device),
                meta.seq_lens[:nd].to(query.device), key_cache.shape[3],
                meta.max_decode_seq_len, None, *fp8,
            )
        elif nd:
            decoded = paged_attn.forward_decode(
                query[:nt], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                meta.max_decode_seq_len, self.num_kv_heads, scale, None, *fp8,
            )
        if nd:
            if out is None:
                return decoded
            out[:nt] = decoded
        if meta.num_prefills:
            part = _prefill_part(meta) if nd else meta
            k_blocks, v_blocks, part = _dequantized_blocks(
                key_cache, value_cache, part, k_scale, v_scale, query.dtype)
            out[nt:] = chunked_prefill_attention(query[nt:], k_blocks, v_blocks, part, scale)
        return out


def _dequantized_blocks(key_cache, value_cache, meta: AttentionMetadata, k_scale: float,
                        v_scale: float, dtype: torch.dtype):
    """The blocks ``meta``'s tables name, dequantized into ``dtype``, and ``meta`` renumbered to
    read them (table entry ``(s, j)`` becomes block ``s * columns + j`` of the copy).

    Keeps the fp8 layout (``x = 16``), which ``chunked_prefill_attention`` reads like any other.
    Table padding may name any block; it is clamped into the cache and masked by the attention.
    """
    tables = meta.block_tables
    ids = tables.reshape(-1).to(key_cache.device, torch.int64).clamp(0, key_cache.shape[0] - 1)
    k = scaled_fp8_dequant(key_cache.index_select(0, ids), k_scale, dtype)
    v = scaled_fp8_dequant(value_cache.index_select(0, ids), v_scale, dtype)
    renumbered = torch.arange(ids.numel(), dtype=tables.dtype, device=tables.device)
    return k, v, dataclasses.replace(meta, block_tables=renumbered.view(tables.shape))


def _load_triton_unified():
    """Lab 02-07's kernel module (it imports Triton, so only when the backend is chosen)."""
    try:
        from mini_vllm.attention import triton_unified
    except ImportError as error:
        raise ImportError(f"attention_backend='triton' needs Triton, which ships wheels for "
                          f"Linux only (pip install -r requirements.txt installs it there): "
                          f"{error}") from error
    return triton_unified


def _load_cuda_ops(device: torch.device) -> object | None:
    """The compiled kernels when the device is a GPU and they load; ``None`` otherwise."""
    if device.type != "cuda":
        return None
    try:
        from mini_vllm.csrc import cuda_ops_available
    except ImportError:
        return None
    if not cuda_ops_available():
        return None
    # The checked wrappers (same signatures as the PyTorch ops), not the raw extension.
    from mini_vllm.csrc import ops

    return ops
