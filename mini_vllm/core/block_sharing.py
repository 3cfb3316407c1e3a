"""Sharing blocks between sequences: fork and copy-on-write (lab 02-05).

Parallel sampling and beam search run several sequences over one prompt. Instead of storing the
prompt's KV once per sequence, :meth:`SharingKVCacheManager.fork` gives a child a block table
that lists its parent's blocks, one more reference each. Before a step writes into a block that
another table also lists, :meth:`SharingKVCacheManager.append_slots` gives the writer a fresh
block and returns the ``(src, dst)`` pair that the model runner must copy in every layer's cache
(``mini_vllm.attention.cache_ops.copy_blocks``) before the model writes: copy-on-write.

Invariants kept by every method (lab 02-05 checks them after every step of random workloads):

* each block's ``ref_cnt`` equals the number of block tables that list it;
* a request only writes into blocks that no other table lists;
* every request reads back exactly its own tokens through its table.

This is V0's design (v0.10.2: ``BlockTable.fork``, ``CopyOnWriteTracker``), rebuilt on the v1
block tables and block pool of ``KVCacheManager``. It is a subclass, not part of
``KVCacheManager`` itself, so that lab 02-03's manager keeps exactly the API of its lab; only
forked requests need ``append_slots``, every other request keeps using ``allocate_slots``.

upstream: vllm/core/block_manager.py:339 @ v0.10.2
"""

from __future__ import annotations

from mini_vllm.core.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request

__all__ = ["SharingKVCacheManager"]


class SharingKVCacheManager(KVCacheManager):
    """``KVCacheManager`` plus ``fork`` and copy-on-write; see the module docstring.

    upstream: vllm/core/block_manager.py:339 @ v0.10.2
    """

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` a block table that shares every block of ``parent``'s table.

        Nothing is copied: both tables list the same physical blocks and each block's
        ``ref_cnt`` grows by one, so a block returns to the free queue only when the last table
        holding it is freed. The child must be the parent up to what the parent has computed
        (same ``num_computed_tokens``, same tokens before it, and, with prefix caching, the same
        block hashes); the tokens after that may differ (each sample draws its own next token).
        The first write into a shared block goes through :meth:`append_slots`, which copies it.

        Raises ``ValueError`` and changes nothing for an unknown parent, a child id the manager
        already holds, a child that differs from its parent, or a parent whose cached blocks run
        ahead of its computed tokens (fork after the step that computed them).

        upstream: vllm/core/block_manager.py:339 @ v0.10.2
        """
        parent_id, child_id = parent.request_id, child.request_id
        if parent_id not in self.req_to_blocks:
            raise ValueError(
                f"fork: parent {parent_id!r} holds no blocks; allocate its prompt with "
                f"allocate_slots before forking it"
            )
        if child_id in self.req_to_blocks or child_id in self.num_cached_block:
            raise ValueError(
                f"fork: request id {child_id!r} is already in use; give the child a fresh id"
            )
        num_computed = parent.num_computed_tokens
        if (
            child.num_computed_tokens != num_computed
            or list(child.all_token_ids[:num_computed]) != list(parent.all_token_ids[:num_computed])
        ):
            raise ValueError(
                f"fork: child {child_id!r} must repeat the parent's {num_computed} computed "
                f"token(s) and have num_computed_tokens={num_computed}; build it from the "
                f"parent's tokens"
            )
        num_cached = self.num_cached_block[parent_id]
        if num_cached * self.block_size > num_computed:
            raise ValueError(
                f"fork: parent {parent_id!r} has cached blocks beyond its {num_computed} computed "
                f"token(s); fork after the step that computes them"
            )
        same_hashes = child.block_hashes[:num_cached] == parent.block_hashes[:num_cached]
        if self.enable_caching and not same_hashes:
            raise ValueError(
                f"fork: child {child_id!r} hashes its blocks differently from its parent; build "
                f"it with the parent's block hasher, LoRA adapter and cache salt"
            )
        parent_blocks = self.req_to_blocks[parent_id]
        # One more reference per block: the child's table is one more holder.
        self.block_pool.touch((parent_blocks,))
        # A list of its own: copy-on-write later replaces entries of one table only.
        self.req_to_blocks[child_id] = list(parent_blocks)
        self.num_cached_block[child_id] = num_cached

    def _get_blocks_to_copy_on_write(self, request: Request) -> list[int]:
        """Positions in ``request``'s table that its next write lands in and that are shared.

        The next step writes tokens from ``request.num_computed_tokens`` on, so the blocks at
        positions ``num_computed_tokens // block_size`` and later can be written; those with
        ``ref_cnt > 1`` are also read by another table and must be copied first. After a fork
        this is at most the partly filled last block: full blocks are never written again.

        upstream: vllm/core/block/common.py:115 @ v0.10.2
        """
        table = self.req_to_blocks[request.request_id]
        first_written = request.num_computed_tokens // self.block_size
        return [i for i in range(first_written, len(table)) if table[i].ref_cnt > 1]

    def _copy_on_write(self, request_id: str, positions: list[int]) -> list[tuple[int, int]]:
        """Replace the shared blocks at ``positions`` of a table by fresh private blocks.

        For each position: take a new block, put it in the table in place of the shared one,
        and drop this table's reference to the shared block (its other holders keep it, so it
        never reaches ``ref_cnt`` 0 here). Returns one ``(src, dst)`` block-id pair per copy:
        the caller must copy block ``src`` into block ``dst`` in every layer's cache before the
        model writes into ``dst``. The caller has checked that enough blocks are free.

        upstream: vllm/core/block/naive_block.py:225 @ v0.10.2
        """
        if not positions:
            return []
        table = self.req_to_blocks[request_id]
        fresh_blocks = self.block_pool.get_new_blocks(len(positions))
        shared_blocks = [table[i] for i in positions]
        copies = []
        for i, src, dst in zip(positions, shared_blocks, fresh_blocks):
            table[i] = dst
            copies.append((src.block_id, dst.block_id))
        self.block_pool.free_blocks(shared_blocks)
        return copies

    def append_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[tuple[int, int]] | None:
        """Room for ``num_new_tokens`` more tokens of a request that may share blocks.

        The step writes the KV of tokens ``num_computed_tokens .. num_computed_tokens +
        num_new_tokens - 1``. First every shared block among those it writes into is copied on
        write (:meth:`_copy_on_write`); then :meth:`allocate_slots` adds the blocks the new
        tokens need (and caches the blocks the step fills). Returns the ``(src, dst)`` copies,
        ``[]`` when nothing was shared, for the runner's ``copy_blocks``; or ``None``, changing
        nothing, when the free blocks cannot cover the copies plus the new blocks.

        Raises ``ValueError`` (changing nothing) for a request that holds no blocks yet (its
        first allocation goes through ``allocate_slots``), ``num_new_tokens < 1``, a negative
        lookahead, or more than ``max_model_len`` tokens.

        upstream: vllm/core/block_manager.py:236 @ v0.10.2
        """
        request_id = request.request_id
        if request_id not in self.req_to_blocks:
            raise ValueError(
                f"append_slots: request {request_id!r} holds no blocks; allocate its prompt with "
                f"allocate_slots (or fork it from a parent) first"
            )
        if not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"append_slots: num_new_tokens must be >= 1, got {num_new_tokens!r}")
        if num_lookahead_tokens < 0:
            raise ValueError(
                f"append_slots: num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}"
            )
        num_tokens = request.num_computed_tokens + num_new_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"append_slots: request {request_id!r} would hold {num_tokens} tokens, more "
                f"than max_model_len={self.max_model_len}; the scheduler must cap it"
            )
        if self.enable_caching:
            self._check_block_hashes(request)  # allocate_slots would raise after the copies
        positions = self._get_blocks_to_copy_on_write(request)
        num_tokens_need_slot = min(num_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(
            0, self._get_num_blocks_to_allocate(request_id, num_tokens_need_slot, [])
        )
        if len(positions) + num_new_blocks > self.block_pool.get_num_free_blocks():
            return None  # nothing has been touched yet
        copies = self._copy_on_write(request_id, positions)
        new_blocks = self.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
        )
        assert new_blocks is not None, "the free blocks were counted above"
        return copies
