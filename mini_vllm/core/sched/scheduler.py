"""The scheduler: which requests run in the next step, and with how many tokens each.

There is no "prefill phase" and no "decode phase". Every request has ``num_tokens`` (prompt plus
output so far) and ``num_computed_tokens`` (tokens whose KV is in the cache); each step hands out
at most ``max_num_batched_tokens`` new tokens so that requests catch up. A long prompt simply
takes several steps (chunked prefill); a request that has caught up gets one token (decode).

One step of :meth:`Scheduler.schedule`:

1. RUNNING requests first, in queue order. Each gets ``min(tokens it lacks, budget left)``
   tokens (and at most ``long_prefill_token_threshold`` when that is set). If the KV cache
   cannot hold them, the scheduler preempts the *last* running request (the newest) and tries
   again; if the request itself is the last one, it is preempted and the loop stops.
2. SWAPPED requests (swap mode only), if nothing was preempted in this step: copy their KV back.
3. WAITING requests, if nothing was preempted and nobody is swapped out: admit them in FCFS order
   while the budget, ``max_num_seqs`` and the KV cache allow, starting from their prefix-cache
   hit. A preempted request is back at the head of the waiting queue.

Then ``num_computed_tokens`` of every scheduled request is advanced at once, so that the next
step can be scheduled before this one's tokens are sampled.

Speculative decoding: a running request may carry draft tokens (``spec_token_ids``, set by
:meth:`Scheduler.update_draft_token_ids` after a step). They count as tokens it lacks, so they
come out of the same budget and get KV slots like any other token; the output names the drafts
each request checks (``scheduled_spec_decode_tokens``). When the runner reports how many the
target accepted, ``num_computed_tokens`` steps back over the rejected ones: their KV is garbage
that the next step overwrites. The prefix cache never holds them, because blocks are cached only
up to ``num_tokens``, which drafts never enter until they are accepted.

Invariants after every ``schedule()``: ``sum(num_scheduled_tokens) <= max_num_batched_tokens``;
``len(running) <= max_num_seqs``; every request is in exactly one of ``running``, ``waiting``,
``swapped``; a request holds GPU blocks iff it is RUNNING; once every request has finished, every
block is free again.

upstream: vllm/v1/core/sched/scheduler.py:43 @ v0.11.0
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, cdiv

# reservation.admission_lookahead is looked up at call time, so that an engine composed from a
# student's labs (course engine) runs lab 03-06's function under lab 03-01's scheduler too.
from mini_vllm.core.sched import reservation
from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from mini_vllm.core.swap import SwapSpace
from mini_vllm.outputs import DraftTokenIds, EngineCoreOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["Scheduler", "SchedulerStats", "check_stop"]


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its last appended token; set its status if so.

    In this order: the length cap (``max_model_len`` reached or ``max_tokens`` generated) gives
    ``FINISHED_LENGTH_CAPPED``; the EOS token (unless ``ignore_eos``) or one of
    ``stop_token_ids`` gives ``FINISHED_STOPPED`` (a stop token is recorded in ``stop_reason``).

    upstream: vllm/v1/core/sched/utils.py:43 @ v0.11.0
    """
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False


@dataclass
class SchedulerStats:
    """Counters for traces, benchmarks and the notebook (not part of any invariant).

    upstream: vllm/v1/metrics/stats.py:30 @ v0.11.0
    """

    num_steps: int = 0
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    # Tokens scheduled again because a recompute preemption dropped their KV.
    num_recomputed_tokens: int = 0


@dataclass
class _Step:
    """The scratch state of one ``schedule()`` call, shared by its helper methods."""

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
    """Continuous batching over one paged KV cache; see the module docstring for the algorithm.

    Queues: ``waiting`` (a deque, FCFS; preempted requests go back to its head), ``running``
    (a list in admission order; the newest is the preemption victim) and, in swap mode,
    ``swapped`` (a deque, FCFS). ``requests`` maps every unfinished request id to its request.

    upstream: vllm/v1/core/sched/scheduler.py:43 @ v0.11.0
    """

    # Lab 03-03 swaps in its own SwapSpace through this hook.
    swap_space_cls: type = SwapSpace

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
        # KV slots a running request claims past its step, for a draft model's drafts.
        self.num_lookahead_tokens = scheduler_config.num_lookahead_tokens
        self.kv_cache_manager = KVCacheManager(
            num_blocks=scheduler_config.num_gpu_blocks,
            block_size=scheduler_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=scheduler_config.enable_prefix_caching,
            log_stats=log_stats,
        )
        self.swap_space: SwapSpace | None = (
            self.swap_space_cls(scheduler_config.num_cpu_blocks)
            if self.preemption_mode == "swap"
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # Finished between the previous schedule() and the next one; sent to the runner once.
        self.finished_req_ids: set[str] = set()
        self.stats = SchedulerStats()
        self.spec_decoding_stats = SpecDecodingStats()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of ``waiting``.

        Raises ``ValueError`` (queueing nothing) for a duplicate id, a request that is not
        WAITING, a prompt that leaves no room for an output token under ``max_model_len``, a
        request that could never fit the KV cache even alone, or a request without block hashes
        while prefix caching is on.

        upstream: vllm/v1/core/sched/scheduler.py:1097 @ v0.11.0
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"add_request: request id {rid!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(
                f"add_request: request {rid!r} must be new (WAITING, nothing computed)"
            )
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"add_request: request {rid!r} has {request.num_tokens} prompt tokens; "
                f"max_model_len={self.max_model_len} leaves no room for an output token"
            )
        longest = min(request.num_tokens + request.max_tokens + self.num_lookahead_tokens,
                      self.max_model_len)
        # A reservation is claimed whole on admission, so it, not the final length, must fit.
        longest += reservation.admission_lookahead(
            self.scheduler_config.kv_reservation, request.num_prompt_tokens, request.max_tokens,
            longest, self.max_model_len)
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        if cdiv(longest, self.block_size) > usable:
            raise ValueError(
                f"add_request: request {rid!r} may reach {longest} tokens = "
                f"{cdiv(longest, self.block_size)} blocks, but the cache has only {usable}; "
                f"lower max_tokens or give the cache more blocks"
            )
        if self.scheduler_config.enable_prefix_caching and request.get_hash_new_full_blocks is None:
            raise ValueError(
                f"add_request: request {rid!r} has no block hasher but prefix caching is on; "
                f"create it with block_hasher=get_request_block_hasher({self.block_size}, ...)"
            )
        self.waiting.append(request)
        self.requests[rid] = request

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (e.g. a client abort): dequeue them and free their blocks.

        Unknown ids are ignored, as upstream. ``finished_status`` must be a ``FINISHED_*`` status.

        upstream: vllm/v1/core/sched/scheduler.py:1103 @ v0.11.0
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests: {finished_status} is not a FINISHED_* status")
        ids = (request_ids,) if isinstance(request_ids, str) else set(request_ids)
        for rid in ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        """Release a finished request's blocks (GPU and CPU) and forget it.

        upstream: vllm/v1/core/sched/scheduler.py:1147 @ v0.11.0
        """
        self.kv_cache_manager.free(request)
        if self.swap_space is not None:
            self.swap_space.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped out.

        upstream: vllm/v1/core/sched/scheduler.py:1167 @ v0.11.0
        """
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped out.

        upstream: vllm/v1/core/sched/interface.py:106 @ v0.11.0
        """
        return self.get_num_unfinished_requests() > 0

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``.

        upstream: vllm/v1/core/sched/scheduler.py:1093 @ v0.11.0
        """
        return len(self.running), len(self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Decide the next step; see the module docstring.

        upstream: vllm/v1/core/sched/scheduler.py:179 @ v0.11.0
        """
        step = _Step(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(step)
        self._check_step(step, "_schedule_running")
        if not step.preempted_reqs and self.swapped:
            self._schedule_swapped(step)
            self._check_step(step, "_schedule_swapped")
        # Swapped requests go before new ones (as in V0), so admit nothing while any is parked.
        if not step.preempted_reqs and not self.swapped:
            self._schedule_waiting(step)
            self._check_step(step, "_schedule_waiting")

        total = sum(step.num_scheduled_tokens.values())
        output = self._make_output(step, total)
        self._update_after_schedule(output)
        return output

    # Where each part of a step is written in the course, for the messages of _check_step.
    _WRITTEN_IN = {"_schedule_running": "lab 03-01", "_schedule_swapped": "lab 03-03",
                   "_schedule_waiting": "lab 03-01"}

    def _check_step(self, step: _Step, method: str) -> None:
        """Check the step's invariants right after ``method`` returned, so that a broken one
        names the method that broke it: the tokens scheduled fit ``max_num_batched_tokens``,
        ``step.token_budget`` is exactly what they leave, and at most ``max_num_seqs`` run.

        Raises ``AssertionError`` (always, not an ``assert`` that ``python -O`` drops).
        """
        total = sum(step.num_scheduled_tokens.values())
        limit = self.max_num_scheduled_tokens
        where = f"Scheduler.{method} ({self._WRITTEN_IN.get(method, 'the scheduler')})"
        tokens = ", ".join(f"{rid}: {n}" for rid, n in step.num_scheduled_tokens.items())
        if total > limit:
            raise AssertionError(
                f"{where} overspent the token budget: the step schedules {total} tokens, "
                f"max_num_batched_tokens={limit} ({tokens}); each request's tokens must come "
                "out of what step.token_budget has left"
            )
        if step.token_budget != limit - total:
            raise AssertionError(
                f"{where} left step.token_budget={step.token_budget}, but {total} of the "
                f"{limit} tokens are scheduled ({tokens}), which leaves {limit - total}: lower "
                "step.token_budget by every request's tokens, exactly once"
            )
        if len(self.running) > self.max_num_running_reqs:
            raise AssertionError(
                f"{where} left {len(self.running)} requests running, more than "
                f"max_num_seqs={self.max_num_running_reqs}: stop taking requests when that "
                "many run"
            )

    def _schedule_running(self, step: _Step) -> None:
        """Give each RUNNING request the tokens it lacks, preempting the newest when out of KV.

        upstream: vllm/v1/core/sched/scheduler.py:208 @ v0.11.0
        """
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, step.token_budget)
            if num_new_tokens == 0:
                # Nothing to do for it this step; leave it running and look at the next one.
                req_index += 1
                continue
            while True:
                # Lookahead slots: room for a draft model's K/V past the step's tokens.
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: the newest running request gives its blocks up.
                victim = self.running.pop()
                self._preempt(victim, step)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; nobody after it can run either
            step.scheduled_running_reqs.append(request)
            step.req_to_new_blocks[request.request_id] = new_blocks
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens
            req_index += 1

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens a request may get now: what it lacks (its draft tokens included), capped by
        the long-prefill threshold, the budget and the model length (the last position is
        ``max_model_len - 1``)."""
        num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, token_budget)
        return max(0, min(num_new_tokens, self.max_model_len - 1 - request.num_computed_tokens))

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt ``request`` (already removed from ``running``) in the configured mode.

        Swap mode falls back to recompute when the request has no KV yet or the CPU pool is
        full (V0 aborted the engine instead).

        upstream: vllm/core/scheduler.py:1750 @ v0.10.2
        """
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        request.spec_token_ids = []  # drafts are proposed again once it runs
        step.preempted_reqs.append(request)
        if self.swap_space is not None and request.num_computed_tokens > 0:
            num_blocks = cdiv(request.num_computed_tokens, self.block_size)
            if self.swap_space.can_swap_out(num_blocks):
                self.stats.num_swap_preemptions += 1
                self._preempt_by_swap(request, step)
                return
        self.stats.num_recompute_preemptions += 1
        self.stats.num_recomputed_tokens += request.num_computed_tokens
        self._preempt_by_recompute(request, step)

    def _preempt_by_recompute(self, request: Request, step: _Step) -> None:
        """Drop the request's KV and put it back at the head of ``waiting``.

        upstream: vllm/v1/core/sched/scheduler.py:281 @ v0.11.0
        """
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _preempt_by_swap(self, request: Request, step: _Step) -> None:
        """Copy the request's computed KV to CPU blocks, free its GPU blocks, park it.

        Only the blocks that hold computed tokens travel; ``num_computed_tokens`` is kept, so the
        request resumes exactly where it stopped.

        upstream: vllm/core/scheduler.py:1824 @ v0.10.2
        """
        if self.swap_space is None:
            raise AssertionError(
                "Scheduler._preempt_by_swap called without a swap space (preemption_mode="
                f"{self.preemption_mode!r}): _preempt may swap only in preemption_mode='swap'"
            )
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        gpu_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0][:num_blocks]
        mapping = self.swap_space.swap_out(request.request_id, gpu_block_ids)
        step.blocks_to_swap_out.extend(mapping)
        self.stats.num_blocks_swapped_out += len(mapping)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.SWAPPED
        self.swapped.append(request)

    def _schedule_swapped(self, step: _Step) -> None:
        """Swap parked requests back in, FCFS, while budget, seats and GPU blocks allow.

        A resumed request gets fresh GPU blocks for its old KV plus this step's tokens; the
        runner copies the CPU blocks into the first ones before the forward pass.

        upstream: vllm/core/scheduler.py:812 @ v0.10.2
        """
        if self.swap_space is None:
            raise AssertionError(
                "Scheduler._schedule_swapped called without a swap space (preemption_mode="
                f"{self.preemption_mode!r}): only preemption_mode='swap' parks requests in "
                "`swapped`"
            )
        while self.swapped and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = self.swapped[0]
            num_new_tokens = self._num_new_tokens(request, step.token_budget)
            if num_new_tokens == 0:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                break
            self.swapped.popleft()
            num_swapped = self.swap_space.num_swapped_blocks(request.request_id)
            gpu_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            mapping = self.swap_space.swap_in(request.request_id, gpu_block_ids[:num_swapped])
            step.blocks_to_swap_in.extend(mapping)
            self.stats.num_blocks_swapped_in += len(mapping)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.scheduled_resumed_reqs.append(request)
            step.req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                request.request_id
            )
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit WAITING requests in FCFS order, starting from their prefix-cache hits.

        With ``kv_reservation`` other than ``"paged"``, an admitted request also claims the
        blocks of its whole reservation
        (:func:`~mini_vllm.core.sched.reservation.admission_lookahead`); with ``static_batching``,
        nobody is admitted while any request runs.

        upstream: vllm/v1/core/sched/scheduler.py:335 @ v0.11.0
        """
        config = self.scheduler_config
        if config.static_batching and self.running:
            return  # the current batch runs until its longest request is done
        while self.waiting and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = self.waiting[0]
            # Every waiting request (new or preempted) has num_computed_tokens == 0 here.
            new_computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(
                request
            )
            num_new_tokens = request.num_tokens - num_computed_tokens
            threshold = self.scheduler_config.long_prefill_token_threshold
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, step.token_budget)
            new_blocks = self._allocate_on_admission(
                request, num_new_tokens, num_computed_tokens, new_computed_blocks
            )
            if new_blocks is None:
                break  # FCFS: nobody behind it may overtake it
            self.waiting.popleft()
            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                step.scheduled_new_reqs.append(request)
            else:  # PREEMPTED: the runner knows it and must replace its blocks
                step.scheduled_resumed_reqs.append(request)
            step.req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                request.request_id
            )
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens

    def _allocate_on_admission(self, request: Request, num_new_tokens: int,
                               num_computed_tokens: int,
                               new_computed_blocks: KVCacheBlocks) -> KVCacheBlocks | None:
        """Claim room for an admitted request's ``num_new_tokens`` beyond its prefix-cache hit
        (``kv_cache_manager.allocate_slots``), plus, with ``kv_reservation`` other than
        ``"paged"``, the rest of its reservation as lookahead slots
        (:func:`mini_vllm.core.sched.reservation.admission_lookahead`, lab 03-06). With paged
        memory this is ``allocate_slots`` itself. Returns the new blocks, or None (nothing claimed).

        upstream: none (inline in vLLM's admission loop, which never reserves; a method here so
        that lab 03-01's scheduler, given this helper, claims lab 03-06's reservation)
        """
        config = self.scheduler_config
        lookahead = reservation.admission_lookahead(
            config.kv_reservation, request.num_prompt_tokens, request.max_tokens,
            num_computed_tokens + num_new_tokens, self.max_model_len,
        )
        return self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_computed_tokens, new_computed_blocks,
            num_lookahead_tokens=lookahead,
        )

    def _make_output(self, step: _Step, total: int) -> SchedulerOutput:
        """Package the step's decisions (``num_computed_tokens`` not yet advanced).

        upstream: vllm/v1/core/sched/scheduler.py:660 @ v0.11.0
        """
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
            scheduled_spec_decode_tokens=self._take_spec_tokens(step),
        )

    def _take_spec_tokens(self, step: _Step) -> dict[str, list[int]]:
        """The draft tokens each scheduled request checks in this step: as many of its
        ``spec_token_ids`` as its scheduled tokens reach past ``num_tokens`` (the budget or
        ``max_model_len`` may have cut them short). Empties every scheduled request's
        ``spec_token_ids``: the proposer sends fresh ones after the step.

        upstream: vllm/v1/core/sched/scheduler.py:303 @ v0.11.0 (inline in schedule())
        """
        spec: dict[str, list[int]] = {}
        for rid, num_new_tokens in step.num_scheduled_tokens.items():
            request = self.requests[rid]
            num_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if num_spec > 0 and request.spec_token_ids:
                spec[rid] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
        return spec

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Give running requests the draft tokens the proposer guessed after a step.

        Ignored for a request that is gone, finished or not running, and for one whose KV does
        not yet cover all but its last token (mid-prefill): drafts follow the last token only.

        upstream: vllm/v1/core/sched/scheduler.py:1069 @ v0.11.0
        """
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(rid)
            if (request is None or request.status != RequestStatus.RUNNING
                    or request.num_computed_tokens < request.num_tokens - 1):
                continue
            request.spec_token_ids = list(drafts)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` now, so the next step can be scheduled at once.

        upstream: vllm/v1/core/sched/scheduler.py:629 @ v0.11.0
        """
        for rid, n in output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        # A fresh set: the output keeps the old one.
        self.finished_req_ids = set()
        self.stats.num_steps += 1

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, stop finished requests and free their blocks.

        A request still in prefill samples nothing (empty list). A request that was preempted
        after it was scheduled (possible when steps overlap) still receives its token. Returns
        one ``EngineCoreOutput`` per request that gained tokens.

        upstream: vllm/v1/core/sched/scheduler.py:861 @ v0.11.0
        """
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None:
                continue  # finished (e.g. aborted) while the step ran
            index = model_runner_output.req_id_to_index[rid]
            new_token_ids = list(model_runner_output.sampled_token_ids[index])
            if not new_token_ids:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                self._roll_back_rejected(request, len(drafts), len(new_token_ids) - 1)
            for i, token_id in enumerate(new_token_ids):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    del new_token_ids[i + 1 :]
                    stopped.append(request)
                    break
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_token_ids,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        for request in stopped:
            if request in self.running:
                self.running.remove(request)
            elif request in self.swapped:
                self.swapped.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._free_request(request)
        return outputs

    def _roll_back_rejected(self, request: Request, num_draft_tokens: int,
                            num_accepted: int) -> None:
        """After a step that checked ``num_draft_tokens`` drafts of ``request`` and accepted
        the first ``num_accepted``: un-compute the rejected ones (their slots are rewritten by
        the next step) and count the draft. A request preempted meanwhile has nothing computed
        to roll back.

        upstream: vllm/v1/core/sched/scheduler.py:899 @ v0.11.0 (inline in update_from_output)
        """
        if request.num_computed_tokens > 0:
            request.num_computed_tokens -= num_draft_tokens - num_accepted
        self.spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)
