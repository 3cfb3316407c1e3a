"""The KV cache manager: each request's block table, and automatic prefix caching on top of it.

The scheduler talks to this class only. For every request it keeps the list of physical blocks
that hold the request's KV (``req_to_blocks``, the request's *block table*: logical block ``i`` is
``req_to_blocks[request_id][i]``), and it asks the :class:`~mini_vllm.core.block_pool.BlockPool` for
blocks, hands them back, and caches them for prefix reuse.

Prefix caching in three calls:

1. ``get_computed_blocks(request)`` looks the request's block hashes up in the cache, front to
   back, and stops at the first miss: because each hash chains its parent's, a miss at block
   ``i`` means no later block can be a valid hit. The hit never covers the last prompt token (the
   model must run on at least one token to produce logits).
2. ``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)``
   checks that the hit blocks plus the new blocks fit, and only then claims the hit blocks
   (``touch``), appends them to the block table, takes new blocks from the free queue, and caches
   every block that the step fills.
3. ``free(request)`` returns the blocks in reverse order, so that a request's tail (its most
   specific blocks) is evicted before its prefix (the blocks most likely to be shared).

mini_vllm has one KV-cache group (full attention). Upstream splits this work between
``KVCacheManager``, a coordinator and one ``SingleTypeKVCacheManager`` per group; here the full
attention manager's part is folded into this class as private methods named after upstream's.

upstream: vllm/v1/core/kv_cache_manager.py:85 @ v0.11.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from mini_vllm.metrics.stats import PrefixCacheStats
from mini_vllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the number of ``b``-sized blocks that hold ``a``.

    upstream: vllm/utils/__init__.py:959 @ v0.11.0
    """
    return -(a // -b)


@dataclass
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler.

    ``blocks[g][j]`` is the ``j``-th block of KV-cache group ``g``; mini_vllm always has exactly
    one group, so ``blocks`` is a 1-tuple of lists. The scheduler sees block ids only through
    :meth:`get_block_ids`.

    upstream: vllm/v1/core/kv_cache_manager.py:19 @ v0.11.0
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


class KVCacheManager:
    """Per-request block tables over a shared :class:`BlockPool`, with prefix caching.

    Invariants (for every request id ``r`` the manager knows):

    * ``req_to_blocks[r]`` is ``r``'s block table; it only grows (append-only) until ``free``;
      a block may appear in several tables (a shared prefix) and its ``ref_cnt`` is the number of
      tables holding it.
    * ``num_cached_block[r]`` blocks at the front of the table are in the prefix cache, and each
      has the hash ``r.block_hashes`` gives for that position; only full blocks are cached.
    * A failed ``allocate_slots`` (it returns ``None``) changes nothing.

    upstream: vllm/v1/core/kv_cache_manager.py:85 @ v0.11.0
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
        # Block 0 of the pool is the null block, so num_blocks - 1 blocks are usable.
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        # One group (full attention) with id 0: the id is packed into every cache key.
        self.kv_cache_group_id = 0
        self.num_kv_cache_groups = 1
        # request id -> its block table (logical block i -> physical block).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many blocks at the front of its table are cached. A request is in
        # this dict from its first allocation until it is freed.
        self.num_cached_block: dict[str, int] = {}
        # Tokens per request block hash: block_size at v0.11.0; today's behaviour may hash finer
        # (set with _use_hash_block_size before the first request).
        self.hash_block_size = block_size

    def _use_hash_block_size(self, hash_block_size: int) -> None:
        """Today's hash granularity: requests carry one hash every ``hash_block_size`` tokens
        (a divisor of ``block_size``); hits and cached blocks still go by whole blocks, each
        named by the hash at its last token. Call it before any request is allocated."""
        if not isinstance(hash_block_size, int) or hash_block_size < 1 or (
            self.block_size % hash_block_size
        ):
            raise ValueError(
                f"hash_block_size must be a positive divisor of block_size {self.block_size}, "
                f"got {hash_block_size!r}"
            )
        if self.req_to_blocks:
            raise ValueError("set hash_block_size before the first request is allocated")
        self.hash_block_size = hash_block_size
        self.block_pool.hash_block_size = hash_block_size

    # ------------------------------------------------------------------ queries

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are not free, in [0, 1].

        upstream: vllm/v1/core/kv_cache_manager.py:134 @ v0.11.0
        """
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the statistics gathered since the last call and start new ones.

        ``None`` when the manager was built with ``log_stats=False``.

        upstream: vllm/v1/core/kv_cache_manager.py:142 @ v0.11.0
        """
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table (empty for an unknown request).

        upstream: vllm/v1/core/kv_cache_manager.py:383 @ v0.11.0
        """
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group: ``([7, 3, 9],)``.

        upstream: vllm/v1/core/kv_cache_manager.py:387 @ v0.11.0
        """
        return self.get_blocks(request_id).get_block_ids()

    def create_empty_block_list(self) -> KVCacheBlocks:
        """A ``KVCacheBlocks`` with one empty group.

        upstream: vllm/v1/core/kv_cache_manager.py:396 @ v0.11.0
        """
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> list[int]:
        """Per group, how many leading blocks of ``request`` every running request shares.

        A block is shared by all running requests exactly when its ``ref_cnt`` equals
        ``num_running_requests``; count from the front until the first block that is not.

        upstream: vllm/v1/core/kv_cache_manager.py:332 @ v0.11.0
        """
        if request.status != RequestStatus.RUNNING:
            raise ValueError(
                f"get_num_common_prefix_blocks needs a RUNNING request; "
                f"{request.request_id!r} is {request.status}"
            )
        num_common = 0
        for block in self.req_to_blocks.get(request.request_id, []):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return [num_common]

    def take_events(self) -> list[Any]:
        """The block pool's KV-cache events since the last call (empty when events are off).

        upstream: vllm/v1/core/kv_cache_manager.py:375 @ v0.11.0
        """
        return self.block_pool.take_events()

    # ------------------------------------------------------------------ prefix-cache lookup

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request``, as blocks and as a number of tokens.

        The hit is a run of full blocks from the start of the request and stops at the first
        block whose hash is not cached. It never covers all of the request's tokens: at least
        the last token must be computed to get logits, so a fully cached prompt gives back its
        last full block too (the hit is rounded down to whole blocks below ``num_tokens - 1``).
        Nothing is claimed here: the blocks are claimed by :meth:`allocate_slots`. A request that
        asks for ``prompt_logprobs`` gets no hit: every prompt position must be computed to be
        scored.

        upstream: vllm/v1/core/kv_cache_manager.py:154 @ v0.11.0
        """
        wants_prompt_logprobs = getattr(getattr(request, "sampling_params", None),
                                        "prompt_logprobs", None) is not None
        if not self.enable_caching or wants_prompt_logprobs:
            return self.create_empty_block_list(), 0
        self._check_block_hashes(request)
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = self._find_longest_cache_hit(request.block_hashes, max_cache_hit_length)
        num_new_computed_tokens = len(computed_blocks) * self.block_size
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_new_computed_tokens
        return KVCacheBlocks((computed_blocks,)), num_new_computed_tokens

    def _find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks for the longest run of leading hashes, at most ``max_length`` tokens.

        upstream: vllm/v1/core/single_type_kv_cache_manager.py:252 @ v0.11.0
        """
        computed: list[KVCacheBlock] = []
        max_num_blocks = max_length // self.block_size
        # getattr: lab 02-03's starter builds managers with v0.11.0's constructor (and its
        # tasks are filled from these methods by scripts/task_by_task.py).
        step = self.block_size // getattr(self, "hash_block_size", self.block_size)
        if step > 1:  # finer hashes: a block is named by the hash at its last token
            block_hashes = block_hashes[step - 1 :: step]
        for block_hash in block_hashes[:max_num_blocks]:
            cached = self.block_pool.get_cached_block(block_hash, [self.kv_cache_group_id])
            if cached is None:
                break  # chained hashes: after a miss, no later block can be a valid hit
            computed.append(cached[0])
        return computed

    # ------------------------------------------------------------------ allocation

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

        Layout of the request's tokens after the call::

            | computed | new computed (cache hit) | new | lookahead |
            |<-- request.num_computed_tokens -->|
                       |<- num_new_computed_tokens ->|<- num_new_tokens ->|

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are what ``get_computed_blocks``
        returned (only for a request that holds no blocks yet). Returns ``None``, changing
        nothing, when the free blocks cannot cover both the new blocks *and* the hit blocks that
        currently sit in the free queue (claiming those takes them out of it). Otherwise claims
        the hit blocks, allocates the new ones, and caches every full block up to
        ``num_computed_tokens + num_new_tokens`` (capped at ``request.num_tokens``) unless
        caching is off or ``delay_cache_blocks``.

        Raises ``ValueError`` (and changes nothing) for ``num_new_tokens < 1``, a hit whose size
        does not match its blocks, hit blocks for a request that already holds blocks, or more
        than ``max_model_len`` tokens.

        upstream: vllm/v1/core/kv_cache_manager.py:193 @ v0.11.0
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"allocate_slots: num_new_tokens must be >= 1, got {num_new_tokens!r}")
        if num_lookahead_tokens < 0:
            raise ValueError(
                f"allocate_slots: num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}"
            )
        new_computed_block_list = (
            new_computed_blocks.blocks[0] if new_computed_blocks is not None else []
        )
        if num_new_computed_tokens != len(new_computed_block_list) * self.block_size:
            raise ValueError(
                f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} does not "
                f"match {len(new_computed_block_list)} hit block(s) of {self.block_size} tokens; "
                f"pass both values exactly as get_computed_blocks returned them"
            )
        if new_computed_block_list and not self.enable_caching:
            raise ValueError("allocate_slots: prefix caching is off, so there can be no hit blocks")
        if new_computed_block_list and request.request_id in self.num_cached_block:
            raise ValueError(
                f"allocate_slots: request {request.request_id!r} already holds blocks; cache "
                f"hits are only taken when a request is first allocated"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if num_computed_tokens + num_new_tokens > self.max_model_len:
            raise ValueError(
                f"allocate_slots: request {request.request_id!r} would hold "
                f"{num_computed_tokens + num_new_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}; the scheduler must cap it"
            )
        if self.enable_caching and not delay_cache_blocks:
            self._check_block_hashes(request)

        # Lookahead slots (speculative tokens) never push the request past the model's length.
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_blocks_to_allocate = self._get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed_block_list
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None  # nothing has been touched yet

        # Claim the hit blocks first, so that allocating the new blocks cannot evict them.
        if self.enable_caching:
            self.block_pool.touch((new_computed_block_list,))
        self._save_new_computed_blocks(request.request_id, new_computed_block_list)
        new_blocks = self._allocate_new_blocks(request.request_id, num_tokens_need_slot)

        if not self.enable_caching or delay_cache_blocks:
            return KVCacheBlocks((new_blocks,))
        # Cache only tokens the request really has: lookahead slots hold nothing final yet.
        num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
        self.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks((new_blocks,))

    def _get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks this allocation consumes: new blocks plus hit blocks now in the free queue.

        A hit block with ``ref_cnt == 0`` is an eviction candidate counted as free; claiming it
        takes it out of the free queue, so it weighs on free capacity like a new block.

        upstream: vllm/v1/core/single_type_kv_cache_manager.py:59 @ v0.11.0
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, []))
        num_new_blocks = num_required_blocks - len(new_computed_blocks) - num_held
        num_evictable_computed_blocks = sum(
            blk.ref_cnt == 0 and not blk.is_null for blk in new_computed_blocks
        )
        return num_new_blocks + num_evictable_computed_blocks

    def _save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        """Start a new request's block table with its (already claimed) hit blocks.

        upstream: vllm/v1/core/single_type_kv_cache_manager.py:88 @ v0.11.0
        """
        if request_id not in self.num_cached_block:
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            # Hit blocks are cached already: caching resumes after them.
            self.num_cached_block[request_id] = len(new_computed_blocks)

    def _allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the block table to ``cdiv(num_tokens, block_size)`` blocks; return the new ones.

        upstream: vllm/v1/core/single_type_kv_cache_manager.py:109 @ v0.11.0
        """
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Put the request's full blocks among its first ``num_computed_tokens`` tokens into the
        prefix cache (those not cached yet). A partial block is never cached.

        upstream: vllm/v1/core/kv_cache_manager.py:391 @ v0.11.0
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        if request_id not in self.num_cached_block:
            raise ValueError(f"cache_blocks: request {request_id!r} holds no blocks")
        req_blocks = self.req_to_blocks[request_id]
        if num_computed_tokens > len(req_blocks) * self.block_size:
            raise ValueError(
                f"cache_blocks: request {request_id!r} holds {len(req_blocks)} block(s), too few "
                f"for {num_computed_tokens} tokens"
            )
        self._check_block_hashes(request)
        num_cached_blocks = self.num_cached_block[request_id]
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=req_blocks,
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full_blocks

    # ------------------------------------------------------------------ release

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first; unknown requests are a no-op.

        Freed blocks join the back of the free queue in the order given, so the request's last
        block is evicted first and its first block (the most shareable prefix) last.

        upstream: vllm/v1/core/single_type_kv_cache_manager.py:156 @ v0.11.0
        """
        req_blocks = self.req_to_blocks.pop(request.request_id, [])
        ordered_blocks = reversed(req_blocks)
        self.block_pool.free_blocks(ordered_blocks)
        self.num_cached_block.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refuses (returns ``False``) while any block is in use.

        upstream: vllm/v1/core/kv_cache_manager.py:316 @ v0.11.0
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # ------------------------------------------------------------------ helpers

    def _check_block_hashes(self, request: Request) -> None:
        """Prefix caching reads ``request.block_hashes``: make sure they exist and match."""
        hash_block_size = getattr(self, "hash_block_size", self.block_size)
        expected = request.num_tokens // hash_block_size
        if len(request.block_hashes) != expected:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hash(es) "
                f"but {request.num_tokens} tokens need {expected} at block_size="
                f"{hash_block_size}; create it with block_hasher="
                f"get_request_block_hasher({hash_block_size}, sha256) "
                f"(mini_vllm.core.kv_cache_utils)"
            )
