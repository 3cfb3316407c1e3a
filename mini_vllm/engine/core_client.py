"""How ``AsyncLLM`` reaches its engine core: on a thread of its own process, or in another process.

Both clients take requests and aborts from the event loop and hand each
:class:`~mini_vllm.engine.messages.EngineCoreOutputs` back through ``await get_output_async()``:

* :class:`InprocClient` runs :class:`~mini_vllm.engine.core_proc.EngineCoreProc`'s busy loop on
  a thread (upstream's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; its ``InprocClient`` steps in the
  caller's thread, which a server's event loop cannot afford). Tests can read the engine core
  directly;
* :class:`AsyncMPClient` starts the engine-core process (:func:`~mini_vllm.engine.core_proc.
  run_engine_core`, spawned: a forked child would inherit PyTorch's OpenMP pool and hang) and
  talks to it over two ZeroMQ sockets in a private folder: msgpack requests out, outputs in.
  The model's weights reach the child as one copy in shared memory (PyTorch's pickling of a
  tensor to a child process), which the child maps rather than copies again.

Faults, as the caller sees them: the core process exits or is killed, falls silent for
``HEARTBEAT_TIMEOUT_S``, or runs one step longer than ``step_timeout_s``: the client kills it
and ``get_output_async`` and ``check_health`` raise :class:`EngineDeadError` saying which; every
open stream ends with it. ``shutdown`` (also run when the client is garbage-collected or the
interpreter exits) stops the process and removes the socket folder; the core process also exits
by itself when the client's process dies.

upstream: vllm/v1/engine/core_client.py:49 @ v0.11.0
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import zmq

from mini_vllm.engine.core_proc import SHUTDOWN, EngineCoreProc, run_engine_core
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from mini_vllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

__all__ = ["AsyncMPClient", "EngineCoreClient", "InprocClient", "core_failure", "describe_exit"]

HEARTBEAT_TIMEOUT_S = 5.0  # a core this long silent is stuck (it says "alive" every 0.25 s)
STARTUP_TIMEOUT_S = 600.0


class EngineCoreClient:
    """What ``AsyncLLM`` asks of its engine core, wherever the core runs.

    ``start(loop)`` directs outputs to that event loop's queue (a loop run later replaces it).

    upstream: vllm/v1/engine/core_client.py:49 @ v0.11.0
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._dead: EngineDeadError | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._outputs = loop, asyncio.Queue()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        raise NotImplementedError

    def abort_requests(self, abort: EngineCoreAbort) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        """The core's next outputs; raises :class:`EngineDeadError` once the core is gone."""
        if self._outputs is None:
            raise RuntimeError("EngineCoreClient: call start(loop) before reading outputs")
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` (saying why) when the core cannot serve."""
        if self._dead is not None:
            raise self._dead

    def _post(self, item: EngineCoreOutputs | BaseException) -> None:
        """Hand an item to the event loop (from any thread; dropped when no loop runs)."""
        loop, outputs = self._loop, self._outputs
        if loop is None or outputs is None:
            return
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the event loop was closed
            pass


class InprocClient(EngineCoreClient):
    """The engine core's busy loop on a thread of this process.

    upstream: vllm/v1/engine/core_client.py:234 @ v0.11.0
    """

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.proc = EngineCoreProc(llm, self._post)
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        super().start(loop)
        if self._thread is None:
            self._thread = threading.Thread(target=self.proc.run_busy_loop, daemon=True,
                                            name="mini_vllm-engine-core")
            self._thread.start()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.proc.input_queue.put((EngineCoreRequestType.ADD, requests))

    def abort_requests(self, abort: EngineCoreAbort) -> None:
        self.proc.input_queue.put((EngineCoreRequestType.ABORT, abort))

    def check_health(self) -> None:
        super().check_health()
        if self._thread is not None and not self._thread.is_alive():
            raise EngineDeadError("AsyncLLM: the engine core thread stopped")

    def shutdown(self) -> None:
        self._dead = self._dead or EngineDeadError("AsyncLLM: the engine was shut down")
        self.proc.input_queue.put(SHUTDOWN)
        if self._thread is not None:
            self._thread.join(timeout=60)
            if not self._thread.is_alive():
                self.proc.engine_core.drain_batch_queue()  # no model thread left behind


@dataclasses.dataclass
class _Resources:
    """What :class:`AsyncMPClient` must release, kept apart from it so that a finalizer can
    release it without keeping the client alive."""

    ctx: zmq.Context
    socket_dir: str
    process: Any = None
    parent_alive: Any = None  # the pipe end whose closing tells the core its client is gone
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    receiver: threading.Thread | None = None

    def __call__(self) -> None:
        self.stop.set()
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout=5)
        _stop_process(self.process)
        if self.parent_alive is not None:
            self.parent_alive.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


class AsyncMPClient(EngineCoreClient):
    """The engine core in a process of its own, reached over ZeroMQ.

    ``llm``: the :class:`~mini_vllm.entrypoints.llm.LLM` whose model and knobs the core process
    builds its engine from. ``step_timeout_s``: a step that runs longer is taken for a hang
    (upstream's ``VLLM_ENGINE_ITERATION_TIMEOUT_S``, also 60 s by default); ``None``: no limit.
    ``setup``: a picklable callable the core process runs before it builds its engine.

    upstream: vllm/v1/engine/core_client.py:759 @ v0.11.0
    """

    def __init__(self, llm: Any, *, step_timeout_s: float | None = 60.0,
                 setup: Any = None) -> None:
        super().__init__()
        self.step_timeout_s = step_timeout_s
        res = self._resources = _Resources(zmq.Context(), tempfile.mkdtemp(prefix="mini_vllm-"))
        self._finalizer = weakref.finalize(self, res)
        input_address = f"ipc://{res.socket_dir}/input"
        output_address = f"ipc://{res.socket_dir}/output"
        self._input = res.ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never refuse a burst of adds as "dead"
        # A send waits only while no core is connected: the core says "ready" before its input
        # thread's connection is through, so the first add may come a moment early.
        self._input.setsockopt(zmq.SNDTIMEO, int(HEARTBEAT_TIMEOUT_S * 1000))
        output = res.ctx.socket(zmq.PULL)
        output.setsockopt(zmq.LINGER, 0)
        try:
            self._input.bind(input_address)
            output.bind(output_address)
        except zmq.ZMQError as exc:  # e.g. a socket path over the OS's ~107 characters
            self._input.close()
            output.close()
            self._finalizer()
            raise RuntimeError(
                f"AsyncLLM: cannot open the engine core's sockets in {res.socket_dir} ({exc}); "
                "set TMPDIR to a short folder, or pass multiprocessing=False") from exc
        self._encoder = MsgpackEncoder()
        spawn = multiprocessing.get_context("spawn")
        reader, res.parent_alive = spawn.Pipe(duplex=False)
        res.process = spawn.Process(
            target=run_engine_core, name="mini_vllm-engine-core", daemon=True,
            args=(_core_recipe(llm), input_address, output_address, reader, res.socket_dir,
                  setup))
        try:
            with _main_module_hidden():
                res.process.start()
            reader.close()
            self._wait_ready(output)
        except BaseException:
            output.close()
            self._finalizer()
            raise
        res.receiver = threading.Thread(target=self._receive, args=(output,), daemon=True,
                                        name="mini_vllm-core-client-output")
        res.receiver.start()

    @property
    def process(self) -> Any:
        return self._resources.process

    def _wait_ready(self, output: zmq.Socket) -> None:
        """Wait for the core's first message: its engine is built, or why it is not."""
        decoder = MsgpackDecoder(EngineCoreOutputs)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not output.poll(100):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({describe_exit(self.process.exitcode)}); its error is above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start in {STARTUP_TIMEOUT_S:.0f} s")
        first = decoder.decode(output.recv_multipart())
        if first.fatal:
            raise RuntimeError(first.error)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(EngineCoreRequestType.ADD, requests)

    def abort_requests(self, abort: EngineCoreAbort) -> None:
        self._send(EngineCoreRequestType.ABORT, abort)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self.check_health()
        try:
            self._input.send_multipart([kind.value, *self._encoder.encode(payload)], copy=False)
        except zmq.ZMQError as exc:  # no core connected for HEARTBEAT_TIMEOUT_S: gone or stuck
            raise EngineDeadError(f"AsyncLLM: the engine core took no input for "
                                  f"{HEARTBEAT_TIMEOUT_S:.0f} s ({exc})") from exc

    def _receive(self, output: zmq.Socket) -> None:
        """The client's output thread: decode what the core sends and hand it to the event
        loop; declare the core dead (killing it) as soon as :func:`core_failure` says why."""
        res, decoder = self._resources, MsgpackDecoder(EngineCoreOutputs)
        heard = time.monotonic()
        with output:
            while not res.stop.is_set():
                out = decoder.decode(output.recv_multipart()) if output.poll(100) else None
                now = time.monotonic()
                if out is not None:
                    heard = now
                exitcode = None if self.process.is_alive() else self.process.exitcode
                why = core_failure(out, now - heard, exitcode, self.step_timeout_s)
                if why is not None:
                    self._die(f"AsyncLLM: {why}; restart the server")
                    return
                if out is not None and out.load is not None:
                    self._post(out)

    def _die(self, why: str) -> None:
        """The core is gone: tell the event loop why, then kill what is left of it (a hung or
        stopped core gets no grace)."""
        self._dead = EngineDeadError(why)
        self._post(self._dead)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)

    def check_health(self) -> None:
        super().check_health()
        if not self.process.is_alive():
            raise EngineDeadError(f"AsyncLLM: the engine core process died "
                                  f"({describe_exit(self.process.exitcode)})")

    def shutdown(self) -> None:
        """Ask the core to stop after its step, then stop it by force if it does not; release
        the sockets and their folder. Safe to call twice."""
        self._dead = self._dead or EngineDeadError("AsyncLLM: the engine was shut down")
        if self.process.is_alive():
            try:
                self._input.send_multipart([EngineCoreRequestType.SHUTDOWN.value],
                                           flags=zmq.NOBLOCK)
                self.process.join(timeout=5)
            except zmq.ZMQError:
                pass
        self._input.close()
        self._finalizer()


def core_failure(out: EngineCoreOutputs | None, silent_s: float, exitcode: int | None,
                 step_timeout_s: float | None) -> str | None:
    """Why the engine core is to be taken for dead, or ``None`` while it serves.

    ``out``: what the core just sent (``None``: nothing within the poll); ``silent_s``: seconds
    since it last sent anything; ``exitcode``: its process's exit code once it has exited
    (negative: the signal that killed it), ``None`` while it runs. In order: a ``fatal``
    message (its own words); a heartbeat saying one step has run longer than
    ``step_timeout_s``; a process that exited; silence longer than ``HEARTBEAT_TIMEOUT_S``
    (the core says "alive" four times a second, so a stopped or frozen one falls silent).

    upstream: none (0.11's MP client watches the process's sentinel, and 0.33's core dumps its
    threads' stacks from a watchdog; neither takes a hung step for dead)
    """
    if out is not None:
        if out.fatal:
            return out.error or "the engine core failed"
        if step_timeout_s is not None and out.step_age > step_timeout_s:
            return f"one engine step has run for {out.step_age:.0f} s (a hang?)"
        return None
    if exitcode is not None:
        return f"the engine core process died ({describe_exit(exitcode)})"
    if silent_s > HEARTBEAT_TIMEOUT_S:
        return f"the engine core stopped answering for {HEARTBEAT_TIMEOUT_S:.0f} s"
    return None


def _core_recipe(llm: Any) -> functools.partial:
    """What the core process calls to build its ``LLM``: the same model, tokenizer and engine
    knobs as ``llm``. The weights go as a copy that pickling moves into shared memory, which the
    core maps without a second copy; ``llm``'s own stay where they are (moving them would leave
    the compiled decode step of ``llm``'s runner reading freed memory)."""
    knobs = {f.name: getattr(llm.config, f.name) for f in dataclasses.fields(llm.config)}
    device = str(next(llm.model.parameters()).device)
    # LLM's class travels by name: engine/ never imports entrypoints/ (its layer is above).
    return functools.partial(type(llm), copy.deepcopy(llm.model), tokenizer=llm.tokenizer,
                             device=device, num_threads=llm.num_threads, **knobs)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawned process without the caller's script: spawn re-runs ``__main__`` in the
    child, so a script without ``if __name__ == "__main__":`` would build a second engine there
    (and start a third). The core needs nothing from the script."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _stop_process(process: Any) -> None:
    """End ``process`` however it is: terminate, then kill; reap it so no zombie is left."""
    if process is None or process.pid is None:
        return
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: ``"exit code 1"``, ``"killed by signal 9"``.

    upstream: none (upstream's client names no exit code: it says the core died)
    """
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"

