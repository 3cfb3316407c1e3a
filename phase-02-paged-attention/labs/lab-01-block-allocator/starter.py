"""Lab 02-01 starter: the paged block allocator.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors, and
how fast. How to get there is yours to work out; when stuck, climb the hint ladder: ``python -m
course hint 02-01 N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level
3`` (the idea, and the tests that check it), then ``--level 4`` (the upstream lines to read).

Everything else in this file is complete and is yours to read and use: the block metadata, the
queue's constructor with its two sentinels, the prefix-cache index and the events. (The request
hasher that chains your ``hash_block_tokens`` over a request's blocks is lab 02-03's first task.)

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-02-paged-attention/labs/lab-01-block-allocator -q
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
    """The name of one full block of tokens, chained onto the name of the block before it.

    Inputs: ``hash_function`` maps any picklable object to bytes; ``parent_block_hash`` is the
    hash of the previous block of the same sequence, or ``None`` (also ``b""``) for the first
    block; ``curr_block_token_ids`` is any sequence of ints; ``extra_keys`` is ``None`` or a tuple
    (LoRA id, cache salt) and defaults to ``None``.

    Output: exactly ``hash_function((parent, tokens, extra_keys))``, where ``parent`` is
    ``parent_block_hash`` or, when there is none, this module's ``NONE_HASH`` read at call time
    (it can be re-initialised), and ``tokens`` is a tuple (a list pickles differently, so the
    same tokens given as a list or a tuple must hash the same). Processes that share a cache must
    agree on this input bit for bit; the tests compare against an independent computation.

    Invariant: equal tokens under different parents give different hashes. Pure: no state.
    """
    raise NotImplementedError(
        "lab 02-01, task 5: implement hash_block_tokens (hint: python -m course hint 02-01 5)"
    )


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
    ``prev_free_block`` / ``next_free_block`` fields (no node objects are allocated).

    Invariants, after every method:

    * following ``next_free_block`` from ``fake_free_list_head`` reaches
      ``fake_free_list_tail`` through exactly the queued blocks, front first, and following
      ``prev_free_block`` from the tail walks the same blocks back;
    * the two sentinels (block id -1) are always in the list and never handed out;
    * ``num_free_blocks`` equals the number of queued blocks;
    * a block that is not in the queue has both pointers ``None`` (exactly ``None``).

    The front is the next block to be reused: the order of the queue is the eviction policy.
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
        """Take the front block out of the queue and return it.

        Output: the block that was first; it leaves with both pointers ``None`` and
        ``num_free_blocks`` drops by one. Errors: an empty queue raises
        ``ValueError("No free blocks available")`` (that exact message, as upstream) and
        changes nothing. O(1).
        """
        raise NotImplementedError(
            "lab 02-01, task 2: implement FreeKVCacheBlockQueue.popleft "
            "(hint: python -m course hint 02-01 2)"
        )

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first ``n`` blocks out of the queue; return them front first.

        Each leaves with both pointers ``None``; ``num_free_blocks`` drops by ``n``; ``n == 0``
        returns ``[]`` and changes nothing. Errors: ``n`` larger than the queue (or negative)
        raises ``ValueError`` naming ``n`` and changes nothing. O(n), one pass over the popped
        blocks (the pool calls this for every allocation).
        """
        raise NotImplementedError(
            "lab 02-01, task 2: implement FreeKVCacheBlockQueue.popleft_n "
            "(hint: python -m course hint 02-01 2)"
        )

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue, wherever it is.

        Afterwards its former neighbours link to each other, it has both pointers ``None`` and
        ``num_free_blocks`` drops by one; no other block changes. O(1): it must not walk the
        list (the test cuts both sentinels off the list first; a walk would crash). Errors: a
        block that is not in the queue (either pointer ``None``) raises ``RuntimeError`` naming
        its block id, and changes nothing.
        """
        raise NotImplementedError(
            "lab 02-01, task 3: implement FreeKVCacheBlockQueue.remove "
            "(hint: python -m course hint 02-01 3)"
        )

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` (not in the queue) at the back: it becomes the last to be reused.
        ``num_free_blocks`` grows by one. O(1)."""
        raise NotImplementedError(
            "lab 02-01, task 4: implement FreeKVCacheBlockQueue.append "
            "(hint: python -m course hint 02-01 4)"
        )

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` (none of them in the queue) at the back, in the given order: the first
        of them is reused first. ``[]`` changes nothing. O(len(blocks)), one pass."""
        raise NotImplementedError(
            "lab 02-01, task 4: implement FreeKVCacheBlockQueue.append_n "
            "(hint: python -m course hint 02-01 4)"
        )

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every real block in the queue, front to back, as a new list (never a sentinel).
        Changes nothing. O(n)."""
        raise NotImplementedError(
            "lab 02-01, task 1: implement FreeKVCacheBlockQueue.get_all_free_blocks "
            "(hint: python -m course hint 02-01 1)"
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
        """Look a full block up in the prefix cache.

        Output: one block per group id, in the order given: the block indexed under
        ``make_block_hash_with_group_id(block_hash, group_id)`` (with duplicates, the one indexed
        first); ``None`` when any group has none. Changes nothing, not even reference counts
        (the caller ``touch``-es the blocks it keeps). O(number of groups).
        """
        raise NotImplementedError(
            "lab 02-01, task 10: implement BlockPool.get_cached_block "
            "(hint: python -m course hint 02-01 10)"
        )

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Enter the request's newly full blocks into the prefix cache.

        Inputs: ``blocks`` is the request's whole block list, of which the first
        ``num_cached_blocks`` are cached already; ``request.block_hashes[i]`` is the hash of
        block ``i`` (a request hashes full blocks only).

        Afterwards each block ``i`` in ``blocks[num_cached_blocks:num_full_blocks]`` has
        ``block_hash == make_block_hash_with_group_id(request.block_hashes[i],
        kv_cache_group_id)`` and is indexed under that key, beside any other block with the
        same key (I2: never merged). Reference counts and the free queue do not change.
        ``num_cached_blocks == num_full_blocks`` changes nothing.

        Errors, all checked before anything changes (ValueError, nothing changed): the range
        must satisfy ``0 <= num_cached_blocks <= num_full_blocks <= len(blocks)`` (the message
        gives the three numbers); the request must have at least ``num_full_blocks`` hashes (I3;
        the message gives both numbers); no block in the range may be cached already or be the
        null block (the message names the block and which of the two it is).

        Events (only when enabled): one ``BlockStored`` per call that caches something, with
        the new hashes as BlockHash bytes in chain order, ``parent_block_hash`` = the BlockHash
        of ``blocks[num_cached_blocks - 1]`` (``None`` from the first block), the tokens of the
        range, ``block_size``, ``lora_id`` (``request.lora_request.lora_int_id`` or ``None``) and
        ``medium=MEDIUM_GPU``. O(number of new blocks).
        """
        raise NotImplementedError(
            "lab 02-01, task 10: implement BlockPool.cache_full_blocks "
            "(hint: python -m course hint 02-01 10)"
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks (``0 <= num_blocks <= get_num_free_blocks()``).

        Output: the blocks that were at the front of the free queue, in queue order; each leaves
        the queue (both pointers ``None``) with ``ref_cnt == 1``. With caching enabled, a block
        that is cached (it has a hash) is evicted first (task 7), so a later lookup of its old
        hash cannot find it. The prefix cache is not consulted for hits. An allocation that
        fits exactly, ``get_new_blocks(get_num_free_blocks())``, succeeds.

        Errors: more blocks than are free, or a negative count, raises ``ValueError`` whose
        message gives the number asked for and the number free, and changes nothing.
        O(num_blocks).
        """
        raise NotImplementedError(
            "lab 02-01, task 6: implement BlockPool.get_new_blocks "
            "(hint: python -m course hint 02-01 6)"
        )

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Evict ``block`` from the prefix cache if it is indexed.

        When ``block`` itself is indexed under its ``block_hash``: its entry is removed (other
        blocks under the same key stay indexed), its hash is reset, one
        ``BlockRemoved([its BlockHash], MEDIUM_GPU)`` is recorded when events are enabled, and
        the result is ``True``. Otherwise (no hash, or the key indexes only other blocks) nothing
        changes and the result is ``False``. O(1).
        """
        raise NotImplementedError(
            "lab 02-01, task 7: implement BlockPool._maybe_evict_cached_block "
            "(hint: python -m course hint 02-01 7)"
        )

    def touch(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        """Add one reference to every block of every list (one list per KV-cache group).

        A block whose ``ref_cnt`` was 0 is in the free queue (I1): it leaves the queue, from
        wherever it is, and keeps its hash (a prefix hit revives it, I4). The null block is
        never put into or taken out of the queue. O(number of blocks): never walk the queue
        (the test cuts the sentinels off first).
        """
        raise NotImplementedError(
            "lab 02-01, task 9: implement BlockPool.touch (hint: python -m course hint 02-01 9)"
        )

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per entry of ``ordered_blocks`` (any iterable, read once).

        Each block whose count reaches 0 (never the null block) joins the back of the free
        queue, in the order the counts reach 0: a block listed twice (held twice) joins once,
        at its second entry. Blocks still referenced stay out; cached blocks keep their hash and
        stay findable (I4). ``num_free_blocks`` grows by the number of blocks that joined.

        Errors: an entry whose block has no reference left (a double free, also a block listed
        more times than it is held) raises ``ValueError`` whose message gives the block id and
        how many times this call lists it; then no block, pointer or count may differ from
        before the call, whatever came before or after that entry. O(number of entries).
        """
        raise NotImplementedError(
            "lab 02-01, task 8: implement BlockPool.free_blocks "
            "(hint: python -m course hint 02-01 8)"
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache, if no block is in use.

        When every block but the null block is free: the index becomes empty, every block's
        hash is reset, the free queue keeps its order, ``AllBlocksCleared()`` is recorded when
        events are enabled, and the result is ``True``. Otherwise: a warning is logged (on this
        module's logger) that gives the number of blocks still in use, nothing changes and the
        result is ``False``. O(number of blocks).
        """
        raise NotImplementedError(
            "lab 02-01, task 11: implement BlockPool.reset_prefix_cache "
            "(hint: python -m course hint 02-01 11)"
        )

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
