"""Lab 03-03 starter: preemption by swapping.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
The scheduler of lab 03-01 is the base class (the reference, from ``mini_vllm``): it already
preempts, calls ``_preempt_by_swap`` in swap mode when the CPU pool has room, and calls
``_schedule_swapped`` before admitting waiting requests. You write those two methods and the
CPU swap space they use. The runner copies the blocks with
``mini_vllm.attention.cache_ops.swap_blocks`` (phase 02).

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-03-preemption -q
"""

from __future__ import annotations

from mini_vllm.block_pool import BlockPool
from mini_vllm.kv_cache_manager import cdiv
from mini_vllm.kv_cache_utils import KVCacheBlock
from mini_vllm.request import Request, RequestStatus
from mini_vllm.scheduler import Scheduler as _BaseScheduler
from mini_vllm.scheduler import _Step

__all__ = ["Scheduler", "SwapSpace"]


class SwapSpace:
    """CPU blocks of swapped-out requests (block 0 of the CPU pool is never used).

    ``req_to_cpu_blocks[r]`` lists request ``r``'s CPU blocks in block-table order: entry ``i``
    holds the KV of the request's logical block ``i``.
    """

    def __init__(self, num_cpu_blocks: int) -> None:
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 2:
            raise ValueError(
                f"SwapSpace: num_cpu_blocks must be an int >= 2 (block 0 is reserved), "
                f"got {num_cpu_blocks!r}"
            )
        self.block_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.req_to_cpu_blocks: dict[str, list[KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        """CPU blocks available for swapping out."""
        return self.block_pool.get_num_free_blocks()

    def can_swap_out(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` GPU blocks fit into the free CPU blocks."""
        return 0 <= num_blocks <= self.get_num_free_blocks()

    def num_swapped_blocks(self, request_id: str) -> int:
        """How many CPU blocks ``request_id`` holds (0 when it is not swapped out)."""
        return len(self.req_to_cpu_blocks.get(request_id, ()))

    def swap_out(self, request_id: str, gpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """Take one CPU block per GPU block from ``block_pool``, remember them for the request
        and return ``[(gpu_id, cpu_id), ...]``, pair ``i`` for logical block ``i``. Raise
        ``ValueError`` (changing nothing) when the request is already swapped out or the CPU pool
        lacks room."""
        raise NotImplementedError("lab 03-03, task 1: implement SwapSpace.swap_out")

    def swap_in(self, request_id: str, gpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """Pair the request's CPU blocks, in order, with ``gpu_block_ids`` (one per CPU block),
        free the CPU blocks and forget the request; return ``[(cpu_id, gpu_id), ...]``. Raise
        ``ValueError`` (changing nothing) when the request is not swapped out or the number of
        GPU blocks is wrong."""
        raise NotImplementedError("lab 03-03, task 2: implement SwapSpace.swap_in")

    def free(self, request_id: str) -> None:
        """Drop a swapped request's CPU blocks without copying (it finished or was aborted)."""
        cpu_blocks = self.req_to_cpu_blocks.pop(request_id, None)
        if cpu_blocks:
            self.block_pool.free_blocks(cpu_blocks)


class Scheduler(_BaseScheduler):
    """Lab 03-01's scheduler plus preemption by swapping (``preemption_mode="swap"``)."""

    swap_space_cls = SwapSpace

    def _preempt_by_swap(self, request: Request, step: _Step) -> None:
        """Park a preempted request's KV on the CPU (``_preempt`` has already counted it and
        checked that the CPU pool has room).

        Swap out the GPU blocks that hold its computed tokens (the first
        ``cdiv(num_computed_tokens, block_size)`` of its table), add the mapping to
        ``step.blocks_to_swap_out`` and to ``stats.num_blocks_swapped_out``, free its GPU
        blocks, set it SWAPPED *keeping* ``num_computed_tokens``, and append it to ``swapped``."""
        raise NotImplementedError("lab 03-03, task 3: implement Scheduler._preempt_by_swap")

    def _schedule_swapped(self, step: _Step) -> None:
        """Bring swapped requests back, front of ``swapped`` first, while budget is left and
        fewer than ``max_num_running_reqs`` run.

        For each: ``n = self._num_new_tokens(request, step.token_budget)`` (stop if 0); ask
        ``kv_cache_manager.allocate_slots(request, n)`` for its old KV *and* the new tokens (stop
        at None); pair its CPU blocks with the first new GPU blocks (``swap_in``) into
        ``step.blocks_to_swap_in`` and ``stats.num_blocks_swapped_in``; make it RUNNING at the
        back of ``running``; record it as a *resumed* request with its whole block table
        (``kv_cache_manager.get_blocks``), its tokens, and take them from the budget."""
        raise NotImplementedError("lab 03-03, task 4: implement Scheduler._schedule_swapped")


# Given for your convenience: blocks needed for n tokens = cdiv(n, block_size).
_ = (cdiv, RequestStatus)
