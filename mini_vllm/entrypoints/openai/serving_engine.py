"""What the completion and chat endpoints share: model checks, errors, and the SSE stream.

The error contract (checked by ``tests/test_serve.py``): a request the server refuses gets a 4xx
with the OpenAI error body (``protocol.error_body``) and queues nothing in the engine; a failure
inside the engine after the stream started is sent as one SSE event holding the same body,
followed by ``data: [DONE]``.

upstream: vllm/entrypoints/openai/serving_engine.py:207 @ v0.11.0
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.openai.protocol import error_body
from mini_vllm.outputs import RequestOutput

__all__ = ["FieldError", "OpenAIServing", "SSEResponse", "error_response", "sse_event"]


class FieldError(ValueError):
    """A request refused because of one field: the 400's message, and the field as OpenAI's
    ``param``.

    upstream: none (upstream raises a plain ValueError and leaves ``param`` empty)
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def error_response(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                   err_type: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """A JSON response with the OpenAI error body and status ``status``.

    upstream: vllm/entrypoints/openai/serving_engine.py:439 @ v0.11.0
    """
    return JSONResponse(error_body(message, err_type, status.value, param),
                        status_code=status.value)


def bad_request(exc: Exception) -> JSONResponse:
    """The 400 of a request the server refused with ``exc`` (naming its field when it is a
    :class:`FieldError`).

    upstream: none (vLLM builds its error responses inline in each serving class)
    """
    return error_response(str(exc), param=getattr(exc, "param", None))


def sse_event(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line.

    upstream: vllm/entrypoints/openai/serving_completion.py:461 @ v0.11.0
    """
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops its generator when the client goes away.

    It always listens for ``http.disconnect`` while it streams (Starlette does so only for old
    ASGI servers; newer ones report a disconnect only when a write fails, which for a request
    still waiting for its first token could be many seconds later), and it closes the body
    generator however the response ends, so the engine request behind it is aborted at once.

    upstream: vllm/entrypoints/utils.py:47 @ v0.11.0
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except OSError:
            pass  # the client went away during a write: nothing left to tell it
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServing:
    """The model name check, request ids, and the first-output handshake of every endpoint.

    upstream: vllm/entrypoints/openai/serving_engine.py:207 @ v0.11.0
    """

    request_id_prefix = "cmpl"

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, requested: str | None) -> JSONResponse | None:
        """``None`` when the request names this server's model (or none); a 404 otherwise.

        upstream: vllm/entrypoints/openai/serving_engine.py:466 @ v0.11.0
        """
        if requested in (None, "", self.model_name):
            return None
        return error_response(
            f"The model `{requested}` does not exist; this server serves `{self.model_name}` "
            "(see GET /v1/models).", HTTPStatus.NOT_FOUND, "NotFoundError")

    def refuse(self, request: Any) -> JSONResponse | None:
        """What every endpoint answers before reading a request's content: a 404 for another
        model, a 400 for a field this server does not support; ``None`` for neither.

        upstream: none (each of upstream's endpoints makes these checks in its own handler)
        """
        if (refused := self.check_model(request.model)) is not None:
            return refused
        if unsupported := request.unsupported():
            return error_response(f"{', '.join(unsupported)}: not supported by this server")
        return None

    def output_budget(self, requested: int | None, prompt_len: int,
                      field: str = "max_tokens") -> int:
        """How many tokens the request may generate: ``requested``, or without it all the room
        the prompt leaves in the context (at least 1).

        Invariant: prompt plus output never exceeds ``max_model_len``. A ``requested`` that
        would is refused with a :class:`FieldError` naming ``field``, not clipped: a client
        must not get fewer tokens than it asked for without being told (upstream and OpenAI
        answer 400 too). A prompt that leaves no room at all is the engine's to refuse, with
        its own message; a ``requested`` below 1 is ``SamplingParams``'.

        upstream: none (upstream makes this check where it tokenizes the prompt)
        """
        context = self.engine.max_model_len
        room = context - prompt_len
        if requested is None:
            return max(room, 1)
        if room >= 1 and requested > room:
            raise FieldError(
                f"{field}={requested} plus the prompt's {prompt_len} tokens is more than the "
                f"model's context of {context} tokens; ask for at most {room} (or leave {field} "
                "out to fill the context)", field)
        return requested

    async def respond(self, prompt: Any, params: Any, stream: bool,
                      streamer: Callable[..., AsyncIterator[str]],
                      collector: Callable[..., Awaitable[Response]]) -> Response:
        """Start the request and answer it: the SSE stream of ``streamer(outputs, request_id,
        created)``, or ``await collector(outputs, request_id, created)``; a 400 when the engine
        refuses the request before its first output.

        upstream: none (upstream's completion and chat handlers each end this way)
        """
        request_id = self.new_request_id()
        started = await self.start(prompt, params, request_id)
        if isinstance(started, JSONResponse):
            return started
        outputs, created = chain(*started), self.created()
        if stream:
            return SSEResponse(streamer(outputs, request_id, created))
        return await collector(outputs, request_id, created)

    def new_request_id(self) -> str:
        return f"{self.request_id_prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def created() -> int:
        return int(time.time())

    async def start(self, prompt: Any, params: Any, request_id: str
                    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]] | JSONResponse:
        """Queue the request and wait for its first output.

        Returns the first output and the rest of the stream, or an HTTP error while nothing has
        been sent: a 400 when the engine refuses the request (prompt too long, bad parameters),
        a 500 naming the fault when a step fails before the request's first output reaches
        here (a fast engine can run several steps before this handler wakes).
        """
        stream = self.engine.generate(prompt, params, request_id)
        try:
            first = await anext(stream)
        except (ValueError, TypeError) as exc:
            await stream.aclose()
            return error_response(str(exc))
        except RuntimeError as exc:  # the engine failed (EngineGenerateError, EngineDeadError)
            await stream.aclose()
            return error_response(f"the engine failed while generating: {exc}",
                                  HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        return first, stream


async def chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]
                ) -> AsyncIterator[RequestOutput]:
    """``first`` followed by the rest of the stream (closing the stream when closed early).

    upstream: none (the first output is awaited apart so that a refusal can still be a 4xx)
    """
    try:
        yield first
        if not first.finished:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of a response.

    upstream: vllm/entrypoints/openai/protocol.py:147 @ v0.11.0
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_error_event(exc: Exception) -> str:
    """An engine failure after the stream started, as the SSE error event clients expect.

    upstream: vllm/entrypoints/openai/serving_engine.py:454 @ v0.11.0
    """
    return sse_event(error_body(f"the engine failed while generating: {exc}",
                                "InternalServerError", 500))


@dataclass
class CollectedChoices:
    """A whole (non-streamed) response's choices: per index, text, token ids and reasons.

    upstream: vllm/entrypoints/openai/serving_completion.py:496 @ v0.11.0
    """

    n: int
    prompt_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.texts = [""] * self.n
        self.token_ids = [[] for _ in range(self.n)]
        self.finish_reasons = [None] * self.n
        self.stop_reasons = [None] * self.n

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


async def collect_choices(outputs: AsyncIterator[RequestOutput], n: int) -> CollectedChoices:
    """Drain a request's deltas into its ``n`` choices.

    upstream: vllm/entrypoints/openai/serving_completion.py:496 @ v0.11.0
    """
    got = CollectedChoices(n)
    async for out in outputs:
        got.prompt_ids = out.prompt_token_ids
        for comp in out.outputs:
            got.texts[comp.index] += comp.text
            got.token_ids[comp.index].extend(comp.token_ids)
            if comp.finish_reason is not None:
                got.finish_reasons[comp.index] = comp.finish_reason
                got.stop_reasons[comp.index] = comp.stop_reason
    return got
