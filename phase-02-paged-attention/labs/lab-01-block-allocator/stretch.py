"""Lab 02-01, stretch (optional, not graded): move your block pool to today's vLLM.

The lab grades vLLM v0.11.0's behaviour, and your ``starter.py`` keeps it. The newest release
changed four things a reader meets in the same files (README: Stretch). Here you add three of
them, and today's tagged hash keys, *on top of your own classes*, behind the course's one switch
``mini_vllm.core.kv_cache_utils.use_today_behaviour``: with it off, everything below is your
``starter.py`` unchanged; with it on, today's behaviour.

Set ``STARTED = True`` when you begin: until then ``test_stretch.py`` skips, because the stretch
is optional. Then run your tests, and vLLM's own unit tests against your code::

    LAB_IMPL=starter python -m pytest \
        phase-02-paged-attention/labs/lab-01-block-allocator/test_stretch.py -q
    python upstream_refs/upstream_tests/run.py --impl stretch
"""

from __future__ import annotations

import os  # noqa: F401 - yours to use in task 3 (PYTHONHASHSEED)
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from course.labs.loader import load_script
from mini_vllm.core.kv_cache_utils import TODAY_NONE_HASH_SEED, is_today_behaviour

# Set to True when you start the stretch (its tests skip until then).
STARTED = False

# Your lab 02-01 code: the stretch builds on your own block pool.
yours = load_script("lab_02_01_starter_for_stretch", Path(__file__).resolve().with_name(
    "starter.py"))

KVCacheBlock = yours.KVCacheBlock
hash_block_tokens = yours.hash_block_tokens  # reads yours.NONE_HASH at call time

__all__ = ["STARTED", "TODAY_NONE_HASH_SEED", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock",
           "generate_block_hash_extra_keys", "hash_block_tokens", "init_none_hash",
           "none_hash"]


class FreeKVCacheBlockQueue(yours.FreeKVCacheBlockQueue):
    """Your queue, with today's second way in."""

    def prepend_n(self, blocks: list) -> None:
        """Link ``blocks`` in at the *front*, in the given order: ``blocks[0]`` becomes the
        first block ``popleft`` returns, ``blocks[-1]`` sits just before the old front.
        ``num_free_blocks`` grows by ``len(blocks)``; ``[]`` changes nothing; an empty queue
        works (the head sentinel is followed by the tail). O(len(blocks)), no walk of the queue.
        """
        raise NotImplementedError(
            "lab 02-01 stretch, task 1: implement FreeKVCacheBlockQueue.prepend_n (README: "
            "Stretch)")


class BlockPool(yours.BlockPool):
    """Your pool. The switch is read once, when the pool is built (as the reference does)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool,
                 enable_kv_cache_events: bool = False) -> None:
        super().__init__(num_gpu_blocks, enable_caching, enable_kv_cache_events)
        # Your constructor built your queue class; give it the stretch's (same fields).
        self.free_block_queue.__class__ = FreeKVCacheBlockQueue
        self.today = is_today_behaviour()

    def free_blocks(self, ordered_blocks: Iterable) -> None:
        if not self.today:
            return super().free_blocks(ordered_blocks)  # v0.11.0: your graded free_blocks
        return self.free_blocks_today(list(ordered_blocks))

    def free_blocks_today(self, blocks: list) -> None:
        """Today's ``free_blocks``: drop one reference per entry; of the blocks that reach 0
        (never the null block), those *without* a hash (or every one, when caching is off) go
        to the front of the free queue (``prepend_n``), the cached ones to the back
        (``append_n``), each group in the order their counts reach 0.

        Why: a block without a hash can never be a prefix hit, so handing it out next costs
        nothing, and the cached blocks behind it keep their least-recently-freed order longer.

        Errors: as your ``free_blocks``: a double free raises ``ValueError`` naming the block,
        and then no count, pointer or queue position differs from before the call.
        """
        raise NotImplementedError(
            "lab 02-01 stretch, task 2: implement BlockPool.free_blocks_today (README: Stretch)")


def none_hash() -> bytes:
    """The parent hash of every first block, as your ``hash_block_tokens`` reads it."""
    return yours.NONE_HASH


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set your ``starter.NONE_HASH``. Switch off: your starter's ``init_none_hash``.

    Switch on (today): ``hash_fn(PYTHONHASHSEED)`` when that variable is set, else
    ``hash_fn(TODAY_NONE_HASH_SEED)``: a fixed seed, so that processes that share a cache agree
    on every block hash without configuration (sha256 resists collisions whether or not the
    seed is known).
    """
    if not is_today_behaviour():
        yours.init_none_hash(hash_fn)
        return
    raise NotImplementedError(
        "lab 02-01 stretch, task 3: implement today's init_none_hash (README: Stretch)")


def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
    """Today's extra keys of the block covering ``[start_token_idx, end_token_idx)``:
    ``(keys, start_mm_idx)`` with ``keys`` a tuple of, in order, ``("lora", lora_name,
    lora_path)`` when the request has a LoRA adapter (every block; ``lora_path`` is
    ``getattr(request.lora_request, "lora_path", None)``: mini_vllm's adapters have none) and
    ``("cache_salt", salt)`` when ``request.cache_salt`` is a non-empty string and the block is
    the first (``start_token_idx == 0``), or ``None`` when neither applies. ``start_mm_idx``
    comes back unchanged (no multimodal inputs). Each key names its kind, so a salt can never
    be mistaken for an adapter's name.
    """
    raise NotImplementedError(
        "lab 02-01 stretch, task 4: implement today's generate_block_hash_extra_keys "
        "(README: Stretch)")
