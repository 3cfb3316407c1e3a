"""Lab 02-05 starter: sharing blocks between sequences with fork and copy-on-write.

You add four methods to the KV cache manager of lab 02-03. The manager itself (block tables,
``allocate_slots``, prefix caching, ``free``), the block pool, ``Request`` and the cache
operations of lab 02-04 are given: they come from ``mini_vllm``. Work in the task order of the
README and run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-05-sharing -q

Useful pieces of the base class: ``self.req_to_blocks[request_id]`` (the block table, a list of
``KVCacheBlock``), ``self.num_cached_block[request_id]``, ``self.block_pool`` (``touch``,
``get_new_blocks``, ``free_blocks``, ``get_num_free_blocks``), ``self.block_size``,
``self._get_num_blocks_to_allocate`` and ``self._check_block_hashes``.
"""

from __future__ import annotations

from mini_vllm.attention.cache_ops import copy_blocks, reshape_and_cache
from mini_vllm.attention.paged_attn import paged_attention_v1
from mini_vllm.kv_cache_manager import KVCacheBlocks
from mini_vllm.kv_cache_manager import KVCacheManager as _Lab03KVCacheManager
from mini_vllm.kv_cache_utils import KVCacheBlock, get_request_block_hasher, sha256
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

        Steps: validate (below), then add one reference to each of the parent's blocks
        (``self.block_pool.touch``), store a *new list* holding the same blocks as the child's
        table, and copy the parent's ``num_cached_block`` entry.

        Raise ``ValueError`` (and change nothing) when:

        * the parent holds no blocks (its id is not in ``self.req_to_blocks``);
        * the child's id is already in use (say "already in use" in the message);
        * ``child.num_computed_tokens != parent.num_computed_tokens``, or the child's first
          ``num_computed_tokens`` tokens differ from the parent's (the message must name ``fork``);
        * the parent's cached blocks cover more than its computed tokens;
        * with prefix caching on, the child's block hashes of the cached blocks differ from the
          parent's.
        """
        raise NotImplementedError("lab 02-05, task 1: implement KVCacheManager.fork")

    def _get_blocks_to_copy_on_write(self, request: Request) -> list[int]:
        """Positions in ``request``'s table that the next step writes into and that are shared.

        The next step writes tokens from ``request.num_computed_tokens`` on: positions
        ``num_computed_tokens // block_size`` and later may be written. Return, in order, those
        whose block has ``ref_cnt > 1``.
        """
        raise NotImplementedError(
            "lab 02-05, task 2: implement KVCacheManager._get_blocks_to_copy_on_write"
        )

    def _copy_on_write(self, request_id: str, positions: list[int]) -> list[tuple[int, int]]:
        """Replace the shared blocks at ``positions`` of the table by fresh private blocks.

        Take ``len(positions)`` new blocks from the pool, put them into the table in place of the
        shared ones, drop one reference from each shared block (``free_blocks``), and return one
        ``(src_block_id, dst_block_id)`` pair per copy, source first. Return ``[]`` for no
        positions. The caller has checked that enough blocks are free.
        """
        raise NotImplementedError("lab 02-05, task 3: implement KVCacheManager._copy_on_write")

    def append_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[tuple[int, int]] | None:
        """Room for ``num_new_tokens`` more tokens of a request that may share blocks.

        1. Validate: the request holds blocks ("holds no blocks" otherwise),
           ``num_new_tokens >= 1`` (name ``num_new_tokens``), ``num_lookahead_tokens >= 0``,
           ``num_computed_tokens + num_new_tokens <= max_model_len`` (name ``max_model_len``);
           with caching on call ``self._check_block_hashes(request)``. Raise ``ValueError``.
        2. Count the copies (task 2) and the new blocks
           (``self._get_num_blocks_to_allocate(request_id, n, [])`` with ``n`` the tokens that
           need a slot, lookahead included and capped at ``max_model_len``; never below 0). If
           they exceed the free blocks, return ``None`` before changing anything.
        3. Copy on write (task 3), then ``self.allocate_slots(request, num_new_tokens,
           num_lookahead_tokens=num_lookahead_tokens)``; return the copies.
        """
        raise NotImplementedError("lab 02-05, task 4: implement KVCacheManager.append_slots")
