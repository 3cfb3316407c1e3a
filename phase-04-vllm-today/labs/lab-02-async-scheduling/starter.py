"""Lab 04-02 starter: asynchronous scheduling.

The engine of phase 03 runs one step at a time: schedule, run the model, read its tokens, and
only then schedule again. Everything the CPU does between two steps (updating the requests,
sending their tokens, planning the next batch) is time the model waits. vLLM plans step N+1
while step N runs. You write the four places that make that possible:

* tasks 1 to 3, ``AsyncScheduler``: lab 03-01's scheduler with *output placeholders*, the count
  of tokens a request will get from steps still running (task 1 adds them, task 2 schedules past
  them, task 3 replaces them with the tokens that arrive);
* task 4, ``EngineCore.step_with_batch_queue``: one turn of the busy loop that starts the next
  step before it waits for the one running.

Given (read them in ``mini_vllm``): ``Request.num_output_placeholders`` (``request.py``);
``EngineCoreBase`` in ``engine/core.py``: ``execute_model_async`` (a step on the model thread,
one thread for every step, so they run in the order started), ``batch_queue``,
``drain_batch_queue`` and ``step_fn`` (what lab 04-01's busy loop calls); the model runner,
which appends each token it samples to its own copy of the request, so step N+1 finds the token
of step N there without the scheduler knowing it. The class right after the base in each file is
the reference answer: do not read it before you have tried.

Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-02 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), ``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-04-vllm-today/labs/lab-02-async-scheduling -q
"""

from __future__ import annotations

from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine.core import BATCH_QUEUE_SIZE
from mini_vllm.engine.core import EngineCore as _EngineCore
from mini_vllm.outputs import EngineCoreOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus  # noqa: F401  (task 3)

__all__ = ["BATCH_QUEUE_SIZE", "AsyncScheduler", "EngineCore"]

# ---------------------------------------------------------------------------- tasks 1 to 3


class AsyncScheduler(Scheduler):
    """Lab 03-01's scheduler, able to plan a step before the previous step's tokens are known.

    ``request.num_output_placeholders`` counts the tokens that steps in flight will sample for
    the request: ``num_tokens`` does not count them yet, ``num_computed_tokens`` already counts
    the positions those steps compute. Between steps, a request that decodes has
    ``num_computed_tokens == num_tokens + num_output_placeholders - 1``.
    """

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Task 1: after a step is planned, note the tokens it will sample.

        First what the synchronous scheduler does here (``super()``: every scheduled request's
        ``num_computed_tokens`` advances by its scheduled tokens, ``finished_req_ids`` starts
        afresh). Then each request of ``output.num_scheduled_tokens`` whose step now reaches
        the end of its sequence, known tokens and placeholders together
        (``num_computed_tokens == num_tokens + num_output_placeholders``), samples a token in
        this step: one placeholder more. A chunk that stops short of the end samples nothing.
        """
        raise NotImplementedError(
            "lab 04-02, task 1: implement AsyncScheduler._update_after_schedule "
            "(hint: python -m course hint 04-02 1)"
        )

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        """Task 2: the tokens ``request`` may be scheduled now (lab 03-01's helper, in which
        placeholders count as tokens that exist).

        A request lacks ``num_tokens_with_spec + num_output_placeholders -
        num_computed_tokens`` tokens: a request whose step is in flight lacks one, the token
        that step samples (the model thread runs the steps in order, so it will be there).
        Then the caps of lab 03-01, in its order: ``long_prefill_token_threshold`` (when > 0),
        ``token_budget``, and ``max_model_len - 1 - num_computed_tokens``; never below 0.

        Exception: a request with placeholders whose output tokens and placeholders together
        reach ``request.max_tokens`` gets 0: the step in flight samples its last token, and a
        step for the token after it would be wasted.
        """
        raise NotImplementedError(
            "lab 04-02, task 2: implement AsyncScheduler._num_new_tokens "
            "(hint: python -m course hint 04-02 2)"
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Task 3: a step's tokens arrive; return what the synchronous scheduler returns.

        First, for each request of ``scheduler_output.num_scheduled_tokens`` that the scheduler
        still holds (``self.requests``; one finished meanwhile is gone, with its placeholders),
        with ``n`` tokens in this step
        (``model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[id]]``):

        * the ``n`` tokens replace ``n`` placeholders. A step never samples more tokens than
          the request has placeholders: if it did, raise ``AssertionError`` naming the request;
        * if ``n > 0`` and the request is ``RequestStatus.RUNNING`` (a preempted one holds no
          blocks), its full blocks whose KV is written go into the prefix cache:
          ``self.kv_cache_manager.cache_blocks(request, num_computed_tokens -
          num_output_placeholders)``. The synchronous scheduler has cached them by now (when it
          allocated this step's slots); here the token that completes a block was still a
          placeholder then.

        Then ``return super().update_from_output(...)``: it appends the tokens, stops and frees
        the requests that finish (after the caching above, so their blocks stay cached), and
        drops the tokens of requests gone meanwhile.
        """
        raise NotImplementedError(
            "lab 04-02, task 3: implement AsyncScheduler.update_from_output "
            "(hint: python -m course hint 04-02 3)"
        )


# ---------------------------------------------------------------------------- task 4


class EngineCore(_EngineCore):
    """The engine core of lab 03-04, with the busy loop's asynchronous step.

    Given by the base (``mini_vllm/engine/core.py``): ``self.scheduler`` (an
    ``AsyncScheduler``), ``self.batch_queue`` (a ``collections.deque`` of
    ``(future, scheduler_output)``, newest on the left), ``self.execute_model_async(output)``
    (starts the step on the model thread, returns a ``concurrent.futures.Future`` of its
    ``ModelRunnerOutput``), ``self._record_blocks_in_step()`` and ``self._record_stats()``
    (the statistics ``step()`` keeps; call them where ``step()`` does).
    """

    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        """Task 4: one turn of the busy loop under async scheduling.

        1. If the scheduler has unfinished requests: plan a step (``schedule()``), call
           ``self._record_blocks_in_step()``, start it (``execute_model_async``) and put
           ``(future, output)`` at the left of ``self.batch_queue``, whatever it scheduled (a
           step of no tokens still tells the runner which requests finished). Then, if the step
           scheduled tokens and fewer than ``BATCH_QUEUE_SIZE`` steps are in flight, return
           ``None``: nothing to wait for yet.
        2. No step in flight: return ``[]``.
        3. Otherwise take the oldest step from the right of the queue, wait for its
           ``ModelRunnerOutput`` (``future.result()``: an exception of the step propagates),
           hand it to ``self.scheduler.update_from_output``, call ``self._record_stats()`` and
           return the outputs.
        """
        raise NotImplementedError(
            "lab 04-02, task 4: implement EngineCore.step_with_batch_queue "
            "(hint: python -m course hint 04-02 4)"
        )
