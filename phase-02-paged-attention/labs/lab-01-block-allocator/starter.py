"""Lab 02-01 starter: the paged block allocator.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Everything else in this file is complete and is yours to read and use: the block metadata, the
queue's constructor with its two sentinels, the prefix-cache index, the request hasher and the
events.

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-01-block-allocator -q
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

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
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "sha256",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Hashes (complete)
# --------------------------------------------------------------------------------------------

BlockHash = NewType("BlockHash", bytes)
# Index key: a BlockHash followed by the KV-cache group id as 4 big-endian bytes (always 0 here).
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack a block hash and a group id into one bytes key."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block-hash part of a packed key."""
    return BlockHash(key[:-4])


def sha256(input: Any) -> bytes:  # noqa: A002
    """SHA-256 of the pickled input, as 32 raw bytes."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# The parent hash of every first block. Read it at call time (it can be re-initialised).
NONE_HASH: BlockHash


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set NONE_HASH: hash_fn(PYTHONHASHSEED) when that variable is set, else random bytes."""
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED")
    NONE_HASH = BlockHash(os.urandom(32) if seed is None else hash_fn(seed))


init_none_hash(sha256)


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block of tokens, chained onto its parent block's hash.

    Return ``hash_function((parent, tokens, extra_keys))`` where ``parent`` is
    ``parent_block_hash``, or ``NONE_HASH`` when there is no parent (``None``), and ``tokens`` is
    ``curr_block_token_ids`` as a tuple (lists are not the same pickle as tuples).

    Hint: why must the parent be part of the input? Think of two requests "ab|cd" and "xy|cd".
    """
    raise NotImplementedError("lab 02-01, task 5: implement hash_block_tokens")


def _extra_keys(request: Any, start_token_idx: int) -> tuple[Any, ...] | None:
    """LoRA id on every block, cache salt on the first block only; None when there are none."""
    keys: list[Any] = []
    if request.lora_request:
        keys.append(request.lora_request.lora_int_id)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Any], list[BlockHash]]:
    """Return ``hasher(request)``: hashes of the request's full blocks not yet in
    ``request.block_hashes``. Partial blocks are never hashed. (Complete; uses your
    ``hash_block_tokens``.)"""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")

    def request_block_hasher(request: Any) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + block_size <= request.num_tokens:
            tokens = request.all_token_ids[start : start + block_size]
            parent = hash_block_tokens(caching_hash_fn, parent, tokens, _extra_keys(request, start))
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher


# --------------------------------------------------------------------------------------------
# Block metadata (complete)
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class KVCacheBlock:
    """Metadata of one physical KV block.

    ``block_id`` is the block's address and never changes. ``ref_cnt`` counts its users.
    ``block_hash`` is set (once) while the block is full and cached, and cleared by
    ``reset_hash`` on eviction. ``prev_free_block`` / ``next_free_block`` are owned by
    FreeKVCacheBlockQueue and are both None while the block is not in the queue.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The packed hash key of this block, or None when it is not cached."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the block hash (the block was evicted)."""
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id})"
        )


# --------------------------------------------------------------------------------------------
# Tasks 1-4: the free queue
# --------------------------------------------------------------------------------------------


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as a doubly linked list through the blocks' own
    ``prev_free_block`` / ``next_free_block`` fields (no node objects).

    ``fake_free_list_head`` and ``fake_free_list_tail`` are sentinels that are always in the
    list and never popped: every real block in the queue has a real neighbour on both sides, so
    no method needs an "is it the first / last block?" branch. Keep ``num_free_blocks`` exact.
    A block that leaves the queue must have both pointers set back to None.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        first = blocks[0] if blocks else self.fake_free_list_tail
        last = blocks[-1] if blocks else self.fake_free_list_head
        self.fake_free_list_head.next_free_block = first
        first.prev_free_block = self.fake_free_list_head
        self.fake_free_list_tail.prev_free_block = last
        last.next_free_block = self.fake_free_list_tail

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the front block. On an empty queue raise
        ``ValueError("No free blocks available")``."""
        raise NotImplementedError("lab 02-01, task 2: implement FreeKVCacheBlockQueue.popleft")

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first ``n`` blocks, front first, in one walk. ``n == 0``
        returns ``[]``; ``n`` larger than the queue raises ValueError and changes nothing."""
        raise NotImplementedError("lab 02-01, task 2: implement FreeKVCacheBlockQueue.popleft_n")

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from the middle of the queue in O(1): relink its two neighbours,
        never walk the list. A block that is not in the queue (no neighbours) raises
        RuntimeError."""
        raise NotImplementedError("lab 02-01, task 3: implement FreeKVCacheBlockQueue.remove")

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` in at the back, just before the tail sentinel."""
        raise NotImplementedError("lab 02-01, task 4: implement FreeKVCacheBlockQueue.append")

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Link ``blocks`` in at the back, keeping their order (the first is evicted first)."""
        raise NotImplementedError("lab 02-01, task 4: implement FreeKVCacheBlockQueue.append_n")

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All real blocks in the queue, front to back (not the sentinels).

        Hint: start at ``fake_free_list_head.next_free_block`` and stop at the block whose
        ``next_free_block`` is None -- only the tail sentinel has none.
        """
        raise NotImplementedError(
            "lab 02-01, task 1: implement FreeKVCacheBlockQueue.get_all_free_blocks"
        )


# --------------------------------------------------------------------------------------------
# The prefix-cache index and events (complete)
# --------------------------------------------------------------------------------------------

MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class KVCacheEvent:
    """Base of the events ``BlockPool.take_events`` returns."""


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Blocks entered the prefix cache (hashes in chain order, their parent, their tokens)."""

    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[Any]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped."""


class BlockHashToBlockMap:
    """Packed block hash -> cached block, or ``{block_id: block}`` when several blocks share a
    hash (blocks are never deduplicated)."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any block cached under ``key`` (the first inserted), or None."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Add ``block`` under ``key``."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove and return block ``block_id`` under ``key``; None (no change) if absent."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: object) -> bool:
        return key in self._cache


# --------------------------------------------------------------------------------------------
# Tasks 6-11: the block pool
# --------------------------------------------------------------------------------------------


class BlockPool:
    """Owns every block; allocates, frees, and keeps the prefix-cache index.

    Invariants: I1 a block is in ``free_block_queue`` iff ``ref_cnt == 0`` and it is not the
    null block; I2 block ids never change and equal content is never merged; I3 only full
    blocks are cached; I4 a cached block with ``ref_cnt == 0`` stays in the free queue, where
    ``get_new_blocks`` may evict it or ``touch`` may revive it.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 is the permanent placeholder: out of the queue for good, never freed, cached,
        # handed out or counted as free. (Uses your popleft.)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """For each group id, the block cached under ``(block_hash, group id)``; None if any
        group misses. Changes nothing (the caller touches what it keeps)."""
        raise NotImplementedError("lab 02-01, task 10: implement BlockPool.get_cached_block")

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]``: block ``i`` gets the key
        ``make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)`` and goes
        into ``cached_block_hash_to_block``.

        Check everything before changing anything, with ValueError: the range must satisfy
        ``0 <= num_cached_blocks <= num_full_blocks <= len(blocks)``; the request must have at
        least ``num_full_blocks`` hashes (it only hashes full blocks: that is I3); no block in
        the range may already be cached or be the null block. With events enabled, record one
        ``BlockStored`` (hashes as BlockHash bytes; parent = hash of ``blocks[num_cached_blocks
        - 1]`` or None; the tokens of the range; ``lora_id`` from ``request.lora_request``).
        """
        raise NotImplementedError("lab 02-01, task 10: implement BlockPool.cache_full_blocks")

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue; each leaves with
        ``ref_cnt == 1`` and, when caching is on, evicted from the prefix cache first.
        More than are free (or a negative count): ValueError naming both numbers, no change."""
        raise NotImplementedError("lab 02-01, task 6: implement BlockPool.get_new_blocks")

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """If ``block`` is in the index, pop exactly its entry (other blocks under the same key
        stay), reset its hash, record a ``BlockRemoved`` when events are on, and return True;
        else return False."""
        raise NotImplementedError(
            "lab 02-01, task 7: implement BlockPool._maybe_evict_cached_block"
        )

    def touch(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        """Add a reference to every block (one list per KV-cache group). A block with
        ``ref_cnt == 0`` is in the free queue: remove it first (O(1)). Skip the null block."""
        raise NotImplementedError("lab 02-01, task 9: implement BlockPool.touch")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 (never the null block) go to the
        back of the free queue in the given order. Cached blocks keep their hash.
        A block whose ``ref_cnt`` is already 0 -- also when listed twice -- is a double free:
        ValueError, and no block may change."""
        raise NotImplementedError("lab 02-01, task 8: implement BlockPool.free_blocks")

    def reset_prefix_cache(self) -> bool:
        """If no block is in use (only the null block), drop the whole index and every block's
        hash, record ``AllBlocksCleared`` when events are on, and return True. Otherwise log a
        warning, change nothing and return False."""
        raise NotImplementedError("lab 02-01, task 11: implement BlockPool.reset_prefix_cache")

    def get_num_free_blocks(self) -> int:
        """Blocks that get_new_blocks can hand out."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call ([] when events are off); clears them."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
