"""Operations on the paged KV cache tensors, in PyTorch, in place.

``reshape_and_cache`` and ``reshape_and_cache_flash`` scatter freshly computed keys and values
into their slots; ``copy_blocks`` copies whole blocks inside each layer's cache (copy-on-write);
``swap_blocks`` copies whole blocks between two pools, possibly on different devices (swapping a
preempted sequence out to CPU and back). Upstream implements these as CUDA kernels; here they
are indexed assignments that run on any device.

Every function validates all of its inputs before it writes, so a bad call raises
``ValueError`` and leaves the caches exactly as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.attention.fp8 import scaled_fp8_quant
from mini_vllm.attention.paged_checks import (
    _memo,
    _same_inputs,
    _tensor_key,
    check_copy,
    check_flash_caches,
    check_paged_caches,
    check_slots,
    check_slots_all_valid,
    check_swap,
)

__all__ = [
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "copy_blocks",
    "swap_blocks",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Write token ``i``'s key and value into slot ``slot_mapping[i]`` of the paged caches.

    Layouts: ``key_cache [num_blocks, num_kv_heads, head_size // x, block_size, x]`` (``x =
    16 // element_size``) and ``value_cache [num_blocks, num_kv_heads, head_size, block_size]``.
    After the call, for every token with slot ``s = b * block_size + o >= 0`` and every ``h, d``:
    ``key_cache[b, h, d // x, o, d % x] == key[i, h, d]`` and
    ``value_cache[b, h, d, o] == value[i, h, d]``. Tokens with a negative slot are skipped and no
    other cache element changes.

    ``kv_cache_dtype="fp8"``: the caches are float8_e4m3fn (``x = 16``) and what is stored is
    ``scaled_fp8_quant(key, k_scale)`` (``value``, ``v_scale``): ``fp8(clamp(x / scale, -448,
    448))``. ``"auto"`` (default): the caches hold ``key``'s dtype and the scales are ignored.
    Either way the scales must be finite and > 0.

    upstream: csrc/cache_kernels.cu:214 @ v0.11.0
    """
    num_blocks, block_size = check_paged_caches(
        key, value, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale
    )
    num_tokens, num_kv_heads, head_size = key.shape
    x = key_cache.shape[4]
    slots, all_real = check_slots_all_valid(slot_mapping, num_tokens,
                                            num_blocks * block_size, key_cache.device)

    if all_real and len(slots) == num_tokens:  # the engine's case: every token has a slot
        real, k, v = slots, key.to(key_cache.device), value.to(value_cache.device)
    else:
        rows = torch.nonzero(slots >= 0).squeeze(1)
        real = slots[rows]
        k = key[rows.to(key.device)].to(key_cache.device)
        v = value[rows.to(value.device)].to(value_cache.device)
    if key_cache.dtype != key.dtype:  # fp8 (the checks allow no other mismatch)
        k, v = scaled_fp8_quant(k, float(k_scale)), scaled_fp8_quant(v, float(v_scale))
    blocks, offsets, key_index, value_index = _write_plan(
        real, block_size, num_kv_heads, head_size, x)
    # Split head_size into (head_size // x, x): chunk d // x, lane d % x. Each chunk's x lanes
    # are one 16-byte vector, written as one element of the cache viewed as such vectors.
    key_vectors = k.reshape(-1, num_kv_heads, head_size // x, x).contiguous()
    if (key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.storage_offset() % x == 0):
        key_cache.view(torch.complex128).view(-1).index_copy_(
            0, key_index, key_vectors.view(torch.complex128).view(-1))
        flat_values, v = value_cache.view(-1), v.reshape(-1)
        if flat_values.element_size() == 1:  # fp8: copied as the bytes they are
            flat_values, v = flat_values.view(torch.uint8), v.view(torch.uint8)
        flat_values.index_copy_(0, value_index, v)
    else:  # a strided view of a larger cache: the same writes, indexed by block and offset
        key_cache[blocks, :, :, offsets, :] = key_vectors
        value_cache[blocks, :, :, offsets] = v


def _write_plan(
    real: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int, x: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where ``reshape_and_cache`` writes the tokens of the ``real`` (non-negative) slots.

    ``(blocks, offsets, key_index, value_index)``: each token's block and offset in it;
    ``key_index [tokens * kv_heads * (head_size // x)]``: the 16-byte vectors of a contiguous
    key cache viewed as one flat run of them; ``value_index [tokens * kv_heads * head_size]``:
    the elements of a contiguous value cache. The engine writes every layer of a step to the
    same slots, so the last plan is reused while ``real`` is the same, unmodified tensor.
    """
    key = (*_tensor_key(real), block_size, num_kv_heads, head_size, x)
    plan = _same_inputs("write_plan", key)
    if plan is not None:
        return plan  # type: ignore[return-value]
    blocks, offsets = real // block_size, real % block_size
    heads = blocks[:, None] * num_kv_heads + torch.arange(num_kv_heads, device=real.device)
    chunks = torch.arange(head_size // x, device=real.device)
    dims = torch.arange(head_size, device=real.device)
    at = offsets[:, None, None]
    key_index = (heads[:, :, None] * (head_size // x) + chunks) * block_size + at
    value_index = (heads[:, :, None] * head_size + dims) * block_size + at
    plan = (blocks, offsets, key_index.reshape(-1), value_index.reshape(-1))
    _memo["write_plan"] = (key, plan)
    return plan


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write keys and values into the flash layout ``[num_blocks, block_size, kv_heads, head]``.

    After the call ``key_cache[s // block_size, s % block_size] == key[i]`` (same for values)
    for every token ``i`` with slot ``s = slot_mapping[i] >= 0``; nothing else changes.

    upstream: csrc/cache_kernels.cu:282 @ v0.11.0
    """
    num_blocks, block_size = check_flash_caches(key, value, key_cache, value_cache)
    slots = check_slots(slot_mapping, key.shape[0], num_blocks * block_size, key_cache.device)

    rows = torch.nonzero(slots >= 0).squeeze(1)
    real = slots[rows]
    blk, off = real // block_size, real % block_size
    key_cache[blk, off] = key[rows.to(key.device)].to(key_cache.device)
    value_cache[blk, off] = value[rows.to(value.device)].to(value_cache.device)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For each (src, dst) row of ``block_mapping``, copy block src to block dst in every layer.

    Works on any layout whose first dimension is the block. A block may not be both a source
    and a destination in one call (upstream's kernel copies all pairs at once, so such a call
    has no defined order). Other blocks are untouched.

    upstream: csrc/cache_kernels.cu:126 @ v0.11.0
    """
    src, dst = check_copy(key_caches, value_caches, block_mapping)
    caches = list(key_caches) + list(value_caches)
    for cache in caches:
        index_src, index_dst = src.to(cache.device), dst.to(cache.device)
        cache[index_dst] = cache[index_src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block ``m[i, 0]`` of ``src`` into block ``m[i, 1]`` of ``dst`` for every row.

    ``src`` and ``dst`` may live on different devices (a GPU cache and a CPU pool, or two CPU
    pools in this course); their per-block shape and dtype must agree. ``src`` is not changed.

    upstream: csrc/cache_kernels.cu:28 @ v0.11.0
    """
    src_ids, dst_ids = check_swap(src, dst, block_mapping)
    if src_ids.numel() == 0:
        return
    dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)
