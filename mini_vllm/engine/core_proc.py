"""The engine core's busy loop, and the process it runs in.

:class:`EngineCoreProc` owns one engine core (an :class:`~mini_vllm.entrypoints.llm.LLM`'s
scheduler and runner). Its busy loop applies every add and abort waiting in ``input_queue``,
steps, and hands the step's :class:`~mini_vllm.engine.messages.EngineCoreOutputs` to ``post``;
it waits on the input queue only while it has nothing to run. Where the loop runs is the
client's choice (:mod:`mini_vllm.engine.core_client`):

* ``InprocClient``: on a thread of the caller's process, ``post`` handing outputs to its event
  loop. The server's Python and the engine then take turns on one GIL;
* ``AsyncMPClient``: in a process of its own, started with :func:`run_engine_core`. An input thread
  receives messages from a ZeroMQ socket, decodes them and fills ``input_queue``; ``post``
  encodes and sends on the output socket (a heartbeat thread fills the silences). The client's
  process keeps its GIL to itself.

Invariant: only the busy loop's thread touches the engine core. Faults: a step that raises fails
the requests in the core (the client hears which, and why) and the loop serves on with a clean
engine; anything else that ends the loop, and a failed start, is reported as ``fatal`` before
the process exits.

upstream: vllm/v1/engine/core.py:453 @ v0.11.0
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import zmq

from mini_vllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from mini_vllm.engine.output_processor import _Tracked
from mini_vllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from mini_vllm.metrics.loggers import EngineLoad
from mini_vllm.request import Request

__all__ = ["SHUTDOWN", "EngineCoreProc", "EngineCoreProcBase", "run_engine_core"]

SHUTDOWN = object()  # put on the input queue: the busy loop returns
HEARTBEAT_S = 0.25  # the core's longest silence: then it says "alive"


class EngineCoreProcBase:
    """The state around one engine core that the busy loop works on (the given half of lab
    04-01): the input queue, applying one add or abort, the recovery from a failed step, the
    load snapshot.

    ``input_queue`` takes ``(EngineCoreRequestType.ADD, [EngineCoreRequest])``,
    ``(EngineCoreRequestType.ABORT, EngineCoreAbort)``, ``SHUTDOWN``, or an ``Exception`` (the
    input thread could not read a message). ``step_started`` is the ``time.monotonic()`` at
    which the running step began (``None`` between steps): the heartbeat reads it from another
    thread. ``_in_core``: the requests the engine core holds, by id.

    upstream: vllm/v1/engine/core.py:453 @ v0.11.0
    """

    def __init__(self, llm: Any, post: Callable[[EngineCoreOutputs], None]) -> None:
        self.llm = llm
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.step_started: float | None = None
        self._post = post
        self._in_core: dict[str, Request] = {}  # the requests the core holds
        self._seen_prefix: tuple[Any, int, int] = (None, 0, 0)
        self._load = EngineLoad()

    @property
    def engine_core(self) -> Any:
        """The engine core (a failed step may rebuild it, so always read it here)."""
        return self.llm.engine

    def _add(self, requests: list[EngineCoreRequest]) -> None:
        """Put new requests in the engine core; one the scheduler refuses is posted as failed
        (``error_kind="refused"``) and the rest go in."""
        core = self.engine_core
        for new in requests:
            request = core.make_request(new.request_id, new.prompt_token_ids,
                                        new.sampling_params)
            request.arrival_time = new.arrival_time
            try:
                core.add_request(request)
            except ValueError as exc:  # checked by the client first; a refusal fails it
                self._post(EngineCoreOutputs(timestamp=time.monotonic(), load=self._snapshot(),
                                             failed=[new.request_id], error=str(exc),
                                             error_kind="refused"))
                continue
            self._in_core[new.request_id] = request

    def _abort(self, abort: EngineCoreAbort) -> None:
        """Finish the named requests with the abort's status; their blocks go back."""
        self.engine_core.scheduler.finish_requests(abort.request_ids, abort.status)
        for rid in abort.request_ids:
            self._in_core.pop(rid, None)

    def _progress_state(self) -> tuple:
        """What a step that makes progress changes: each request's place, and the free blocks."""
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
        self.engine_core.drain_batch_queue()  # nothing may run on the engine while it is mended
        failed = list(self._in_core)
        tracked = [_Tracked(0, 0, r) for r in self._in_core.values()]
        self._in_core.clear()
        self.llm._abort_after_failure(tracked)
        return failed

    def _snapshot(self) -> EngineLoad:
        """The engine's load now, for the client's stat logger."""
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


class EngineCoreProc(EngineCoreProcBase):
    """The busy loop around one engine core: adds and aborts in, step outputs out.

    upstream: vllm/v1/engine/core.py:453 @ v0.11.0
    """

    def run_busy_loop(self) -> None:
        """Apply adds and aborts, step, post the outputs; wait only while there is no work.
        The step is ``step_fn()``: under async scheduling it returns ``None`` when it only
        planned a step, and there is nothing to post.

        upstream: vllm/v1/engine/core.py:720 @ v0.11.0
        """
        torch.set_num_threads(self.llm.num_threads)  # a per-thread setting for CPU ops
        stalled_at: tuple | None = None
        while True:
            if not self._process_input_queue(block=not self.engine_core.has_unfinished_requests()):
                return  # shut down
            core = self.engine_core
            if not core.has_unfinished_requests():
                self._post(EngineCoreOutputs(timestamp=time.monotonic(), load=self._snapshot()))
                continue
            self.step_started = time.monotonic()
            try:
                outputs = core.step_fn()
                core.post_step()
                if outputs is None:
                    continue  # async scheduling: a step planned, the one before still runs
                if not outputs:
                    # Nothing gained a token: fine during chunked prefill, a livelock when the
                    # step left everything as it was (every later step would do the same).
                    state = self._progress_state()
                    if state == stalled_at:
                        raise RuntimeError(core.stall_message())
                    stalled_at = state
                else:
                    stalled_at = None
            except Exception as exc:  # the step failed: fail its requests, serve on
                failed = self._recover()
                self._post(EngineCoreOutputs(
                    timestamp=time.monotonic(), load=self._snapshot(), failed=failed,
                    error=f"the engine step failed: {type(exc).__name__}: {exc}",
                    error_kind="step"))
                continue
            finally:
                self.step_started = None
            now = time.monotonic()
            for out in outputs:
                if out.finished:
                    self._in_core.pop(out.request_id, None)
            self._post(EngineCoreOutputs(outputs=outputs, timestamp=now, load=self._snapshot()))

    def _process_input_queue(self, block: bool) -> bool:
        """Apply every add and abort waiting (waiting for one first if ``block``); False once
        shutdown was asked for.

        upstream: vllm/v1/engine/core.py:730 @ v0.11.0
        """
        try:
            item = self.input_queue.get(block=block)
        except queue.Empty:
            return True
        while True:
            if item is SHUTDOWN:
                return False
            if isinstance(item, Exception):
                raise RuntimeError(f"the engine core could not read its input: {item}")
            kind, payload = item
            if kind is EngineCoreRequestType.ADD:
                self._add(payload)
            else:
                self._abort(payload)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return True


# ---------------------------------------------------------------------- the engine-core process


def run_engine_core(make_llm: Callable[[], Any], input_address: str, output_address: str,
                    parent_alive: Any, socket_dir: str | None = None,
                    setup: Callable[[], None] | None = None) -> None:
    """The engine-core process: build the engine, then serve the client until told to stop.

    ``make_llm`` builds the :class:`~mini_vllm.entrypoints.llm.LLM` whose engine core the loop
    runs (``setup``, when given, runs first). ``input_address``/``output_address``: the client's
    bound ZeroMQ sockets. ``parent_alive``: the read end of a pipe only the client holds open;
    EOF on it means the client's process is gone, and this one removes ``socket_dir`` (the
    client could not) and exits. Ctrl-C reaches the whole process group: this process ignores
    it and lets the client shut it down; SIGTERM ends it at once.

    upstream: vllm/v1/engine/core.py:661 @ v0.11.0
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_alive, socket_dir), daemon=True,
                     name="mini_vllm-parent-watch").start()
    ctx = zmq.Context()
    out_socket = ctx.socket(zmq.PUSH)
    out_socket.setsockopt(zmq.LINGER, 2000)
    out_socket.connect(output_address)
    sender = None
    stop = threading.Event()
    try:
        if setup is not None:
            setup()  # first: the pieces it puts in place (the encoder too) are the ones used
        sender = _Sender(out_socket)
        proc = EngineCoreProc(make_llm(), sender.send)
    except BaseException as exc:  # a failed start: the client says why instead of waiting
        traceback.print_exc()  # where: the server's terminal; the client gets the one line
        (sender or _Sender(out_socket)).send(EngineCoreOutputs(
            timestamp=time.monotonic(), fatal=True,
            error=f"the engine core failed to start: {type(exc).__name__}: {exc}"))
        out_socket.close()
        ctx.term()
        return
    in_thread = threading.Thread(
        target=_process_input_socket, args=(ctx, input_address, proc.input_queue, stop),
        daemon=True, name="mini_vllm-core-input")
    in_thread.start()
    beat_thread = threading.Thread(target=_heartbeat, args=(sender, proc, stop), daemon=True,
                                   name="mini_vllm-core-heartbeat")
    beat_thread.start()
    sender.send(EngineCoreOutputs(timestamp=time.monotonic(), load=proc._snapshot()))
    try:
        proc.run_busy_loop()
    except BaseException as exc:  # the loop itself died: say so before going
        traceback.print_exc()
        sender.send(EngineCoreOutputs(
            timestamp=time.monotonic(), fatal=True,
            error=f"the engine core's loop died: {type(exc).__name__}: {exc}"))
    try:
        proc.engine_core.shutdown()  # what the engine started: workers, a KV store
    except Exception:  # noqa: BLE001 - the process ends either way; say why, then go
        traceback.print_exc()
    stop.set()
    in_thread.join(timeout=5)
    beat_thread.join(timeout=5)
    out_socket.close()
    ctx.term()  # after every socket closed: frames still queued go out first (LINGER)


class _Sender:
    """The core's output socket, shared by the busy loop and the heartbeat.

    The busy loop sends each step's outputs itself, right after the step. Upstream hands them to
    an output thread so that encoding overlaps the GPU's work; on a CPU the step holds the GIL,
    and that hand-off cost each step a GIL switch, more than the encoding (measured: one stream
    of the shipped model through ``AsyncLLM``, 0.48-0.50 ms a token with the thread, 0.40 ms
    without; the engine alone takes 0.35 ms).

    upstream: vllm/v1/engine/core.py:882 @ v0.11.0
    """

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.lock = threading.Lock()
        self.encoder = MsgpackEncoder()
        self.last_sent = time.monotonic()

    def send(self, item: EngineCoreOutputs) -> None:
        with self.lock:
            self.socket.send_multipart(self.encoder.encode(item), copy=False)
            self.last_sent = time.monotonic()


def _exit_with_parent(parent_alive: Any, socket_dir: str | None) -> None:
    """Block on the client's pipe; EOF means the client's process died: clean up and exit."""
    try:
        parent_alive.recv()
    except (EOFError, OSError):
        pass
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)
    os._exit(0)


def _process_input_socket(ctx: zmq.Context, address: str, input_queue: queue.SimpleQueue,
                          stop: threading.Event) -> None:
    """Receive, decode and queue the client's messages for the busy loop (until ``stop``).

    upstream: vllm/v1/engine/core.py:817 @ v0.11.0
    """
    add_decoder = MsgpackDecoder(list[EngineCoreRequest])
    abort_decoder = MsgpackDecoder(EngineCoreAbort)
    with ctx.socket(zmq.PULL) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.connect(address)
        while not stop.is_set():
            if not socket.poll(100):
                continue
            try:
                kind_frame, *frames = socket.recv_multipart()
                kind = EngineCoreRequestType(kind_frame)
                if kind is EngineCoreRequestType.SHUTDOWN:
                    input_queue.put(SHUTDOWN)
                    return
                decoder = add_decoder if kind is EngineCoreRequestType.ADD else abort_decoder
                input_queue.put((kind, decoder.decode(frames)))
            except Exception as exc:  # a core deaf to its client would hang every stream
                input_queue.put(exc)  # the busy loop raises it: the client hears "fatal"
                return


def _heartbeat(sender: _Sender, proc: EngineCoreProc, stop: threading.Event) -> None:
    """Say "alive" (with the running step's age) whenever nothing was sent for
    ``HEARTBEAT_S``: the client takes silence for a stuck core, a long step for a hang.

    upstream: none (0.11's client watches only the process; 0.33's core adds a watchdog that
    dumps stacks, vllm/utils/watch_dog.py)
    """
    while not stop.wait(HEARTBEAT_S / 2):
        if time.monotonic() - sender.last_sent < HEARTBEAT_S:
            continue
        started = proc.step_started
        sender.send(EngineCoreOutputs(timestamp=time.monotonic(), step_age=(
            0.0 if started is None else time.monotonic() - started)))
