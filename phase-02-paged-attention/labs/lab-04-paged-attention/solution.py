"""Lab 02-04 reference: PagedAttention in PyTorch.

The code lives once in ``mini_vllm.attention.paged_attn`` (layouts, v1, v2, the choice rule) and
``mini_vllm.attention.cache_ops`` (writing and moving cache blocks), and the FP8 conversions of
task 7 in ``mini_vllm.attention.fp8``; this file re-exports it.
"""

from __future__ import annotations

from mini_vllm.attention.cache_ops import (
    copy_blocks,
    reshape_and_cache,
    reshape_and_cache_flash,
    swap_blocks,
)
from mini_vllm.attention.fp8 import scaled_fp8_dequant, scaled_fp8_quant
from mini_vllm.attention.paged_attn import (
    PARTITION_SIZE,
    forward_decode,
    get_kv_cache_shape,
    kv_cache_x,
    paged_attention_v1,
    paged_attention_v2,
    paged_attention_v2_reduce,
    split_kv_cache,
    use_v1,
)

__all__ = [
    "PARTITION_SIZE",
    "kv_cache_x",
    "get_kv_cache_shape",
    "split_kv_cache",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_v2_reduce",
    "use_v1",
    "forward_decode",
    "copy_blocks",
    "swap_blocks",
    "scaled_fp8_quant",
    "scaled_fp8_dequant",
]
