"""A real mini_vllm HTTP server for tests: uvicorn in a thread of the process that starts it.

Shared by ``tests/test_serve.py`` (the reference server) and lab 03-05's graded tests (the
student's pieces in the same server); :class:`CountingTokenizer` serves the detokenizer's tests
there and in ``tests/test_serve_detokenizer.py``. The server runs in a thread of the process
that holds its engine: the test's, or for lab 03-05 the student's process
(course/labs/student_process.py), where the test then reads the engine's block pool through
handles. It listens on a TCP port on 127.0.0.1 or,
where the network is cut off (the grader's sandbox has no loopback interface), on a Unix socket;
either way the official ``openai`` client talks real HTTP to it.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mini_vllm.tokenizers.tokenizer import ByteTokenizer

__all__ = ["CountingTokenizer", "ServerThread", "openai_client", "wait_idle"]

UDS_BASE = "http://mini-vllm.local"  # the host name of requests sent over a Unix socket


class CountingTokenizer(ByteTokenizer):
    """A byte tokenizer that records how many tokens each decode call was given (``calls``), so
    that a test can tell an incremental detokenizer from one that re-decodes the whole text."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        ids = list(token_ids)
        self.calls.append(len(ids))
        return super().decode(ids, skip_special_tokens)


class ServerThread:
    """``app`` served by uvicorn in a daemon thread until :meth:`stop`.

    ``uds=True`` listens on a Unix socket in a fresh temporary folder, else on a free TCP port of
    127.0.0.1. Invariant: after :meth:`start` returns the server accepts requests.
    """

    def __init__(self, app: Any, *, uds: bool = False) -> None:
        from mini_vllm.entrypoints.openai.api_server import bind_socket, make_server

        self.sock = None
        self._tmp = None
        if uds:
            self._tmp = tempfile.TemporaryDirectory(prefix="mini_vllm-serve-")
            self.uds: str | None = str(Path(self._tmp.name) / "server.sock")
            self.server = make_server(app)
            self.server.config.uds = self.uds
            self.base = UDS_BASE
            run_kwargs: dict[str, Any] = {}
        else:
            self.uds = None
            self.sock = bind_socket("127.0.0.1", 0)
            port = self.sock.getsockname()[1]
            self.server = make_server(app, port=port)
            self.base = f"http://127.0.0.1:{port}"
            run_kwargs = {"sockets": [self.sock]}
        self.thread = threading.Thread(target=self.server.run, kwargs=run_kwargs, daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the test server did not start within {timeout:.0f} s "
                                   "(see the uvicorn log above)")
            time.sleep(0.01)
        return self

    def http_client(self, timeout: float = 60.0) -> Any:
        """An ``httpx.Client`` that reaches this server (over its Unix socket when it has one)."""
        return http_client(self.uds, self.base, timeout)

    def client(self, timeout: float = 60.0) -> Any:
        """The official ``openai`` client for this server (no retries: a test sees every error)."""
        return openai_client(self.uds, self.base, timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.sock is not None:
            self.sock.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def http_client(uds: str | None, base: str = UDS_BASE, timeout: float = 60.0) -> Any:
    """An ``httpx.Client`` for the server on the Unix socket ``uds`` (or at ``base`` when
    ``uds`` is None)."""
    import httpx

    transport = httpx.HTTPTransport(uds=uds) if uds else None
    return httpx.Client(base_url=base, transport=transport, timeout=timeout)


def openai_client(uds: str | None, base: str = UDS_BASE, timeout: float = 60.0) -> Any:
    """The official ``openai`` client for a server listening on the Unix socket ``uds`` (or at
    ``base`` when ``uds`` is None), with no retries: a test sees every error. A test whose
    server runs in another process (lab 03-05's, beside the student's code) needs only this."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                         timeout=timeout, http_client=http_client(uds, base, timeout))


def wait_idle(engine: Any, timeout: float = 20.0) -> str | None:
    """Wait until ``engine`` (an ``AsyncLLM``) holds no request and no KV block; ``None`` then,
    else a sentence saying what is still held after ``timeout`` seconds (the loop applies aborts
    between steps, so a clean engine gets there within a step or two). An engine core in its
    own process is read from the load it last reported (it reports one after every step, and
    once more when it goes idle)."""
    deadline = time.monotonic() + timeout
    while True:
        if engine.multiprocessing:
            load = engine.stat_logger.load
            in_core, blocks = load.num_running_reqs + load.num_waiting_reqs, \
                load.num_kv_blocks_in_use
        else:
            core = engine.engine_core
            in_core, blocks = len(core.scheduler.requests), core.num_blocks_in_use
        held = (in_core, blocks, len(engine.output_processor.request_states))
        if held == (0, 0, 0):
            return None
        if time.monotonic() > deadline:
            return _still_held(engine, held, timeout)
        time.sleep(0.01)


def _still_held(engine: Any, held: tuple[int, int, int], timeout: float) -> str:
    """What the engine still holds, each structure by name with the request ids in it."""
    def ids(mapping) -> str:
        names = [repr(k) for k in list(mapping)[:4]]
        return ", ".join(names) + (", ..." if len(mapping) > 4 else "")

    parts = []
    if held[0] and engine.multiprocessing:
        parts.append(f"{held[0]} request(s) in the engine core's scheduler")
    elif held[0]:
        parts.append(f"{held[0]} request(s) in the scheduler (engine_core.scheduler.requests: "
                     f"{ids(engine.engine_core.scheduler.requests)})")
    if held[1]:
        parts.append(f"{held[1]} KV block(s) in use")
    if held[2]:
        parts.append(f"{held[2]} request(s) in output_processor.request_states "
                     f"({ids(engine.output_processor.request_states)}): the output processor "
                     "never saw their end (a finish it did not process, or an abort that did "
                     "not reach it)")
    return (f"the engine still holds {'; '.join(parts)}, {timeout:.0f} s after the last client "
            "finished or went away: an abort or a finish did not free them")
