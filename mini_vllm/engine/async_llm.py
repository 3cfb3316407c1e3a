"""``AsyncLLM``: the engine behind a server. Requests arrive at any time; tokens stream out.

``LLM.generate`` takes every prompt up front and returns when all are done. A server cannot: a
request arrives while others are half way through, each client wants its tokens as they are
made, and a client may hang up. The shape is upstream's:

* the **engine core** runs :class:`~mini_vllm.engine.core_proc.EngineCoreProc`'s busy loop:
  between steps it applies the adds and aborts waiting in its input queue, then steps and sends
  the step's outputs (with a timestamp and a snapshot of the engine's load). It never waits for
  the server, so steps run back to back however busy the HTTP side is. By default it runs in a
  process of its own (:class:`~mini_vllm.engine.core_client.AsyncMPClient`), so the server's
  Python never competes with it for a GIL; ``multiprocessing=False`` (or the environment's
  ``MINI_VLLM_ENABLE_MULTIPROCESSING=0``) runs it on a thread of this process
  (:class:`~mini_vllm.engine.core_client.InprocClient`), where ``engine_core`` can be inspected;
* ``generate()`` (one coroutine per HTTP request, on the event loop) validates the prompt,
  registers the request with the :class:`~mini_vllm.engine.output_processor.OutputProcessor`,
  sends it to the core, and yields the request's deltas from its collector until it finishes;
* the **output handler** (a task on the event loop) takes each step's outputs, detokenizes them
  into the collectors, sends back aborts for requests a stop string finished (the core cannot
  see text), and records the metrics;
* a client that disconnects cancels its ``generate()``, which aborts the request: the core
  finishes it in the scheduler before its next step, and its KV blocks go back to the pool.

Only the core's loop touches the engine core (scheduler, KV cache manager, runner); the event
loop talks to it through the client. Tokens a step made for a request that was aborted
meanwhile are dropped. A core that dies (or hangs) fails every open stream with
:class:`EngineDeadError`, and ``check_health`` says why from then on.

upstream: vllm/v1/engine/async_llm.py:52 @ v0.11.0
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from mini_vllm.engine.core import EngineCoreBase
from mini_vllm.engine.core_client import AsyncMPClient, EngineCoreClient, InprocClient
from mini_vllm.engine.exceptions import EngineDeadError, EngineGenerateError
from mini_vllm.engine.messages import EngineCoreAbort, EngineCoreRequest
from mini_vllm.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
)
from mini_vllm.engine.parallel_sampling import child_sampling_params
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.metrics.loggers import PrometheusStatLogger
from mini_vllm.metrics.stats import IterationStats
from mini_vllm.outputs import RequestOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "AsyncLLMBase", "EngineDeadError", "EngineGenerateError"]


def _multiprocessing_default() -> bool:
    """``MINI_VLLM_ENABLE_MULTIPROCESSING``: ``1`` (the default) or ``0``, as upstream's
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` (vllm/envs.py)."""
    value = os.environ.get("MINI_VLLM_ENABLE_MULTIPROCESSING", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"MINI_VLLM_ENABLE_MULTIPROCESSING must be 0 (the engine core on a "
                         f"thread of this process) or 1 (in its own process), got {value!r}")
    return value == "1"


class AsyncLLMBase:
    """Serve many requests at once from one engine, streaming each one's output as it is made.

    Everything but the per-request stream, ``generate``, which is :class:`AsyncLLM`'s (lab 03-05
    gives this part: requests in, the engine core's client, the output handler, abort,
    shutdown).

    Build it from an :class:`~mini_vllm.entrypoints.llm.LLM` (which loads the model and checks the
    engine knobs): ``AsyncLLM(LLM(...))`` or ``AsyncLLM.from_engine_args(model=..., **knobs)``.
    ``multiprocessing``: the engine core in its own process (the default; see the module
    docstring), which starts here and is ready when the constructor returns; ``llm``'s own engine
    core is released then (its KV cache: ``llm.generate`` would build it again). In one process,
    once ``generate`` has started the core thread, the ``LLM``'s own ``generate`` must not be
    called (they share one engine core) until ``shutdown``. ``step_timeout_s``: in the core
    process, a step that runs longer is taken for a hang (the core is killed); ``core_setup``
    (picklable) runs there before the engine is built (``course engine`` composes the student's
    pieces there as in this process). ``model_name`` is what ``/v1/models`` lists and
    ``/metrics`` labels.

    Invariants: every user request that ``generate`` accepted ends in exactly one of: finished
    (its last delta has ``finished=True``), aborted (its consumer went away; its engine requests
    are finished in the scheduler and their blocks freed before the next step), or failed (the
    consumer gets the exception; the engine is made clean again, or is dead and says so).
    ``stat_logger`` holds the engine's state as of the last step.

    upstream: vllm/v1/engine/async_llm.py:52 @ v0.11.0
    """

    def __init__(self, llm: LLM, *, model_name: str = "mini_vllm",
                 multiprocessing: bool | None = None, step_timeout_s: float | None = 60.0,
                 core_setup: Callable[[], None] | None = None) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"AsyncLLM: pass a mini_vllm.LLM, got {type(llm).__name__}")
        self.llm = llm
        self.model_name = model_name
        self.output_processor = OutputProcessor(llm.tokenizer)
        self.stat_logger = PrometheusStatLogger(model_name)
        self.output_handler: asyncio.Task | None = None
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        if multiprocessing is None:
            multiprocessing = _multiprocessing_default()
        if multiprocessing and llm.config.tensor_parallel_size > 1:
            raise ValueError("AsyncLLM: an engine core in a process of its own cannot start "
                             "tensor-parallel workers yet; pass multiprocessing=False (the core "
                             "on a thread of this process) or use tensor_parallel_size=1")
        self.multiprocessing = multiprocessing
        if multiprocessing:
            # Released before the core starts: the core builds its own, and this one may hold
            # what only one engine can (a KV store's port, lab 04-06).
            llm.engine.shutdown()
            llm.engine = None
        self.core_client: EngineCoreClient = (
            AsyncMPClient(llm, step_timeout_s=step_timeout_s, setup=core_setup)
            if multiprocessing
            else InprocClient(llm))

    @classmethod
    def from_engine_args(cls, model: Any = None, *, model_name: str = "mini_vllm",
                         multiprocessing: bool | None = None,
                         **llm_kwargs: Any) -> AsyncLLMBase:
        """Load the model and build the engine as ``LLM(model, **llm_kwargs)`` does.

        upstream: vllm/v1/engine/async_llm.py:221 @ v0.11.0
        """
        return cls(LLM(model, **llm_kwargs), model_name=model_name,
                   multiprocessing=multiprocessing)

    # ------------------------------------------------------------------ properties

    @property
    def engine_core(self) -> EngineCoreBase:
        """The engine core, when it runs in this process (it is rebuilt after a failed step, so
        always read it here)."""
        if self.multiprocessing:
            raise AttributeError("AsyncLLM: the engine core runs in its own process; build "
                                 "AsyncLLM(..., multiprocessing=False) to inspect it")
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
        """Check the request, register it, and send it to the engine core; return its collector.

        ``prompt``: a string, a list of token ids, or ``{"prompt_token_ids": [...]}`` (with an
        optional ``"prompt"``). Bad input raises ``TypeError``/``ValueError`` with the same
        messages as ``LLM.generate`` and queues nothing. ``params.n > 1`` becomes ``n`` engine
        requests (a seeded parent gives child ``j`` the seed ``seed + j``, as ``LLM`` does).

        upstream: vllm/v1/engine/async_llm.py:261 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; start a new engine")
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
        try:
            self.core_client.add_requests([
                EngineCoreRequest(r.request_id, r.prompt_token_ids, r.sampling_params, arrival)
                for r in requests])
        except EngineDeadError:
            self.output_processor.abort_requests([request_id])
            raise
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
            requests.append(Request(rid, list(ids), child, None))
        return requests

    def abort(self, request_id: str) -> None:
        """Stop a user request: no more outputs; its engine requests are finished in the
        scheduler (blocks freed) before the next step. Unknown or finished ids are ignored.

        upstream: vllm/v1/engine/async_llm.py:485 @ v0.11.0
        """
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            self._abort_in_core(child_ids, RequestStatus.FINISHED_ABORTED)

    def _abort_in_core(self, ids: list[str], status: RequestStatus) -> None:
        try:
            self.core_client.abort_requests(EngineCoreAbort(list(ids), status))
        except EngineDeadError:  # nothing left to abort
            pass

    # ------------------------------------------------------------------ the engine loop

    def _output_loop_running(self) -> bool:
        """Whether outputs can still reach the collectors (the output handler task lives)."""
        return self.output_handler is not None and not self.output_handler.done()

    def _run_output_handler(self) -> None:
        """Direct the core's outputs to the running event loop and start the output handler
        there (once per loop); in one process, the first call starts the core thread.

        upstream: vllm/v1/engine/async_llm.py:422 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; start a new engine")
        if self.output_handler is not None and not self.output_handler.done():
            return
        loop = asyncio.get_running_loop()
        self.core_client.start(loop)
        self.output_handler = loop.create_task(self._output_handler_loop(),
                                               name="mini_vllm-output-handler")

    async def _output_handler_loop(self) -> None:
        """Turn each step's outputs into deltas for the collectors (on the event loop)."""
        while True:
            try:
                result = await self.core_client.get_output_async()
            except EngineDeadError as exc:  # the core is gone: every open stream fails
                self._dead = exc
                self.output_processor.propagate_error(exc)
                return
            if result.error is not None:
                error = (ValueError(result.error) if result.error_kind == "refused"
                         else EngineGenerateError(result.error))
                self.output_processor.propagate_error(error, result.failed)
                self.stat_logger.record(result.load, None)
                continue
            stats = IterationStats()
            processed = self.output_processor.process_outputs(result.outputs, result.timestamp,
                                                              stats)
            if processed.reqs_to_abort:  # stop strings: the core cannot see text
                self._abort_in_core(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
            self.stat_logger.record(result.load, stats if result.outputs else None)

    # ------------------------------------------------------------------ life cycle

    async def check_health(self) -> None:
        """Raise when the engine cannot serve (shut down, its core died or hangs, or the output
        handler died), saying why.

        upstream: vllm/v1/engine/async_llm.py:608 @ v0.11.0
        """
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self.core_client.check_health()
        handler = self.output_handler
        if handler is not None and handler.done():
            why = "cancelled" if handler.cancelled() else repr(handler.exception())
            raise EngineDeadError(f"AsyncLLM: the output handler stopped ({why})")

    def shutdown(self) -> None:
        """Stop the engine core (after its current step; its process, if any, ends) and the
        output handler; consumers still waiting get ``EngineDeadError``.

        upstream: vllm/v1/engine/async_llm.py:248 @ v0.11.0
        """
        if self._dead is None:
            self._dead = EngineDeadError("AsyncLLM: the engine was shut down")
            self.output_processor.propagate_error(self._dead)
        self.core_client.shutdown()
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
