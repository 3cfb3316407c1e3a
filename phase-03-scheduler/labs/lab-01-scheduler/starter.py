"""Lab 03-01 starter: the scheduler and continuous batching.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Everything else is complete: the constructor, ``schedule()`` (which calls your helpers in the
right order), packaging the output, advancing ``num_computed_tokens`` and freeing a request.
The KV cache manager, the requests and the output dataclasses come from ``mini_vllm`` (earlier
labs and this phase's plumbing).

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-01-scheduler -q
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mini_vllm.config import SchedulerConfig
from mini_vllm.kv_cache_manager import KVCacheBlocks, KVCacheManager, cdiv
from mini_vllm.request import Request, RequestStatus
from mini_vllm.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["Scheduler", "SchedulerStats", "check_stop"]


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its last appended token; set its status if so.

    In this order: the length cap (``request.num_tokens >= max_model_len`` or
    ``num_output_tokens >= max_tokens``) gives ``FINISHED_LENGTH_CAPPED``; the EOS token (unless
    ``sampling_params.ignore_eos``) gives ``FINISHED_STOPPED``; a token of
    ``sampling_params.stop_token_ids`` gives ``FINISHED_STOPPED`` and is recorded in
    ``request.stop_reason``. Returns False (and changes nothing) otherwise.
    """
    raise NotImplementedError("lab 03-01, task 5: implement check_stop")


@dataclass
class SchedulerStats:
    """Counters for traces, benchmarks and the notebook (not part of any invariant)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_recomputed_tokens: int = 0


@dataclass
class _Step:
    """The scratch state of one ``schedule()`` call, shared by its helper methods.

    Your helpers record their decisions here: which requests were scheduled (by kind), which
    were preempted, the blocks each got (``req_to_new_blocks``), the tokens each got
    (``num_scheduled_tokens``) and the budget left (``token_budget``).
    """

    token_budget: int
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Continuous batching over one paged KV cache.

    Queues: ``waiting`` (a deque, FCFS; a preempted request goes back to its *head*),
    ``running`` (a list in admission order; the *last* one is the newest and the preemption
    victim). ``requests`` maps every unfinished request id to its request. This lab has no swap
    mode: ``swapped`` stays empty and ``swap_space`` is None. Lab 03-03 subclasses this class,
    sets ``swap_space_cls`` and adds ``_preempt_by_swap`` and ``_schedule_swapped``; the given
    code below already calls them when a swap space exists, so your scheduler runs swap mode
    once lab 03-03 is done (``python -m course engine`` puts the two together).
    """

    # Lab 03-03 sets its SwapSpace here; without one, preemption is by recompute only.
    swap_space_cls: type | None = None

    def __init__(self, scheduler_config: SchedulerConfig, log_stats: bool = False) -> None:
        if not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(
                "Scheduler: pass a mini_vllm.config.SchedulerConfig, got "
                f"{type(scheduler_config).__name__}"
            )
        self.scheduler_config = scheduler_config
        self.log_stats = log_stats
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = scheduler_config.block_size
        self.preemption_mode = scheduler_config.preemption_mode
        self.kv_cache_manager = KVCacheManager(
            num_blocks=scheduler_config.num_gpu_blocks,
            block_size=scheduler_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=scheduler_config.enable_prefix_caching,
            log_stats=log_stats,
        )
        if self.preemption_mode == "swap" and self.swap_space_cls is None:
            raise ValueError(
                "Scheduler: preemption_mode='swap' needs lab 03-03's swap space; this scheduler "
                "preempts by recompute only"
            )
        self.swap_space = (
            self.swap_space_cls(scheduler_config.num_cpu_blocks)
            if self.preemption_mode == "swap"
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished_req_ids: set[str] = set()
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of ``waiting`` and remember it in ``requests``.

        Raise ``ValueError`` (queueing nothing) for: a duplicate id; a request that is not new
        (status WAITING, nothing computed); a prompt with ``num_tokens >= max_model_len`` (no
        room for an output token); a request whose longest possible length,
        ``min(num_tokens + max_tokens, max_model_len)``, needs more blocks than the cache's
        ``num_gpu_blocks - 1`` usable blocks; a request without a block hasher
        (``request.get_hash_new_full_blocks is None``) while prefix caching is on.
        """
        raise NotImplementedError("lab 03-01, task 1: implement Scheduler.add_request")

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (a client abort): take each out of its queue
        (``running``, ``waiting`` or ``swapped``), set ``finished_status`` and free it with
        ``_free_request``. Unknown ids are ignored; a status that is not ``FINISHED_*`` is a
        ``ValueError``."""
        raise NotImplementedError("lab 03-01, task 6: implement Scheduler.finish_requests")

    def _free_request(self, request: Request) -> None:
        """Release a finished request's blocks (GPU, and CPU in swap mode), report it to the
        runner and forget it."""
        self.kv_cache_manager.free(request)
        if self.swap_space is not None:
            self.swap_space.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped out."""
        raise NotImplementedError("lab 03-01, task 1: implement get_num_unfinished_requests")

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        raise NotImplementedError("lab 03-01, task 1: implement has_unfinished_requests")

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""
        return len(self.running), len(self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: running requests first, then (swap mode, lab 03-03) swapped
        ones, then waiting ones, if nothing was preempted. (Complete: it calls your helpers.)"""
        step = _Step(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(step)
        if not step.preempted_reqs and self.swapped:
            self._schedule_swapped(step)  # lab 03-03; `swapped` stays empty without it
        if not step.preempted_reqs and not self.swapped:
            self._schedule_waiting(step)
        total = sum(step.num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens and step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        output = self._make_output(step, total)
        self._update_after_schedule(output)
        return output

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens a running request may get now: what it lacks (``num_tokens -
        num_computed_tokens``), capped by ``long_prefill_token_threshold`` when that is > 0, by
        ``token_budget``, and by ``max_model_len - 1 - num_computed_tokens``; never negative."""
        raise NotImplementedError("lab 03-01, task 2: implement Scheduler._num_new_tokens")

    def _schedule_running(self, step: _Step) -> None:
        """Walk ``running`` front to back while budget is left. For each request, ask
        ``kv_cache_manager.allocate_slots(request, n)`` for its ``n = _num_new_tokens(...)``
        tokens (skip it when ``n == 0``). When that returns None, pop the *last* running request,
        ``_preempt`` it and retry; if the victim was the request itself, stop the walk. Record
        each scheduled request in ``step`` (``scheduled_running_reqs``, ``req_to_new_blocks``,
        ``num_scheduled_tokens``) and decrement ``step.token_budget``."""
        raise NotImplementedError("lab 03-01, task 2: implement Scheduler._schedule_running")

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt ``request`` (already removed from ``running``): count it, record it in
        ``step``, then swap it out (lab 03-03, when a swap space has room for its computed
        blocks) or drop its KV with your ``_preempt_by_recompute``. (Complete.)"""
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        step.preempted_reqs.append(request)
        if self.swap_space is not None and request.num_computed_tokens > 0:
            num_blocks = cdiv(request.num_computed_tokens, self.block_size)
            if self.swap_space.can_swap_out(num_blocks):
                self.stats.num_swap_preemptions += 1
                self._preempt_by_swap(request, step)  # lab 03-03
                return
        self.stats.num_recompute_preemptions += 1
        self.stats.num_recomputed_tokens += request.num_computed_tokens
        self._preempt_by_recompute(request, step)

    def _preempt_by_recompute(self, request: Request, step: _Step) -> None:
        """Drop the KV of ``request`` (already removed from ``running`` and counted by
        ``_preempt``): free its blocks, set it PREEMPTED with ``num_computed_tokens = 0`` and put
        it at the head of ``waiting``, so that it is the first to be admitted again."""
        raise NotImplementedError("lab 03-01, task 3: implement Scheduler._preempt_by_recompute")

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests front to back while budget is left and fewer than
        ``max_num_running_reqs`` run. Start each from its prefix-cache hit
        (``kv_cache_manager.get_computed_blocks``), give it what it lacks (capped by the long
        prefill threshold and the budget), and allocate with the hit blocks. Stop at the first
        request that does not fit (FCFS). An admitted request leaves ``waiting``, joins
        ``running``, becomes RUNNING with ``num_computed_tokens`` = the hit (and
        ``num_cached_tokens`` = the hit the first time); it is a new request if it was WAITING, a
        resumed one if it was PREEMPTED. Its ``req_to_new_blocks`` entry is its *whole* block
        table (``kv_cache_manager.get_blocks``)."""
        raise NotImplementedError("lab 03-01, task 4: implement Scheduler._schedule_waiting")

    def _make_output(self, step: _Step, total: int) -> SchedulerOutput:
        """Package the step's decisions (``num_computed_tokens`` not yet advanced)."""
        new_reqs = [
            NewRequestData.from_request(r, step.req_to_new_blocks[r.request_id].get_block_ids())
            for r in step.scheduled_new_reqs
        ]
        cached = CachedRequestData.make_empty()
        for resumed, reqs in ((False, step.scheduled_running_reqs),
                              (True, step.scheduled_resumed_reqs)):
            for r in reqs:
                cached.req_ids.append(r.request_id)
                cached.resumed_from_preemption.append(resumed)
                cached.new_block_ids.append(
                    step.req_to_new_blocks[r.request_id].get_block_ids(allow_none=True)
                )
                cached.num_computed_tokens.append(r.num_computed_tokens)
        num_common = [0]
        if self.running:
            num_common = [
                self.kv_cache_manager.get_num_common_prefix_blocks(
                    self.running[0], len(self.running)
                )
            ]
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(step.num_scheduled_tokens),
            total_num_scheduled_tokens=total,
            num_common_prefix_blocks=num_common,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=[r.request_id for r in step.preempted_reqs],
            blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_swap_in=step.blocks_to_swap_in,
        )

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` now, so the next step can be scheduled at once."""
        for rid, n in output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        self.finished_req_ids = set()  # a fresh set: the output keeps the old one
        self.stats.num_steps += 1

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """For every request of ``scheduler_output.num_scheduled_tokens`` that still exists,
        append its sampled tokens (``model_runner_output.sampled_token_ids[index]``; an empty
        list means "still in prefill") one by one, calling ``check_stop`` after each and dropping
        the tokens after a stop. Return one ``EngineCoreOutput`` per request that gained tokens
        (with its finish reason, stop reason and ``max(num_cached_tokens, 0)``). Finally take
        every stopped request out of its queue and ``_free_request`` it."""
        raise NotImplementedError("lab 03-01, task 5: implement Scheduler.update_from_output")


