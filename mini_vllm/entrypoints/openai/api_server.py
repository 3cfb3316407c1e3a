"""The FastAPI app of the OpenAI-compatible server, and running it with uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` (200 while the engine
serves, 503 once it cannot), ``GET /metrics`` (Prometheus' text format).

Every refusal has the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``):
a body that is not valid JSON or has a field of the wrong type is a 400 (FastAPI's 422 is turned
into upstream's 400), an unknown model a 404, an unknown route a 404.

A client that disconnects cancels its request's handler (whole responses: see
:func:`with_cancellation`; streams: ``SSEResponse``), which aborts the engine request and frees
its KV blocks before the engine's next step.

upstream: vllm/entrypoints/openai/api_server.py:1511 @ v0.11.0
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    model_list,
)
from mini_vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.openai.serving_engine import error_response
from mini_vllm.metrics.loggers import CONTENT_TYPE

__all__ = ["build_app", "make_server", "run_server", "with_cancellation"]

# What a handler returns when its client is gone: nobody reads it (nginx's "client closed").
CLIENT_CLOSED = 499


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def with_cancellation(handler: Callable[..., Awaitable[Response]]
                      ) -> Callable[..., Awaitable[Response]]:
    """Run ``handler`` (whose body FastAPI has already read) until it answers or its client
    disconnects, whichever comes first; a disconnect cancels the handler, and the cancellation
    reaches the engine request it waits on (which is aborted).

    upstream: vllm/entrypoints/utils.py:47 @ v0.11.0
    """

    @functools.wraps(handler)
    async def wrapper(body: Any, raw_request: Request) -> Response:
        work = asyncio.ensure_future(handler(body, raw_request))
        gone = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled():
            return Response(status_code=CLIENT_CLOSED)
        return work.result()

    return wrapper


def build_app(engine: AsyncLLM, *, model_name: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; shutting the app down shuts the engine down.

    upstream: vllm/entrypoints/openai/api_server.py:1511 @ v0.11.0
    """
    name = model_name or engine.model_name
    completion = OpenAIServingCompletion(engine, name)
    chat = OpenAIServingChat(engine, name, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="mini_vllm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: "
            f"{err.get('msg', '')}" for err in exc.errors())
        return error_response(f"invalid request: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        return error_response(str(exc.detail), status, status.phrase.replace(" ", ""))

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any reason to be unhealthy is a 503
            return error_response(str(exc), HTTPStatus.SERVICE_UNAVAILABLE,
                                  "ServiceUnavailableError")
        return Response(status_code=HTTPStatus.OK)

    @app.get("/v1/models")
    async def show_available_models() -> JSONResponse:
        return JSONResponse(model_list(name, engine.max_model_len))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.stat_logger.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    @with_cancellation
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(body)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create_chat_completion(body)

    return app


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "warning") -> Any:
    """A ``uvicorn.Server`` for ``app`` (not started). ``port=0`` binds a free port: start the
    server with a socket from :func:`bind_socket` to know which.

    upstream: vllm/entrypoints/openai/api_server.py:1835 @ v0.11.0
    """
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port the OS picks).

    upstream: vllm/entrypoints/openai/api_server.py:1801 @ v0.11.0
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(engine: AsyncLLM, *, host: str = "127.0.0.1", port: int = 8000,
               model_name: str | None = None, chat_template: str | None = None,
               log_level: str = "info") -> None:
    """Serve ``engine`` over HTTP until interrupted (Ctrl-C), then shut it down.

    upstream: vllm/entrypoints/openai/api_server.py:1877 @ v0.11.0
    """
    app = build_app(engine, model_name=model_name, chat_template=chat_template)
    make_server(app, host, port, log_level).run()
