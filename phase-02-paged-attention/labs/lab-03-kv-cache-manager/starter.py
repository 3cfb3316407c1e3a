"""Lab 02-03 starter: the KV cache manager and prefix caching.

Fill in every body that raises ``NotImplementedError``, in the task order of the README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors, and
how fast. How to get there is yours to work out; when stuck, climb the hint ladder: ``python -m
course hint 02-03 N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level
3`` (the idea, and the tests that check it), then ``--level 4`` (the upstream lines to read).

Given (complete, from ``mini_vllm``): the block pool of lab 02-01 with its hash function,
``Request`` and ``SamplingParams``. Given here: ``KVCacheBlocks``, the manager's constructor and
its small accessors. Read ``mini_vllm/request.py`` before task 1.

Run the graded tests against this file with::

    LAB_IMPL=starter python -m pytest phase-02-paged-attention/labs/lab-03-kv-cache-manager -q
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import BlockHash, KVCacheBlock, hash_block_tokens, sha256
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


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many ``b``-sized blocks hold ``a`` tokens."""
    return -(a // -b)


# ---------------------------------------------------------------------------------------------
# Task 1: the request block hasher
# ---------------------------------------------------------------------------------------------


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Request], list[BlockHash]]:
    """Return ``hasher(request)``, which names the request's full blocks that have no name yet.

    ``Request(..., block_hasher=hasher)`` calls it once when the request is created and again
    after every ``append_output_token_ids``, and extends ``request.block_hashes`` with the list
    it returns. Block ``i`` of a request holds tokens ``[i * block_size, (i + 1) * block_size)``
    of ``request.all_token_ids``.

    Output of ``hasher(request)``: the hashes of blocks ``len(request.block_hashes)``, ... up to
    the last block that is *full* within ``request.num_tokens``, in order (``[]`` when no new
    block has filled). The hash of block ``i`` is exactly
    ``hash_block_tokens(caching_hash_fn, parent, tokens of block i, extra_keys)`` where
    ``parent`` is the hash of block ``i - 1`` (``None`` for block 0) and ``extra_keys`` is a
    tuple of, in this order: ``request.lora_request.lora_int_id`` when the request has a LoRA
    adapter (every block); ``request.cache_salt`` when it is a non-empty string (block 0 only);
    or ``None`` when neither applies. A partial block is never hashed.

    The hasher reads the request and never modifies it; it hashes only the new blocks (each
    block's hash is computed once in the request's life: O(new tokens) per call) and uses
    ``caching_hash_fn``, whatever function that is.

    Errors: a ``block_size`` that is not a positive int raises ``ValueError`` naming it, when
    ``get_request_block_hasher`` is called.
    """
    raise NotImplementedError(
        "lab 02-03, task 1: implement get_request_block_hasher "
        "(hint: python -m course hint 02-03 1)"
    )


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

    State (read the README's invariants M1-M5 before you start):

    * ``req_to_blocks[request_id]``: the request's block table, a list of ``KVCacheBlock``;
      logical block ``i`` of the request is ``req_to_blocks[request_id][i]``. It only grows
      (blocks are appended, never replaced or reordered) until ``free``.
    * ``num_cached_block[request_id]``: how many blocks at the front of that table are in the
      prefix cache.
    * A request is *tracked* from its first successful ``allocate_slots`` until ``free``: it is
      then in both dicts, and its table is never empty. Nothing else adds or removes entries.
    * ``block_pool``: the pool of lab 02-01 (``get_cached_block``, ``touch``,
      ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``, ``reset_prefix_cache``,
      ``get_num_free_blocks``), complete. There is one KV-cache group, id
      ``kv_cache_group_id`` (0).
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
        """Prefix caching reads ``request.block_hashes``: make sure they exist and match.
        Raises ``ValueError`` (and changes nothing) when they do not."""
        expected = request.num_tokens // self.block_size
        if len(request.block_hashes) != expected:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hash(es) "
                f"but {request.num_tokens} tokens need {expected} at block_size={self.block_size}; "
                f"create it with block_hasher=get_request_block_hasher({self.block_size}, sha256)"
            )

    # -- task 2: the prefix-cache lookup --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request``: ``(hit blocks, number of hit tokens)``.

        With caching off: ``(self.create_empty_block_list(), 0)`` (an empty ``KVCacheBlocks``,
        not a list), and nothing is counted.

        With caching on: ``request.block_hashes`` must match its tokens
        (``self._check_block_hashes(request)`` raises ``ValueError`` otherwise, before anything
        is counted). The hit is ``_find_longest_cache_hit`` of the request's hashes, limited so
        that it covers at most ``request.num_tokens - 1`` tokens (the last token is always
        computed: sampling needs its logits). Output: a ``KVCacheBlocks`` holding those blocks,
        and ``len(hit) * block_size``.

        Statistics, when ``self.prefix_cache_stats`` is not ``None``: one more request,
        ``request.num_tokens`` more queries, and the hit tokens more hits.

        Claims nothing: no reference count, free-queue position or table changes (the caller
        may never allocate the request). O(number of hit blocks).
        """
        raise NotImplementedError(
            "lab 02-03, task 2: implement KVCacheManager.get_computed_blocks "
            "(hint: python -m course hint 02-03 2)"
        )

    def _find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest run of *leading* hashes, covering at most
        ``max_length`` tokens (``max_length >= 0``).

        Output: ``[b_0, ..., b_{k-1}]`` where ``b_j`` is the block the pool's
        ``get_cached_block(block_hashes[j], [self.kv_cache_group_id])`` finds (its one element),
        and ``k`` is the largest count with every ``block_hashes[j]``, ``j < k``, cached and
        ``k * block_size <= max_length``. A hash cached *after* a miss is never part of the hit.
        Changes nothing. O(k + 1) lookups.
        """
        raise NotImplementedError(
            "lab 02-03, task 2: implement KVCacheManager._find_longest_cache_hit "
            "(hint: python -m course hint 02-03 2)"
        )

    # -- task 3: how many free blocks an allocation consumes ------------------------------------

    def _get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """How many blocks giving the request ``num_tokens`` slots in all (the tokens it already
        has slots for included) would take out of the free queue.

        Inputs: ``request_id`` is tracked or not (an unknown request holds no blocks);
        ``new_computed_blocks`` are the hit blocks of a request that is not tracked yet (``[]``
        otherwise).

        Output: the new blocks needed, ``cdiv(num_tokens, block_size)`` minus the blocks the
        request holds minus the hit blocks, plus every hit block that sits in the free queue
        now (``ref_cnt == 0``, never the null block): claiming it takes it out of the queue just
        as a new block would. A hit block that another request holds costs nothing. When the
        request already holds more blocks than ``num_tokens`` needs (lookahead slots from an
        earlier step), the new-block part is ``<= 0``: ``allocate_slots`` only compares the
        result with the free count, so ``0`` and upstream's negative difference are both right.

        Changes nothing: it never adds a table entry, not even for an unknown request.
        O(len(new_computed_blocks)).
        """
        raise NotImplementedError(
            "lab 02-03, task 3: implement KVCacheManager._get_num_blocks_to_allocate "
            "(hint: python -m course hint 02-03 3)"
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
        """Give ``request`` room for ``num_new_tokens`` more tokens; return the blocks it took.

        The request's tokens after the call, in order::

            | computed | hit (new computed) | new | lookahead |
            |<- request.num_computed_tokens ->|
                       |<- num_new_computed_tokens ->|<- num_new_tokens ->|

        Inputs: ``num_new_tokens >= 1`` tokens to compute now (a whole prompt, a chunk of it, or
        one decode token); ``num_new_computed_tokens`` and ``new_computed_blocks`` exactly as
        ``get_computed_blocks`` returned them (default: no hit; a hit is only for a request that
        is not tracked yet); ``num_lookahead_tokens >= 0`` extra slots for speculative tokens;
        ``delay_cache_blocks``: allocate but cache nothing yet (``cache_blocks`` comes later).

        On success, afterwards: the request is tracked; a new request's table starts with the
        hit blocks, each holding one more reference (a hit block that was free has left the
        free queue, keeping its hash), and ``num_cached_block`` counts them; the table then has
        ``cdiv(min(computed + hit + new + lookahead, max_model_len), block_size)`` blocks, or
        more if it had more (it never shrinks), the missing ones new from the pool. Unless
        caching is off or ``delay_cache_blocks``, every full block among the first
        ``min(computed + hit + new, request.num_tokens)`` tokens is cached (never a lookahead
        slot). Output: a ``KVCacheBlocks`` of the blocks taken from the pool by this call, in
        table order (not the hit blocks; an empty group when the table had room already).

        Refusal: ``None``, and nothing changes (no reference count, queue position, hash, table
        or count), exactly when the blocks this call would take out of the free queue (task 3)
        are more than ``block_pool.get_num_free_blocks()``. An allocation that fits exactly
        succeeds.

        Errors: ``ValueError``, checked before anything changes, for ``num_new_tokens < 1``;
        ``num_lookahead_tokens < 0``; ``num_new_computed_tokens != len(hit blocks) *
        block_size``; hit blocks while caching is off; hit blocks for a request that is tracked
        already; ``computed + hit + new > max_model_len``; and, with caching on and
        ``delay_cache_blocks`` false, block hashes that do not match the request's tokens
        (``_check_block_hashes``). Each message names the value that is wrong (the count, the
        request id, ``max_model_len``). O(hit blocks + new blocks).
        """
        raise NotImplementedError(
            "lab 02-03, task 4: implement KVCacheManager.allocate_slots "
            "(hint: python -m course hint 02-03 4)"
        )

    def _save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        """Start tracking a new request with its (already claimed) hit blocks.

        For a request that is not tracked: its table becomes a new list of the hit blocks (not
        the caller's list object) and ``num_cached_block`` records how many there are (they are
        cached already). For a tracked request, nothing changes: this happens only the first
        time. Reference counts are not touched here. O(len(new_computed_blocks)).
        """
        raise NotImplementedError(
            "lab 02-03, task 4: implement KVCacheManager._save_new_computed_blocks "
            "(hint: python -m course hint 02-03 4)"
        )

    def _allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow a tracked request's table to ``cdiv(num_tokens, block_size)`` blocks.

        The missing blocks come from ``block_pool.get_new_blocks`` in one call and are appended
        in the order the pool hands them out; the result is those new blocks (``[]`` when the
        table is long enough already: it never shrinks). The caller has checked capacity.
        O(new blocks).
        """
        raise NotImplementedError(
            "lab 02-03, task 4: implement KVCacheManager._allocate_new_blocks "
            "(hint: python -m course hint 02-03 4)"
        )

    # -- task 5: caching ------------------------------------------------------------------------

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Put the full blocks among the request's first ``num_computed_tokens`` tokens into the
        prefix cache.

        With caching off: nothing happens. Otherwise, afterwards the first
        ``num_computed_tokens // block_size`` blocks of the table are cached, block ``i`` under
        ``request.block_hashes[i]`` (``block_pool.cache_full_blocks`` does the indexing), and
        ``num_cached_block`` counts them. Blocks already cached are never passed to the pool
        again (the pool refuses a block that is cached already), and a count that does not go
        beyond the cached blocks changes nothing. A partial block is never cached. With KV-cache
        events on, the pool records one ``BlockStored`` per call that caches something, with
        the block size and group id you pass it: the manager's own.

        Errors: ``ValueError``, nothing changed, for a request that is not tracked (naming it),
        for more tokens than its table holds (giving both numbers), and for block hashes that
        do not match its tokens. O(newly cached blocks).
        """
        raise NotImplementedError(
            "lab 02-03, task 5: implement KVCacheManager.cache_blocks "
            "(hint: python -m course hint 02-03 5)"
        )

    # -- task 6: release ------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks and stop tracking it (finished, aborted or preempted).

        All of its blocks go back to the pool in one ``block_pool.free_blocks`` call, ordered so
        that the request's last block joins the free queue first and its first block last (the
        pool appends in the order given, and evicts from the front: the request's tail is
        evicted before its prefix). Blocks other requests hold stay theirs; cached blocks keep
        their hashes. Afterwards the manager knows nothing of the request (neither dict has
        it), so a later ``allocate_slots`` for the same request starts from scratch, as for a
        preempted request that is admitted again. A request that is not tracked: nothing
        happens. O(blocks held).
        """
        raise NotImplementedError(
            "lab 02-03, task 6: implement KVCacheManager.free (hint: python -m course hint 02-03 6)"
        )

    # -- task 7: reset and common prefix --------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, through the pool.

        ``True`` when it happened; then, with stats on, ``prefix_cache_stats.reset`` is set.
        ``False`` while any block is in use, and then nothing changes (the stats neither).
        """
        raise NotImplementedError(
            "lab 02-03, task 7: implement KVCacheManager.reset_prefix_cache "
            "(hint: python -m course hint 02-03 7)"
        )

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> list[int]:
        """``[n]``: how many leading blocks of ``request``'s table every running request shares.

        A block is shared by all ``num_running_requests`` running requests exactly when its
        ``ref_cnt`` equals that number; ``n`` counts from the front up to the first block that
        is not (``[0]`` for a request with no table). ``request`` must be RUNNING, else
        ``ValueError`` naming its status. Changes nothing. O(n + 1).
        """
        raise NotImplementedError(
            "lab 02-03, task 7: implement KVCacheManager.get_num_common_prefix_blocks "
            "(hint: python -m course hint 02-03 7)"
        )
