"""``AsyncLLM``: the engine behind a server. Requests arrive at any time; tokens stream out.

``LLM.generate`` takes every prompt up front and returns when all are done. A server cannot: a
request arrives while others are half way through, each client wants its tokens as they are
made, and a client may hang up. The shape is upstream's, with a thread where upstream has a
process:

* the **engine core thread** (upstream's ``EngineCoreProc`` busy loop) owns the engine core:
  between steps it applies the adds and aborts waiting in its input queue, then runs
  ``EngineCore.step()`` and posts the step's outputs (with a timestamp and a snapshot of the
  engine's load) to the event loop. It never waits for the event loop, so steps run back to
  back however busy the HTTP side is; PyTorch releases the GIL while it computes;
* ``generate()`` (one coroutine per HTTP request, on the event loop) validates the prompt,
  registers the request with the :class:`~mini_vllm.engine.output_processor.OutputProcessor`,
  queues it for the core thread, and yields the request's deltas from its collector until it
  finishes;
* the **output handler** (a task on the event loop) takes each step's outputs, detokenizes them
  into the collectors, sends back aborts for requests a stop string finished (the core cannot
  see text), and records the metrics;
* a client that disconnects cancels its ``generate()``, which aborts the request: the core thread
  finishes it in the scheduler before its next step, and its KV blocks go back to the pool.

Threading invariant: only the core thread touches the engine core (scheduler, KV cache manager,
runner); other threads talk to it through its input queue, and it talks back through the event
loop's queue. Tokens a step made for a request that was aborted meanwhile are dropped.

upstream: vllm/v1/engine/async_llm.py:52 @ v0.11.0
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from mini_vllm.engine.core import EngineCoreBase
from mini_vllm.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
    _Tracked,
)
from mini_vllm.engine.parallel_sampling import child_sampling_params
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.metrics.loggers import EngineLoad, PrometheusStatLogger
from mini_vllm.metrics.stats import IterationStats
from mini_vllm.outputs import EngineCoreOutput, RequestOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "AsyncLLMBase", "EngineDeadError", "EngineGenerateError"]


class EngineGenerateError(RuntimeError):
    """A step failed while the request was in flight; the engine recovered and serves on.

    upstream: vllm/v1/engine/exceptions.py:3 @ v0.11.0
    """


class EngineDeadError(RuntimeError):
    """The engine was shut down: it takes no more requests.

    upstream: vllm/v1/engine/exceptions.py:8 @ v0.11.0
    """


@dataclass
class _StepResult:
    """What the core thread posts after a step: the outputs, when they were made, the load."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    load: EngineLoad
    failed: list[str] | None = None  # the step raised: these requests failed with `error`
    error: BaseException | None = None


_SHUTDOWN = object()  # the core thread's signal to stop


class AsyncLLMBase:
    """Serve many requests at once from one engine, streaming each one's output as it is made.

    Everything but the per-request stream, ``generate``, which is :class:`AsyncLLM`'s (lab 03-05
    gives this part: requests in, the core thread, the output handler, abort, shutdown).

    Build it from an :class:`~mini_vllm.entrypoints.llm.LLM` (which loads the model and checks the
    engine knobs): ``AsyncLLM(LLM(...))`` or ``AsyncLLM.from_engine_args(model=..., **knobs)``. Once
    ``generate`` has started the core thread, the ``LLM``'s own ``generate`` must not be called
    (they share one engine core) until ``shutdown``.
    ``model_name`` is what ``/v1/models`` lists and ``/metrics`` labels.

    Invariants: every user request that ``generate`` accepted ends in exactly one of: finished
    (its last delta has ``finished=True``), aborted (its consumer went away; its engine requests
    are finished in the scheduler and their blocks freed before the next step), or failed (the
    consumer gets the exception; the engine is made clean again). ``stat_logger`` holds the
    engine's state as of the last step.

    upstream: vllm/v1/engine/async_llm.py:52 @ v0.11.0
    """

    def __init__(self, llm: LLM, *, model_name: str = "mini_vllm") -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"AsyncLLM: pass a mini_vllm.LLM, got {type(llm).__name__}")
        self.llm = llm
        self.model_name = model_name
        self.output_processor = OutputProcessor(llm.tokenizer)
        self.stat_logger = PrometheusStatLogger(model_name)
        self.output_handler: asyncio.Task | None = None
        self._input: queue.SimpleQueue = queue.SimpleQueue()  # to the core thread
        self._outputs: asyncio.Queue[_StepResult] | None = None  # from it, on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core_thread: threading.Thread | None = None
        self._in_core: dict[str, Request] = {}  # core thread only: requests it has added
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._seen_prefix: tuple[Any, int, int] = (None, 0, 0)  # core thread only
        self._load = EngineLoad()  # core thread only

    @classmethod
    def from_engine_args(cls, model: Any = None, *, model_name: str = "mini_vllm",
                         **llm_kwargs: Any) -> AsyncLLMBase:
        """Load the model and build the engine as ``LLM(model, **llm_kwargs)`` does.

        upstream: vllm/v1/engine/async_llm.py:221 @ v0.11.0
        """
        return cls(LLM(model, **llm_kwargs), model_name=model_name)

    # ------------------------------------------------------------------ properties

    @property
    def engine_core(self) -> EngineCoreBase:
        """The engine core (it is rebuilt after a failed step, so always read it here)."""
        return self.llm.engine

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm._scheduler_config.max_model_len

    @property
    def errored(self) -> bool:
        return self._dead is not None

    # ------------------------------------------------------------------ requests in

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    arrival_time: float | None = None) -> RequestOutputCollector:
        """Check the request, register it, and queue it for the engine loop; return its collector.

        ``prompt``: a string, a list of token ids, or ``{"prompt_token_ids": [...]}`` (with an
        optional ``"prompt"``). Bad input raises ``TypeError``/``ValueError`` with the same
        messages as ``LLM.generate`` and queues nothing. ``params.n > 1`` becomes ``n`` engine
        requests (a seeded parent gives child ``j`` the seed ``seed + j``, as ``LLM`` does).

        upstream: vllm/v1/engine/async_llm.py:261 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError("AsyncLLM: the engine was shut down; start a new one")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"AsyncLLM: params must be a SamplingParams, got "
                            f"{type(params).__name__}")
        if request_id in self.output_processor.parent_requests:
            raise ValueError(f"AsyncLLM: request id {request_id!r} is already in flight")
        text, ids = self.llm._parse_one(prompt, "the prompt")
        requests = self._make_children(request_id, ids, params)
        self.llm._check_fits(requests)
        collector = RequestOutputCollector(self._output_loop_running)
        parent = ParentRequest(request_id, params.n)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for index, request in enumerate(requests):
            self.output_processor.add_request(request, text, parent, index, collector, arrival)
        self._input.put(("add", requests))
        return collector

    def _make_children(self, request_id: str, ids: list[int],
                       params: SamplingParams) -> list[Request]:
        """The engine requests of one user request: ``params.n`` samples of the prompt."""
        vocab = self.llm.model.config.vocab_size
        outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"generate: stop token id {outside[0]} is outside the model's "
                             f"vocab [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("generate: stop strings need a tokenizer to detokenize with")
        extra_eos = [t for t in self.llm.extra_eos_token_ids if t not in params.stop_token_ids]
        requests = []
        for j in range(params.n):
            child = child_sampling_params(params, j, extra_eos)
            rid = ParentRequest.child_id(request_id, j, params.n)
            requests.append(self.engine_core.make_request(rid, ids, child))
        return requests

    def abort(self, request_id: str) -> None:
        """Stop a user request: no more outputs; its engine requests are finished in the
        scheduler (blocks freed) before the next step. Unknown or finished ids are ignored.

        upstream: vllm/v1/engine/async_llm.py:485 @ v0.11.0
        """
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            self._input.put(("abort", child_ids, RequestStatus.FINISHED_ABORTED))

    # ------------------------------------------------------------------ the engine loop

    def _output_loop_running(self) -> bool:
        """Whether outputs can still reach the collectors (the output handler task lives)."""
        return self.output_handler is not None and not self.output_handler.done()

    def _run_output_handler(self) -> None:
        """Start the core thread (once) and the output handler on the running event loop.

        upstream: vllm/v1/engine/async_llm.py:422 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError("AsyncLLM: the engine was shut down; start a new one")
        if self.output_handler is not None and not self.output_handler.done():
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self.output_handler = self._loop.create_task(self._output_handler_loop(),
                                                     name="mini_vllm-output-handler")
        if self._core_thread is None:
            self._core_thread = threading.Thread(target=self._core_busy_loop, daemon=True,
                                                 name="mini_vllm-engine-core")
            self._core_thread.start()

    async def _output_handler_loop(self) -> None:
        """Turn each step's outputs into deltas for the collectors (on the event loop)."""
        if self._outputs is None:
            raise RuntimeError("AsyncLLM: the output handler runs only after "
                               "_run_output_handler() made its queue; call that first")
        while True:
            result = await self._outputs.get()
            if result.error is not None:
                self.output_processor.propagate_error(result.error, result.failed)
                self.stat_logger.record(result.load, None)
                continue
            stats = IterationStats()
            processed = self.output_processor.process_outputs(result.outputs, result.timestamp,
                                                              stats)
            if processed.reqs_to_abort:  # stop strings: the core cannot see text
                self._input.put(("abort", processed.reqs_to_abort,
                                 RequestStatus.FINISHED_STOPPED))
            self.stat_logger.record(result.load, stats if result.outputs else None)

    # ------------------------------------------------------------------ the core thread

    def _core_busy_loop(self) -> None:
        """Apply adds and aborts, step, post the outputs; sleep only while there is no work.

        upstream: vllm/v1/engine/core.py:720 @ v0.11.0
        """
        torch.set_num_threads(self.llm.num_threads)  # a per-thread setting for CPU ops
        stalled_at: tuple | None = None
        while True:
            if not self._apply_input(block=not self.engine_core.has_unfinished_requests()):
                return  # shut down
            core = self.engine_core
            if not core.has_unfinished_requests():
                self._post(_StepResult([], time.monotonic(), self._snapshot()))
                continue
            try:
                outputs = core.step()
                core.post_step()
                if not outputs:
                    # Nothing gained a token: fine during chunked prefill, a livelock when the
                    # step left everything as it was (every later step would do the same).
                    state = self._progress_state()
                    if state == stalled_at:
                        raise RuntimeError(self.llm._stall_message())
                    stalled_at = state
                else:
                    stalled_at = None
            except Exception as exc:  # the step failed: fail its requests, serve on
                failed = self._recover()
                error = EngineGenerateError(
                    f"the engine step failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._post(_StepResult([], time.monotonic(), self._snapshot(), failed, error))
                continue
            now = time.monotonic()
            for out in outputs:
                if out.finished:
                    self._in_core.pop(out.request_id, None)
            self._post(_StepResult(outputs, now, self._snapshot()))

    def _apply_input(self, block: bool) -> bool:
        """Apply every add and abort waiting (waiting for one first if ``block``); False once
        shutdown was asked for."""
        try:
            item = self._input.get(block=block)
        except queue.Empty:
            return True
        core = self.engine_core
        while True:
            if item is _SHUTDOWN:
                return False
            if item[0] == "add":
                for request in item[1]:
                    try:
                        core.add_request(request)
                    except ValueError as exc:  # checked before queueing; a refusal fails it
                        self._post(_StepResult([], time.monotonic(), self._snapshot(),
                                               [request.request_id], exc))
                        continue
                    self._in_core[request.request_id] = request
            else:  # ("abort", ids, status)
                core.scheduler.finish_requests(item[1], item[2])
                for rid in item[1]:
                    self._in_core.pop(rid, None)
            try:
                item = self._input.get_nowait()
            except queue.Empty:
                return True

    def _post(self, result: _StepResult) -> None:
        """Hand a step's result to the event loop (dropped when the loop is gone)."""
        loop, outputs = self._loop, self._outputs
        if loop is None or outputs is None:
            return
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, result)
        except RuntimeError:  # the event loop was closed
            pass

    def _progress_state(self) -> tuple:
        sched = self.engine_core.scheduler
        return (
            tuple((r.request_id, r.status, r.num_computed_tokens, r.num_output_tokens)
                  for r in self._in_core.values()),
            sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        )

    def _recover(self) -> list[str]:
        """A step raised: abort every request in the core and make the engine clean (as ``LLM``
        does after a failed ``generate``: requests aborted, prefix cache dropped, or a fresh
        core when that is not enough). Returns the ids of the requests that failed."""
        failed = list(self._in_core)
        tracked = [_Tracked(0, 0, r) for r in self._in_core.values()]
        self._in_core.clear()
        self.llm._abort_after_failure(tracked)
        return failed

    def _snapshot(self) -> EngineLoad:
        """The engine's load now (core thread), for the stat logger."""
        core = self.engine_core
        sched = core.scheduler
        pool = sched.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1
        in_use = core.num_blocks_in_use
        # The core's prefix-cache counters restart when a failure rebuilds it: fold in deltas.
        seen_core, seen_q, seen_h = self._seen_prefix
        if seen_core is not core:
            seen_q = seen_h = 0
        load = self._load
        load.prefix_cache_queries += core.prefix_cache_queries - seen_q
        load.prefix_cache_hits += core.prefix_cache_hits - seen_h
        self._seen_prefix = (core, core.prefix_cache_queries, core.prefix_cache_hits)
        load.num_running_reqs = len(sched.running)
        load.num_waiting_reqs = len(sched.waiting) + len(getattr(sched, "swapped", ()))
        load.num_kv_blocks_in_use = in_use
        load.num_kv_blocks_total = usable
        load.kv_cache_usage = in_use / usable if usable else 0.0
        load.num_preemptions = sched.stats.num_preemptions
        if core.use_spec_decode:
            load.spec_decoding = sched.spec_decoding_stats.copy()
        return dataclasses.replace(load)

    # ------------------------------------------------------------------ life cycle

    async def check_health(self) -> None:
        """Raise when the engine cannot serve (shut down, or its core thread or output handler
        died).

        upstream: vllm/v1/engine/async_llm.py:608 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError("AsyncLLM: the engine was shut down")
        if self._core_thread is not None and not self._core_thread.is_alive():
            raise EngineDeadError("AsyncLLM: the engine core thread stopped")
        handler = self.output_handler
        if handler is not None and handler.done():
            why = "cancelled" if handler.cancelled() else repr(handler.exception())
            raise EngineDeadError(f"AsyncLLM: the output handler stopped ({why})")

    def shutdown(self) -> None:
        """Stop the core thread (after its current step) and the output handler; consumers
        still waiting get ``EngineDeadError``.

        upstream: vllm/v1/engine/async_llm.py:248 @ v0.11.0
        """
        if self._dead is None:
            self._dead = EngineDeadError("AsyncLLM: the engine was shut down")
            self.output_processor.propagate_error(self._dead)
        self._input.put(_SHUTDOWN)
        if self._core_thread is not None:
            self._core_thread.join(timeout=60)
        if self.output_handler is not None:
            self.output_handler.cancel()


class AsyncLLM(AsyncLLMBase):
    """:class:`AsyncLLMBase` with its per-request stream: the engine a server runs on.

    upstream: vllm/v1/engine/async_llm.py:52 @ v0.11.0
    """

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output as deltas (new text and token ids per completion) until
        the last one, which has ``finished=True``.

        Bad input raises before anything is queued. If the caller stops iterating (a client
        disconnect cancels the task; an abandoned generator is closed) the request is aborted.

        upstream: vllm/v1/engine/async_llm.py:323 @ v0.11.0
        """
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self._run_output_handler()
        collector = self.add_request(request_id, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                # Take what is ready without a task switch; wait only when nothing is.
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
