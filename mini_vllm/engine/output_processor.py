"""From the engine core's token news to each client's stream of text.

After every engine step the core reports, per request, the token ids it gained and whether it
finished (:class:`~mini_vllm.outputs.EngineCoreOutput`). :class:`OutputProcessor` turns
that into what a client wants:

* text, through one :class:`~mini_vllm.engine.detokenizer.IncrementalDetokenizer` per request (and
* the
  stop strings, which only text can see: a request that hit one must be aborted in the core);
* one stream per *user* request: ``n > 1`` is fanned out into ``n`` engine requests (children)
  whose deltas are merged back into the parent's stream (:class:`ParentRequest`);
* latency statistics for ``/metrics``: time to first token, inter-token latency, end to end
  (:class:`IterationStats`).

Each user request owns a :class:`RequestOutputCollector`: a one-slot mailbox that merges deltas
when the producer (the engine loop) gets ahead of the consumer (the HTTP response), so a slow
client never makes a queue grow without bound and never loses a token.

upstream: vllm/v1/engine/output_processor.py:301 @ v0.11.0
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.engine.logprobs import LogprobsProcessor
from mini_vllm.metrics.stats import IterationStats
from mini_vllm.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from mini_vllm.request import FinishReason, Request

__all__ = [
    "OutputProcessor",
    "OutputProcessorOutput",
    "ParentRequest",
    "RequestOutputCollector",
    "RequestState",
    "merge_request_output",
]


def merge_request_output(into: RequestOutput, new: RequestOutput) -> None:
    """Append the delta ``new`` to the pending delta ``into`` (the same user request).

    Completions are matched by ``index``: text and token ids are concatenated and the latest
    finish reason wins; a completion ``into`` does not have yet is added. ``finished`` and the
    metrics are the newest.

    upstream: vllm/outputs.py:140 @ v0.11.0
    """
    by_index = {c.index: c for c in into.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            into.outputs.append(comp)
            by_index[comp.index] = comp
            continue
        old.text += comp.text
        old.token_ids = [*old.token_ids, *comp.token_ids]
        old.finish_reason = comp.finish_reason
        old.stop_reason = comp.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.metrics = new.metrics


class RequestOutputCollector:
    """One user request's mailbox between the engine loop (``put``) and its consumer (``get``).

    Invariant: at most one item waits. A delta put while another waits is merged into it
    (:func:`merge_request_output`), so the consumer gets every token exactly once, in order,
    however far behind it falls. An exception put replaces whatever waits and is raised by the
    next ``get``.

    Unlike upstream's, a ``get`` that has waited ``LOOP_CHECK_S`` asks ``loop_running`` (when
    given) whether anything can still arrive, and raises instead of waiting forever: a
    ``generate`` that never started the engine loop fails in a second, saying so.

    upstream: vllm/v1/engine/output_processor.py:26 @ v0.11.0
    """

    LOOP_CHECK_S = 1.0

    def __init__(self, loop_running: Callable[[], bool] | None = None) -> None:
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        self.loop_running = loop_running

    def put(self, output: RequestOutput | BaseException) -> None:
        """Leave ``output`` for the consumer without waiting (called from the engine loop)."""
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            merge_request_output(self.output, output)

    async def get(self) -> RequestOutput:
        """Wait for the next output; raise the exception put instead of one."""
        while self.output is None:
            if self.loop_running is None:
                await self.ready.wait()
                continue
            try:
                await asyncio.wait_for(self.ready.wait(), self.LOOP_CHECK_S)
            except TimeoutError:
                if self.output is None and not self.loop_running():
                    raise RuntimeError(
                        "AsyncLLM: no output will come: the engine's output loop is not "
                        "running. Start it with self._run_output_handler() before "
                        "add_request (AsyncLLM.generate's first step)") from None
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        """The waiting output, or ``None`` when nothing waits."""
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        assert output is not None
        return output


@dataclass
class ParentRequest:
    """A user request with ``n > 1``: its children are ``n`` engine requests, one per sample.

    Child ``i`` is named ``f"{i}_{request_id}"``. The user request is finished when every child
    is.

    upstream: vllm/v1/engine/parallel_sampling.py:12 @ v0.11.0
    """

    request_id: str
    n: int
    unfinished: set[str] = field(default_factory=set)

    @staticmethod
    def child_id(request_id: str, index: int, n: int) -> str:
        """The engine request id of sample ``index`` (the user's id itself when ``n == 1``)."""
        return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class RequestState:
    """What the output processor keeps per engine request (one sample of a user request).

    Timestamps are ``time.monotonic()`` seconds; ``first_token_time`` and ``last_token_time``
    stay 0 until the request has produced a token.

    upstream: vllm/v1/engine/output_processor.py:80 @ v0.11.0
    """

    request_id: str
    parent: ParentRequest
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    queue: RequestOutputCollector
    arrival_time: float
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class OutputProcessorOutput:
    """Engine requests that text-side stop strings finished: the core must abort them.

    upstream: vllm/v1/engine/output_processor.py:75 @ v0.11.0
    """

    reqs_to_abort: list[str]


class OutputProcessor:
    """Detokenize the core's outputs and deliver them, merged per user request, to collectors.

    Invariant: ``request_states`` holds exactly the engine requests that are neither finished nor
    aborted; ``parent_requests`` the user requests with a child among them.

    upstream: vllm/v1/engine/output_processor.py:301 @ v0.11.0
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: Request, prompt: str | None, parent: ParentRequest,
                    index: int, queue: RequestOutputCollector,
                    arrival_time: float | None = None) -> None:
        """Start tracking engine request ``request`` (sample ``index`` of ``parent``).

        upstream: vllm/v1/engine/output_processor.py:356 @ v0.11.0
        """
        rid = request.request_id
        if rid in self.request_states:
            raise ValueError(f"OutputProcessor: request id {rid!r} is already tracked")
        self.request_states[rid] = RequestState(
            request_id=rid, parent=parent, index=index, prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.sampling_params),
            queue=queue,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        parent.unfinished.add(rid)
        self.parent_requests[parent.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop tracking user requests (or single engine requests); return the engine request
        ids the core must abort. Unknown ids are ignored.

        upstream: vllm/v1/engine/output_processor.py:325 @ v0.11.0
        """
        to_abort: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.pop(rid, None)
            children = list(parent.unfinished) if parent is not None else [rid]
            for child in children:
                state = self.request_states.pop(child, None)
                if state is not None:
                    to_abort.append(child)
                    state.parent.unfinished.discard(child)
                    if not state.parent.unfinished:
                        self.parent_requests.pop(state.parent.request_id, None)
        return to_abort

    def propagate_error(self, exc: BaseException, request_ids: list[str] | None = None) -> None:
        """Hand ``exc`` to the consumers of the given engine requests (all when ``None``) and
        stop tracking them: the engine failed them.

        upstream: vllm/v1/engine/output_processor.py:318 @ v0.11.0
        """
        ids = list(self.request_states) if request_ids is None else request_ids
        for rid in ids:
            state = self.request_states.pop(rid, None)
            if state is None:
                continue
            state.queue.put(exc)
            state.parent.unfinished.discard(rid)
            if not state.parent.unfinished:
                self.parent_requests.pop(state.parent.request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float,
                        stats: IterationStats | None = None) -> OutputProcessorOutput:
        """Detokenize one step's outputs and put a delta in each affected user's collector.

        ``now`` (``time.monotonic()``) is when the step's tokens were made. A request that a stop
        string finished is reported finished (reason ``stop``, ``stop_reason`` the string) and
        listed in ``reqs_to_abort``. Outputs of requests no longer tracked (aborted while the step
        ran) are dropped.

        upstream: vllm/v1/engine/output_processor.py:380 @ v0.11.0
        """
        reqs_to_abort: list[str] = []
        stats = stats if stats is not None else IterationStats()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            stop_terminated = (finish_reason == FinishReason.STOP
                               and not isinstance(stop_reason, str))
            stop_str = state.detokenizer.update(
                out.new_token_ids, stop_terminated=stop_terminated,
                finished=finish_reason is not None)
            if stop_str is not None and finish_reason is None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                reqs_to_abort.append(out.request_id)
            self._update_stats(state, out, now, finish_reason, stats)
            finished = finish_reason is not None
            text = state.detokenizer.get_next_output_text(finished, delta=True)
            if finished:
                del self.request_states[out.request_id]
                state.parent.unfinished.discard(out.request_id)
            parent_done = not state.parent.unfinished
            if parent_done:
                self.parent_requests.pop(state.parent.request_id, None)
            state.queue.put(RequestOutput(
                request_id=state.parent.request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                outputs=[CompletionOutput(
                    index=state.index, text=text, token_ids=list(out.new_token_ids),
                    finish_reason=None if finish_reason is None else str(finish_reason),
                    stop_reason=stop_reason,
                )],
                finished=parent_done,
                metrics={"num_cached_tokens": state.num_cached_tokens,
                         "arrival_time": state.arrival_time,
                         "first_token_time": state.first_token_time},
            ))
        return OutputProcessorOutput(reqs_to_abort)

    @staticmethod
    def _update_stats(state: RequestState, out: EngineCoreOutput, now: float,
                      finish_reason: FinishReason | None, stats: IterationStats) -> None:
        if out.new_token_ids:
            if state.num_generation_tokens == 0:
                state.first_token_time = now
                state.num_cached_tokens = out.num_cached_tokens
                stats.time_to_first_tokens.append(now - state.arrival_time)
                stats.num_prompt_tokens += len(state.prompt_token_ids)
            else:
                stats.inter_token_latencies.append(now - state.last_token_time)
            state.last_token_time = now
            state.num_generation_tokens += len(out.new_token_ids)
            stats.num_generation_tokens += len(out.new_token_ids)
        if finish_reason is not None:
            stats.e2e_latencies.append(now - state.arrival_time)
            stats.finished_reasons.append(str(finish_reason))


@dataclass
class _Tracked:
    """What generate() keeps per request: where its output goes, and its stop-string state."""

    prompt_index: int
    child_index: int
    request: Request
    text_len: int = 0  # characters of output text checked for stop strings so far
    cut: int | None = None  # where a stop string cut the text
    logprobs: LogprobsProcessor | None = None  # when the request asks for log-probabilities
