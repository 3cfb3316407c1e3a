"""Lab 02-03 starter: the KV cache manager and prefix caching.

Fill in every body that raises ``NotImplementedError``, in the task order of the README. The
block pool, the block hash function, ``Request`` and ``SamplingParams`` are given (they come
from ``mini_vllm``); ``KVCacheBlocks``, the constructor and the small accessors of
``KVCacheManager`` are written for you.

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-03-kv-cache-manager -q
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mini_vllm.block_pool import BlockPool
from mini_vllm.kv_cache_utils import BlockHash, KVCacheBlock, hash_block_tokens, sha256
from mini_vllm.metrics import PrefixCacheStats
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


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many ``b``-sized blocks hold ``a`` tokens."""
    return -(a // -b)


# ---------------------------------------------------------------------------------------------
# Task 1: the request block hasher
# ---------------------------------------------------------------------------------------------


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Request], list[BlockHash]]:
    """Return ``hasher(request)``: the hashes of the request's full blocks not hashed yet.

    ``Request`` calls the hasher once when it is created and again after every
    ``append_output_token_ids``, and extends ``request.block_hashes`` with what it returns. So the
    hasher must:

    * start at block ``len(request.block_hashes)`` and chain onto ``request.block_hashes[-1]``
      (``None`` for the very first block: ``hash_block_tokens`` then uses ``NONE_HASH``);
    * hash only *full* blocks: tokens ``[i * block_size, (i + 1) * block_size)`` of
      ``request.all_token_ids``, while that range lies within ``request.num_tokens``;
    * pass extra keys, a tuple or ``None`` when there are none: the LoRA id
      (``request.lora_request.lora_int_id``) for every block when the request has an adapter,
      then ``request.cache_salt`` for the first block only (block 0) when it is set;
    * not modify the request.

    Raise ``ValueError`` for a ``block_size`` that is not a positive int. Use
    ``hash_block_tokens(caching_hash_fn, parent, tokens, extra_keys)``.
    """
    raise NotImplementedError("lab 02-03, task 1: implement get_request_block_hasher")


# ---------------------------------------------------------------------------------------------
# Given: the blocks handed to the scheduler
# ---------------------------------------------------------------------------------------------


@dataclass
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler.

    ``blocks[g][j]`` is the ``j``-th block of KV-cache group ``g``; there is exactly one group,
    so ``blocks`` is a 1-tuple of lists.
    """

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group by group."""
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group, e.g. ``([1, 2, 3],)``; ``None`` if ``allow_none`` and empty."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks that are not (yet) in the prefix cache."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids supports exactly one KV-cache group")
        return [blk.block_id for blk in self.blocks[0] if blk.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        """An instance with the same number of groups and no blocks."""
        return KVCacheBlocks(tuple([] for _ in range(len(self.blocks))))


# ---------------------------------------------------------------------------------------------
# Tasks 2-7: the manager
# ---------------------------------------------------------------------------------------------


class KVCacheManager:
    """Per-request block tables over a shared ``BlockPool``, with prefix caching.

    State (read the README's "invariants" before you start):

    * ``req_to_blocks[request_id]``: the request's block table, a list of ``KVCacheBlock``;
      logical block ``i`` of the request is ``req_to_blocks[request_id][i]``.
    * ``num_cached_block[request_id]``: how many blocks at the front of that table are in the
      prefix cache. A request is in this dict from its first allocation until ``free``.
    * ``block_pool``: the pool of the previous lab (``get_cached_block``, ``touch``,
      ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``, ``reset_prefix_cache``,
      ``get_num_free_blocks``). There is one KV-cache group, id ``kv_cache_group_id`` (0).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
    ) -> None:
        for name, value, low in (
            ("num_blocks", num_blocks, 2),
            ("block_size", block_size, 1),
            ("max_model_len", max_model_len, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"KVCacheManager: {name} must be an int >= {low}, got {value!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if log_stats else None
        )
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.kv_cache_group_id = 0
        self.num_kv_cache_groups = 1
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- given accessors ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are not free."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the statistics gathered since the last call and start new ones (or ``None``
        when ``log_stats`` is off)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table (empty for an unknown request)."""
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        return self.get_blocks(request_id).get_block_ids()

    def create_empty_block_list(self) -> KVCacheBlocks:
        """A ``KVCacheBlocks`` with one empty group."""
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    def take_events(self) -> list[Any]:
        """The block pool's KV-cache events since the last call."""
        return self.block_pool.take_events()

    def _check_block_hashes(self, request: Request) -> None:
        """Prefix caching reads ``request.block_hashes``: make sure they exist and match."""
        expected = request.num_tokens // self.block_size
        if len(request.block_hashes) != expected:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hash(es) "
                f"but {request.num_tokens} tokens need {expected} at block_size={self.block_size}; "
                f"create it with block_hasher=get_request_block_hasher({self.block_size}, sha256)"
            )

    # -- task 2: the prefix-cache lookup --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request``: ``(blocks, number of tokens)``.

        With caching off, return an empty list and 0. Otherwise call
        ``self._check_block_hashes(request)``, then look up at most ``request.num_tokens - 1``
        tokens' worth of blocks (the last token must always be computed, to get logits), with
        ``_find_longest_cache_hit``. When ``prefix_cache_stats`` is not ``None``, count one
        request, ``request.num_tokens`` queries and the hit tokens. Claim nothing here.
        """
        raise NotImplementedError("lab 02-03, task 2: implement KVCacheManager.get_computed_blocks")

    def _find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest run of leading hashes, covering at most
        ``max_length`` tokens (so at most ``max_length // block_size`` blocks).

        Use ``self.block_pool.get_cached_block(block_hash, [self.kv_cache_group_id])`` (a list
        with one block, or ``None``). Stop at the first miss: why is that always correct?
        """
        raise NotImplementedError(
            "lab 02-03, task 2: implement KVCacheManager._find_longest_cache_hit"
        )

    # -- task 3: how many free blocks an allocation consumes ------------------------------------

    def _get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks that giving the request ``num_tokens`` slots would consume.

        New blocks: ``cdiv(num_tokens, block_size)`` minus the blocks the request already holds
        minus the hit blocks. Plus: each hit block that is currently an eviction candidate
        (``ref_cnt == 0``, not the null block) sits in the free queue and is counted as free,
        and claiming it takes it out. Do not create a table entry for an unknown request.
        """
        raise NotImplementedError(
            "lab 02-03, task 3: implement KVCacheManager._get_num_blocks_to_allocate"
        )

    # -- task 4: allocation ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens; return the new blocks.

        In this order:

        1. Validate, changing nothing, and raise ``ValueError`` for: ``num_new_tokens < 1``;
           ``num_lookahead_tokens < 0``; ``num_new_computed_tokens`` different from
           ``len(hit blocks) * block_size``; hit blocks while caching is off; hit blocks for a
           request that already holds blocks; ``request.num_computed_tokens +
           num_new_computed_tokens + num_new_tokens > max_model_len``. With caching on and
           ``delay_cache_blocks`` false, also ``self._check_block_hashes(request)``.
        2. Slots needed: ``min(computed + new + lookahead, max_model_len)`` tokens. If
           ``_get_num_blocks_to_allocate`` exceeds the pool's free blocks, return ``None``:
           nothing may have changed.
        3. Claim the hit blocks (``block_pool.touch``, caching on only), then
           ``_save_new_computed_blocks``, then ``_allocate_new_blocks``.
        4. Unless caching is off or ``delay_cache_blocks``: ``cache_blocks`` up to
           ``min(computed + new, request.num_tokens)`` tokens (never the lookahead slots).
        5. Return the newly allocated blocks (not the hit blocks) as ``KVCacheBlocks``.
        """
        raise NotImplementedError("lab 02-03, task 4: implement KVCacheManager.allocate_slots")

    def _save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        """For a request with no table yet: start its table with the (claimed) hit blocks and
        record them as cached. A request that already has a table is left alone."""
        raise NotImplementedError(
            "lab 02-03, task 4: implement KVCacheManager._save_new_computed_blocks"
        )

    def _allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to ``cdiv(num_tokens, block_size)`` blocks with
        ``block_pool.get_new_blocks``; return the new blocks (``[]`` if none are needed)."""
        raise NotImplementedError(
            "lab 02-03, task 4: implement KVCacheManager._allocate_new_blocks"
        )

    # -- task 5: caching ------------------------------------------------------------------------

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_computed_tokens`` tokens.

        No-op with caching off. ``ValueError`` for a request without a table, or for more
        tokens than its blocks hold. Blocks ``[num_cached_block, num_computed_tokens //
        block_size)`` go to ``block_pool.cache_full_blocks(request=..., blocks=...,
        num_cached_blocks=..., num_full_blocks=..., block_size=..., kv_cache_group_id=...)``;
        then update ``num_cached_block``. A partial block is never cached.
        """
        raise NotImplementedError("lab 02-03, task 5: implement KVCacheManager.cache_blocks")

    # -- task 6: release ------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget its table; unknown requests are a no-op.

        ``block_pool.free_blocks`` appends blocks to the free queue in the order given, and the
        front of the queue is evicted first. Choose the order so that the request's last block
        is evicted before its first.
        """
        raise NotImplementedError("lab 02-03, task 6: implement KVCacheManager.free")

    # -- task 7: reset and common prefix --------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block via the pool; ``False`` (and nothing changes) while any
        block is in use. On success with stats on, set ``prefix_cache_stats.reset``."""
        raise NotImplementedError("lab 02-03, task 7: implement KVCacheManager.reset_prefix_cache")

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> list[int]:
        """``[n]``: how many leading blocks of ``request`` (which must be RUNNING, else
        ``ValueError``) have ``ref_cnt == num_running_requests``, counting until the first that
        does not."""
        raise NotImplementedError(
            "lab 02-03, task 7: implement KVCacheManager.get_num_common_prefix_blocks"
        )
