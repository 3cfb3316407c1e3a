"""Lab 03-03 starter: preemption by swapping.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors. How
to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 03-03
N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

The scheduler of lab 03-01 is the base class (the reference, from ``mini_vllm``): it already
preempts, calls ``_preempt_by_swap`` in swap mode when the CPU pool has room, and calls
``_schedule_swapped`` before admitting waiting requests. You write those two methods and the
CPU swap space they use. The runner copies the blocks with
``mini_vllm.attention.cache_ops.swap_blocks`` (phase 02).

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-03-preemption -q
"""

from __future__ import annotations

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_manager import cdiv
from mini_vllm.core.kv_cache_utils import KVCacheBlock
from mini_vllm.core.sched.scheduler import Scheduler as _BaseScheduler
from mini_vllm.core.sched.scheduler import _Step
from mini_vllm.request import Request, RequestStatus

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
        """Give ``request_id`` one CPU block per GPU block, to park its KV on the CPU.

        Input: the GPU block ids of the request's KV, in block-table order (entry ``i`` is its
        logical block ``i``). Output: ``[(gpu_id, cpu_id), ...]``, one pair per GPU block, in
        the same order: the runner copies GPU block ``gpu_id`` into CPU block ``cpu_id``. The
        CPU blocks come from ``self.block_pool`` (never block 0, never a block another request
        holds), and ``self.req_to_cpu_blocks[request_id]`` lists their ``KVCacheBlock`` objects
        in that same order (``free``, ``num_swapped_blocks`` and ``swap_in`` read it).
        Afterwards ``get_num_free_blocks()`` is lower by ``len(gpu_block_ids)``; using every
        free CPU block is allowed.

        Refused with ``ValueError``, and then nothing changes: a request already swapped out
        (the message names it); more blocks than the free CPU blocks (the message gives both
        numbers). Cost: O(len(gpu_block_ids)).
        """
        raise NotImplementedError(
            "lab 03-03, task 1: implement SwapSpace.swap_out (hint: python -m course hint 03-03 1)"
        )

    def swap_in(self, request_id: str, gpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """Bring ``request_id``'s parked KV back into the GPU blocks ``gpu_block_ids``.

        Input: a swapped-out request and exactly one GPU block per CPU block it holds, in
        block-table order. Output: ``[(cpu_id, gpu_id), ...]``: pair ``i`` is the request's
        ``i``-th CPU block (the one ``swap_out`` gave its logical block ``i``) with
        ``gpu_block_ids[i]``, so that the request resumes with exactly the KV it left with.
        Afterwards the request holds no CPU block (``num_swapped_blocks`` is 0; it may be
        swapped out again) and its CPU blocks are free again.

        Refused with ``ValueError``, and then nothing changes: a request that is not swapped
        out (the message names it); a number of GPU blocks other than its number of CPU blocks
        (the message gives both numbers). Cost: O(number of blocks).
        """
        raise NotImplementedError(
            "lab 03-03, task 2: implement SwapSpace.swap_in (hint: python -m course hint 03-03 2)"
        )

    def free(self, request_id: str) -> None:
        """Drop a swapped request's CPU blocks without copying (it finished or was aborted)."""
        cpu_blocks = self.req_to_cpu_blocks.pop(request_id, None)
        if cpu_blocks:
            self.block_pool.free_blocks(cpu_blocks)


class Scheduler(_BaseScheduler):
    """Lab 03-01's scheduler plus preemption by swapping (``preemption_mode="swap"``)."""

    swap_space_cls = SwapSpace

    def _preempt_by_swap(self, request: Request, step: _Step) -> None:
        """Preempt ``request`` by parking its KV on the CPU instead of dropping it.

        Input: a request already taken out of ``running``, counted and recorded in ``step`` by
        ``_preempt``, which has also checked that it has computed tokens and that the CPU pool
        can take the blocks that hold them.

        Afterwards: the GPU blocks holding its computed tokens, the first
        ``cdiv(num_computed_tokens, block_size)`` of its block table (the last one may be partly
        filled), in table order, are swapped out through ``self.swap_space.swap_out``; the pairs
        are appended to ``step.blocks_to_swap_out`` in that order and counted in
        ``self.stats.num_blocks_swapped_out``; its GPU blocks are back in the KV cache manager;
        its status is ``SWAPPED`` and its ``num_computed_tokens`` is *unchanged* (it resumes
        where it stopped); it is at the back of ``swapped``.
        """
        raise NotImplementedError(
            "lab 03-03, task 3: implement Scheduler._preempt_by_swap "
            "(hint: python -m course hint 03-03 3)"
        )

    def _schedule_swapped(self, step: _Step) -> None:
        """Resume swapped-out requests, first come first served, within ``step.token_budget``.

        ``schedule()`` calls it only in a step that preempted nobody, and while anyone is
        swapped out it admits no waiting request (V0's rule: parked requests go first).

        Requests resume from the front of ``swapped`` while budget is left and fewer than
        ``max_num_running_reqs`` requests run. Each gets ``n = self._num_new_tokens(request,
        step.token_budget)`` tokens, and GPU room both for the KV it parked (its
        ``num_computed_tokens`` still counts it) and for the ``n`` new tokens, claimed with
        ``kv_cache_manager.allocate_slots(request, n)``. The first request that cannot resume
        (``n`` is 0, or the claim returns None) ends it: nobody behind it overtakes it.

        Afterwards, for each resumed request, in order: its CPU blocks are paired, by
        ``self.swap_space.swap_in``, with the *first* ``num_swapped_blocks`` blocks of its new
        table (the pairs appended to ``step.blocks_to_swap_in`` and counted in
        ``self.stats.num_blocks_swapped_in``); it has left ``swapped`` and is at the back of
        ``running``, status ``RUNNING``; it is in ``step.scheduled_resumed_reqs`` (the runner
        replaces its old table) with its *whole* block table in ``step.req_to_new_blocks``
        (``kv_cache_manager.get_blocks``); ``step.num_scheduled_tokens`` holds its ``n`` and
        ``step.token_budget`` is lower by ``n``.
        """
        raise NotImplementedError(
            "lab 03-03, task 4: implement Scheduler._schedule_swapped "
            "(hint: python -m course hint 03-03 4)"
        )


# Given for your convenience: blocks needed for n tokens = cdiv(n, block_size).
_ = (cdiv, RequestStatus)
