"""Lab 02-05 reference: fork and copy-on-write.

The code lives once, in ``mini_vllm/core/block_sharing.py`` (``SharingKVCacheManager``: lab 02-03's
``KVCacheManager`` plus ``fork``, ``_get_blocks_to_copy_on_write``, ``_copy_on_write`` and
``append_slots``); this file re-exports it as the lab's ``KVCacheManager``, with the pieces of
earlier labs the tests use.
"""

from __future__ import annotations

from mini_vllm.attention.cache_ops import copy_blocks, reshape_and_cache
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.core.block_sharing import SharingKVCacheManager as KVCacheManager
from mini_vllm.core.kv_cache_manager import KVCacheBlocks
from mini_vllm.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, sha256
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "Request",
    "SamplingParams",
    "copy_blocks",
    "get_request_block_hasher",
    "paged_attention_v1",
    "reshape_and_cache",
    "sha256",
]
