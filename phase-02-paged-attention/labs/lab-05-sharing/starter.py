"""Lab 02-05 starter: sharing blocks between sequences with fork and copy-on-write.

You add four methods to the KV cache manager of lab 02-03. The manager itself (block tables,
``allocate_slots``, prefix caching, ``free``), the block pool, ``Request`` and the cache operations
of lab 02-04 are given: they come from ``mini_vllm``. Work in the task order of the README. Each
docstring is a contract; when stuck, climb the hint ladder: ``python -m course hint 02-05 N`` (a
question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), then ``--level 4`` (the upstream lines to read). Run the graded tests against
this file with::

    LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-05-sharing -q

Useful pieces of the base class: ``self.req_to_blocks[request_id]`` (the block table, a list of
``KVCacheBlock``), ``self.num_cached_block[request_id]``, ``self.block_pool`` (``touch``,
``get_new_blocks``, ``free_blocks``, ``get_num_free_blocks``), ``self.block_size``,
``self._get_num_blocks_to_allocate`` and ``self._check_block_hashes``.
"""

from __future__ import annotations

from mini_vllm.attention.cache_ops import copy_blocks, reshape_and_cache
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.core.kv_cache_manager import KVCacheBlocks
from mini_vllm.core.kv_cache_manager import KVCacheManager as _Lab03KVCacheManager
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


class KVCacheManager(_Lab03KVCacheManager):
    """Lab 02-03's manager plus fork and copy-on-write.

    Invariants your methods must keep (the tests check them after every step):

    * every block's ``ref_cnt`` equals the number of block tables that list it;
    * a request only ever writes into a block that no other table lists;
    * every request reads back exactly its own tokens through its table.
    """

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` a block table that shares every block of ``parent``'s table.

        Inputs: ``parent`` is tracked (it holds blocks); ``child`` is a new request that repeats
        the parent up to what the parent has computed: the same ``num_computed_tokens``, the
        same tokens before it, and (with prefix caching on) the same block hashes for the
        parent's cached blocks; after that its tokens may differ (it sampled its own next one).

        Afterwards: the child's table is a new list holding the parent's blocks in the same
        order (later copy-on-write replaces entries of one table only), each of those blocks
        has one more reference (through the pool), and the child's ``num_cached_block`` equals
        the parent's. No block is taken from the pool and no KV is copied.

        Errors: ``ValueError``, and nothing changes, for a parent that holds no blocks (naming
        it); a child id the manager already tracks (the message says "already in use"); a child
        whose ``num_computed_tokens`` or computed tokens differ from the parent's (the message
        names ``fork``); a parent whose cached blocks cover more tokens than it has computed;
        with caching on, child block hashes that differ from the parent's over its cached
        blocks. O(blocks in the table).
        """
        raise NotImplementedError(
            "lab 02-05, task 1: implement KVCacheManager.fork (hint: python -m course hint 02-05 1)"
        )

    def _get_blocks_to_copy_on_write(self, request: Request) -> list[int]:
        """The positions of ``request``'s table that its next step may write into and that
        another table also lists, in increasing order.

        The next step writes tokens from ``request.num_computed_tokens`` on, so every position
        from the block that holds token ``num_computed_tokens`` to the end of the table
        (lookahead blocks included) may be written; a block there is shared when its
        ``ref_cnt > 1``. Blocks before that position are never written again and are never
        listed. ``request`` is tracked. Changes nothing. O(positions examined).
        """
        raise NotImplementedError(
            "lab 02-05, task 2: implement KVCacheManager._get_blocks_to_copy_on_write "
            "(hint: python -m course hint 02-05 2)"
        )

    def _copy_on_write(self, request_id: str, positions: list[int]) -> list[tuple[int, int]]:
        """Replace the shared blocks at ``positions`` of the table by fresh, private blocks.

        Inputs: positions of a tracked request's table, in increasing order, each holding a
        block with ``ref_cnt > 1``; the caller has checked that ``len(positions)`` blocks are
        free.

        Afterwards: each of those positions holds a new block from the pool (taken in one
        ``get_new_blocks`` call, in the order the pool hands them out, with ``ref_cnt`` 1); each
        replaced block has one reference less and stays in the tables of its other holders;
        no other position or table changes. Output: one ``(src, dst)`` pair of block ids per
        position, in the order of ``positions``, source (the shared block) first: the runner
        copies ``src`` into ``dst`` in every layer before the model writes into ``dst``.
        ``[]`` for no positions, and then nothing changes. O(len(positions)).
        """
        raise NotImplementedError(
            "lab 02-05, task 3: implement KVCacheManager._copy_on_write "
            "(hint: python -m course hint 02-05 3)"
        )

    def append_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[tuple[int, int]] | None:
        """Room for ``num_new_tokens`` more tokens of a tracked request that may share blocks.

        The step writes the KV of tokens ``num_computed_tokens`` to ``num_computed_tokens +
        num_new_tokens - 1``. On success, afterwards: no block that the step may write into is
        listed by another table (each shared one was replaced, task 3), the table holds the
        slots ``allocate_slots(request, num_new_tokens,
        num_lookahead_tokens=num_lookahead_tokens)`` gives (and the blocks the step fills are
        cached, as there). Output: the ``(src, dst)`` copies, ``[]`` when nothing was shared.

        Refusal: ``None``, and nothing changes, exactly when the copies plus the new blocks the
        slots need (``_get_num_blocks_to_allocate``, where a result ``<= 0`` means none) are
        more than the free blocks. Exactly enough is enough.

        Errors: ``ValueError``, checked before anything changes, for a request that holds no
        blocks (the message says "holds no blocks"), ``num_new_tokens < 1`` (naming
        ``num_new_tokens``), ``num_lookahead_tokens < 0``, ``num_computed_tokens +
        num_new_tokens > max_model_len`` (naming ``max_model_len``), and, with caching on,
        block hashes that do not match the request's tokens (``_check_block_hashes``).
        O(copies + new blocks).
        """
        raise NotImplementedError(
            "lab 02-05, task 4: implement KVCacheManager.append_slots "
            "(hint: python -m course hint 02-05 4)"
        )
