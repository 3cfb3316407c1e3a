"""Lab 03-01 starter: the scheduler and continuous batching.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors. How
to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 03-01
N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

Everything else is complete: the constructor, ``schedule()`` (which calls your helpers in the
right order), ``_preempt`` (which counts a preemption and picks its mode), packaging the output,
advancing ``num_computed_tokens`` and freeing a request. The KV cache manager, the requests and
the output dataclasses come from ``mini_vllm`` (earlier labs and this phase's plumbing).

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-01-scheduler -q
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mini_vllm.config import SchedulerConfig
from mini_vllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, cdiv
from mini_vllm.core.sched import reservation
from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from mini_vllm.outputs import DraftTokenIds, EngineCoreOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["Scheduler", "SchedulerStats", "check_stop"]


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its last appended token; set its status if so.

    Input: a request with at least one output token (the one just appended). Three conditions,
    checked in this order, the first that holds decides:

    1. the length cap: ``request.num_tokens >= max_model_len`` or ``request.num_output_tokens >=
       request.max_tokens``: status ``FINISHED_LENGTH_CAPPED`` (finish reason "length");
    2. the last output token is ``request.eos_token_id`` and ``sampling_params.ignore_eos`` is
       off: ``FINISHED_STOPPED`` (reason "stop");
    3. the last output token is in ``sampling_params.stop_token_ids`` (``ignore_eos`` does not
       matter here): ``FINISHED_STOPPED``, and that token is recorded in ``request.stop_reason``.

    The order matters when the last allowed token is also EOS or a stop token: the length cap
    wins, so the request finishes LENGTH_CAPPED and ``stop_reason`` stays ``None`` (as upstream).
    Output: True when the request stopped; False otherwise, and then nothing has changed.
    """
    raise NotImplementedError(
        "lab 03-01, task 5: implement check_stop (hint: python -m course hint 03-01 5)"
    )


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
    once lab 03-03 is done (``python -m course engine`` puts the two together). Lab 04-04 adds
    speculative decoding the same way: its ``update_draft_token_ids``, ``_take_spec_tokens`` and
    ``_roll_back_rejected`` give a request draft tokens, schedule them and undo the rejected
    ones; here, drafts only count in the budget (task 2) and ``update_from_output`` calls the
    rollback (task 5). Until lab 04-04 no request has drafts.
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
        self.spec_decoding_stats = SpecDecodingStats()  # lab 04-04 counts its drafts here

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of ``waiting`` and remember it in ``requests``.

        Refused with ``ValueError``, and then nothing is queued or remembered:

        * an id already in ``requests``;
        * a request that is not new: its status is not ``WAITING``, or it already has computed
          tokens (``num_computed_tokens != 0``);
        * a prompt with ``num_tokens >= max_model_len``: no room is left for an output token
          (``max_model_len - 1`` prompt tokens is accepted);
        * a request that could never fit the cache even alone: its longest possible length,
          ``min(num_tokens + max_tokens, max_model_len)`` tokens, needs more blocks of
          ``block_size`` than the cache's ``num_gpu_blocks - 1`` usable ones (block 0 is the
          null block). Needing exactly that many is accepted;
        * a request without a block hasher (``request.get_hash_new_full_blocks is None``) while
          prefix caching is on (with caching off it is accepted).

        Every message names the request id; the two size checks also give their numbers (the
        prompt's tokens and ``max_model_len``; the blocks needed and the usable blocks), so the
        user knows what to change. Cost: O(1).
        """
        raise NotImplementedError(
            "lab 03-01, task 1: implement Scheduler.add_request "
            "(hint: python -m course hint 03-01 1)"
        )

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (a client abort).

        ``request_ids`` is one id (a ``str``, never read as a sequence of characters) or an
        iterable of ids; an id may be listed twice, and unknown ids (never added, or finished
        already) are ignored. Each known request leaves whichever queue holds it (``running``,
        ``waiting``, or ``swapped`` in swap mode), gets the status ``finished_status`` and is
        freed with ``_free_request`` (its blocks go back, it is reported in the next step's
        ``finished_req_ids``, it leaves ``requests``). The other requests keep their order.

        A ``finished_status`` that is not a ``FINISHED_*`` status is a ``ValueError`` naming
        that status, raised before anything changes.
        """
        raise NotImplementedError(
            "lab 03-01, task 6: implement Scheduler.finish_requests "
            "(hint: python -m course hint 03-01 6)"
        )

    def _free_request(self, request: Request) -> None:
        """Release a finished request's blocks (GPU, and CPU in swap mode), report it to the
        runner and forget it."""
        self.kv_cache_manager.free(request)
        if self.swap_space is not None:
            self.swap_space.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        """How many requests are waiting, running or swapped out (all three queues)."""
        raise NotImplementedError(
            "lab 03-01, task 1: implement get_num_unfinished_requests "
            "(hint: python -m course hint 03-01 1)"
        )

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        raise NotImplementedError(
            "lab 03-01, task 1: implement has_unfinished_requests "
            "(hint: python -m course hint 03-01 1)"
        )

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
        """How many tokens a running request may get in this step.

        The tokens it lacks (``num_tokens_with_spec - num_computed_tokens``: the draft tokens
        ``request.spec_token_ids``, which lab 04-04 gives it, count as tokens it lacks), but no
        more than ``long_prefill_token_threshold`` (when that is > 0; 0 means no cap), no more
        than ``token_budget``, and no more than ``max_model_len - 1 - num_computed_tokens`` (the
        last position a model of ``max_model_len`` has). Never negative: 0 means nothing to do
        now. Pure: changes nothing.
        """
        raise NotImplementedError(
            "lab 03-01, task 2: implement Scheduler._num_new_tokens "
            "(hint: python -m course hint 03-01 2)"
        )

    def _schedule_running(self, step: _Step) -> None:
        """Schedule the running requests, oldest first, within ``step.token_budget``.

        Each running request, in ``running`` order and while budget is left, is scheduled for
        ``n = self._num_new_tokens(request, step.token_budget)`` tokens, with room for them
        claimed from ``kv_cache_manager.allocate_slots(request, n)`` (it returns the *new*
        blocks, or None when the cache cannot hold them). A request with ``n == 0`` (nothing to
        do in this step) is passed over: it stays running, unscheduled, and the requests behind
        it are still considered.

        When the cache cannot hold a request's tokens, the *newest* running request (the last
        one of ``running``) is taken out of ``running`` and handed to ``self._preempt``, and the
        claim is tried again, as often as needed. If the request itself is the newest one left,
        it preempts itself, and no request behind it is scheduled in this step.

        Afterwards, for each scheduled request, in ``running`` order: it is in
        ``step.scheduled_running_reqs``; ``step.req_to_new_blocks[id]`` holds the blocks its
        claim returned and ``step.num_scheduled_tokens[id]`` its ``n >= 1``; ``step.token_budget``
        is lower by the sum of those ``n``. Requests are not advanced here (``schedule()`` does
        that after packaging the output). Cost: one claim per scheduled request plus one per
        preemption.
        """
        raise NotImplementedError(
            "lab 03-01, task 2: implement Scheduler._schedule_running "
            "(hint: python -m course hint 03-01 2)"
        )

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt ``request`` (already removed from ``running``): count it, record it in
        ``step``, then swap it out (lab 03-03, when a swap space has room for its computed
        blocks) or drop its KV with your ``_preempt_by_recompute``. (Complete.)"""
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        request.spec_token_ids = []  # drafts are proposed again once it runs (lab 04-04)
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
        """Preempt ``request`` by dropping its KV (vLLM v1's only mode).

        Input: a request already taken out of ``running``, already counted and recorded in
        ``step`` by ``_preempt``. Afterwards: its blocks are back in the KV cache manager (full
        blocks stay in the prefix cache, so its re-admission may hit them); its status is
        ``PREEMPTED``; its ``num_computed_tokens`` is 0 (its output tokens are kept: they will be
        recomputed with the prompt); it is at the *head* of ``waiting``, ahead of every request
        that waited before, so that it is the first to be admitted again.
        """
        raise NotImplementedError(
            "lab 03-01, task 3: implement Scheduler._preempt_by_recompute "
            "(hint: python -m course hint 03-01 3)"
        )

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests, first come first served, within ``step.token_budget``.

        Requests are admitted from the head of ``waiting`` while budget is left and fewer than
        ``max_num_running_reqs`` requests run. Admission is FCFS: the first request that the
        cache cannot hold ends it, and nobody behind it is admitted in this step.

        A request starts from its prefix-cache hit: ``kv_cache_manager.get_computed_blocks``
        gives the cached blocks and their ``num_hit`` tokens (0 with caching off). It is
        scheduled for the tokens it lacks beyond the hit, ``num_tokens - num_hit``, capped by
        ``long_prefill_token_threshold`` (when > 0) and by the budget left; room for them is
        claimed with the given ``self._allocate_on_admission(request, n, num_hit, hit_blocks)``
        (None: it does not fit), which is ``kv_cache_manager.allocate_slots`` plus the
        reservation of lab 03-06 when the engine reserves (``kv_reservation``).

        Afterwards, for each admitted request, in admission order: it has left ``waiting`` and is
        at the back of ``running``; its status is ``RUNNING`` and ``num_computed_tokens`` is
        ``num_hit``; ``num_cached_tokens`` is ``num_hit`` if it was still unset (negative), and
        is never changed afterwards (a resumed request keeps its first value). It is in
        ``step.scheduled_new_reqs`` if it was ``WAITING``, in ``step.scheduled_resumed_reqs``
        if it was ``PREEMPTED`` (the runner must replace its old block table);
        ``step.req_to_new_blocks[id]`` is its *whole* block table
        (``kv_cache_manager.get_blocks(id)``), ``step.num_scheduled_tokens[id]`` its ``n``, and
        ``step.token_budget`` is lower by ``n``.
        """
        raise NotImplementedError(
            "lab 03-01, task 4: implement Scheduler._schedule_waiting "
            "(hint: python -m course hint 03-01 4)"
        )

    def _allocate_on_admission(self, request: Request, num_new_tokens: int,
                               num_computed_tokens: int,
                               new_computed_blocks: KVCacheBlocks) -> KVCacheBlocks | None:
        """``kv_cache_manager.allocate_slots(request, num_new_tokens, num_computed_tokens,
        new_computed_blocks)``, plus the rest of the request's reservation as lookahead slots
        when ``kv_reservation`` is not ``"paged"`` (lab 03-06). (Complete.)"""
        config = self.scheduler_config
        lookahead = reservation.admission_lookahead(
            config.kv_reservation, request.num_prompt_tokens, request.max_tokens,
            num_computed_tokens + num_new_tokens, self.max_model_len,
        )
        return self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_computed_tokens, new_computed_blocks,
            num_lookahead_tokens=lookahead,
        )

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Where a proposer's drafts arrive (speculative decoding): lab 04-04 writes it, in the
        scheduler that extends this one; this one takes no drafts. (Complete.)"""
        raise RuntimeError(
            "Scheduler.update_draft_token_ids: this is lab 03-01's scheduler, which takes no "
            "drafts; speculative decoding needs lab 04-04's Scheduler"
        )

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
            # Lab 04-04's _take_spec_tokens names the drafts each request checks; without it,
            # none are scheduled.
            scheduled_spec_decode_tokens=(self._take_spec_tokens(step)
                                          if hasattr(self, "_take_spec_tokens") else {}),
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
        """Append the tokens the runner sampled, apply the stop conditions, free who stopped.

        Input: the output of an earlier ``schedule()`` and the runner's answer to it; request
        ``id``'s sampled tokens are ``model_runner_output.sampled_token_ids[
        model_runner_output.req_id_to_index[id]]``, an empty list when it is still in the middle
        of its prompt. Requests of ``scheduler_output.num_scheduled_tokens`` that are no longer
        in ``requests`` (aborted while the step ran) are skipped. A request that was preempted
        after it was scheduled still receives its tokens.

        The tokens are appended one at a time, with ``check_stop(request, max_model_len)`` after
        each; the tokens after the one that stops it are dropped (never appended). Before them,
        a request that had ``d`` draft tokens checked in the step
        (``scheduler_output.scheduled_spec_decode_tokens[id]``, lab 04-04) and gained ``n``
        tokens has its rejected drafts undone with ``self._roll_back_rejected(request, d, n -
        1)`` (the target accepted ``n - 1`` drafts and chose the last token itself).

        Output: one ``EngineCoreOutput`` per request that gained at least one token, in the
        order of ``scheduler_output.num_scheduled_tokens``: its id, the tokens appended in this
        call, its finish reason (``request.get_finished_reason()``, None while it runs), its
        ``stop_reason`` and ``max(num_cached_tokens, 0)``.

        Afterwards every request that stopped has left its queue (whichever holds it: a request
        preempted after it was scheduled is in ``waiting``) and has been freed with
        ``_free_request``.
        """
        raise NotImplementedError(
            "lab 03-01, task 5: implement Scheduler.update_from_output "
            "(hint: python -m course hint 03-01 5)"
        )


