"""Asynchronous scheduling: plan step N+1 while step N runs.

The engine core (:meth:`~mini_vllm.engine.core.EngineCore.step_with_batch_queue`) schedules step
N+1 and hands it to the model thread *before* it waits for step N's tokens. At that moment a
decoding request's next input token is still being sampled, so the scheduler cannot know it; it
only needs to know that it *will* exist. :class:`AsyncScheduler` counts such tokens per request
in ``Request.num_output_placeholders``:

* after scheduling (:meth:`AsyncScheduler._update_after_schedule`), every request whose step
  reaches the end of its sequence will sample one token: one placeholder more;
* when scheduling (:meth:`AsyncScheduler._num_new_tokens`), placeholders count as tokens that
  exist, so a request in flight is scheduled for the token its running step samples. The model
  thread runs steps in order, and the runner appends each sampled token to its own copy of the
  request, so step N+1 finds its input there;
* when a step's tokens arrive (:meth:`AsyncScheduler.update_from_output`), each replaces one
  placeholder, and the blocks whose KV that step wrote go into the prefix cache (the synchronous
  scheduler caches them when it allocates the next slots; here the token that completes a
  block was still a placeholder then, and a request that stops is never allocated again).

Invariants: ``num_output_placeholders`` is the number of tokens the steps in flight will
sample for the request (one a step at most, and at most two steps are in flight); between steps
a decoding request has ``num_computed_tokens == num_tokens + num_output_placeholders - 1``
(every token but the newest, known or not, has its KV or is getting it). A preemption takes no
placeholder back: the step in flight still samples, and its token still arrives.

A request that stops in step N was already scheduled in step N+1; that step's token for it is
dropped (the request is gone when it arrives). Same tokens as the synchronous loop, at the cost
of one wasted row per finished request; a request whose step in flight samples its
``max_tokens``-th token is not scheduled again, since that one is known to be its last.

upstream: vllm/v1/core/sched/async_scheduler.py:14 @ v0.11.0
"""

from __future__ import annotations

from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.outputs import EngineCoreOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """The scheduler with output placeholders, so that a step can be planned before the
    previous one's tokens are known (see the module docstring).

    upstream: vllm/v1/core/sched/async_scheduler.py:14 @ v0.11.0
    """

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` (as the synchronous scheduler does), then give each
        scheduled request whose step reaches the end of its sequence one placeholder: the
        token that step will sample.

        upstream: vllm/v1/core/sched/async_scheduler.py:16 @ v0.11.0
        """
        super()._update_after_schedule(output)
        for rid in output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens a request may get now, counting its placeholders as tokens that exist; none
        for a request whose step in flight samples its last token (``max_tokens``).

        upstream: vllm/v1/core/sched/scheduler.py:213 @ v0.11.0
        """
        if (request.num_output_placeholders > 0
                and request.num_output_tokens + request.num_output_placeholders
                >= request.max_tokens):
            return 0
        num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                          - request.num_computed_tokens)
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, token_budget)
        return max(0, min(num_new_tokens, self.max_model_len - 1 - request.num_computed_tokens))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """A step's tokens arrive: each replaces one of its request's placeholders, and the
        running request's blocks whose KV is now written go into the prefix cache (before a
        request that stops is freed, as the synchronous scheduler has cached them by then);
        then the synchronous scheduler appends them, stops and frees.

        upstream: vllm/v1/core/sched/async_scheduler.py:29 @ v0.11.0
        """
        index = model_runner_output.req_id_to_index
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None:
                continue  # finished meanwhile: its placeholders went with it
            num_sampled = len(model_runner_output.sampled_token_ids[index[rid]])
            if num_sampled > request.num_output_placeholders:
                raise AssertionError(
                    f"request {rid!r} got {num_sampled} token(s) and had "
                    f"{request.num_output_placeholders} placeholder(s) for them")
            request.num_output_placeholders -= num_sampled
            if num_sampled and request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_output_placeholders)
        return super().update_from_output(scheduler_output, model_runner_output)
