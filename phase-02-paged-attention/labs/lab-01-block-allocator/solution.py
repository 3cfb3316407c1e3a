"""Lab 02-01 reference: the paged block allocator.

The code lives once, in ``mini_vllm.core.kv_cache_utils`` and ``mini_vllm.core.block_pool``; this
file only re-exports it under the names of ``starter.py``.
"""

from __future__ import annotations

from mini_vllm.core.block_pool import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHashToBlockMap,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from mini_vllm.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "get_block_hash",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "sha256",
]
