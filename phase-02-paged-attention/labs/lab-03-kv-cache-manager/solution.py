"""Lab 02-03 reference: re-exports the KV cache manager and the request block hasher.

The code lives once, in ``mini_vllm`` (``kv_cache_manager.py`` and ``kv_cache_utils.py``).
"""

from __future__ import annotations

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, cdiv
from mini_vllm.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
    sha256,
)
from mini_vllm.metrics.stats import PrefixCacheStats
from mini_vllm.request import LoRARequest, Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "LoRARequest",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "cdiv",
    "get_request_block_hasher",
    "hash_block_tokens",
    "sha256",
]
