"""Lab 04-01 starter: the engine core in a process of its own.

Lab 03-05's server and its engine take turns on one GIL: while a step runs, the server's Python
waits, and the other way round. vLLM puts the engine core in a process of its own and talks to
it in messages. Four pieces make that work, and they are yours:

* tasks 1 and 2, ``MsgpackEncoder._enc_hook`` and ``MsgpackDecoder._ext_hook``: a message is
  msgpack (data, never pickle), and a tensor in it travels *out of band*, as a frame of its own
  that is never copied into the body nor parsed on arrival;
* tasks 3 and 4, ``EngineCoreProc._process_input_queue`` and ``EngineCoreProc.run_busy_loop``:
  the core's busy loop, which applies what the client sent, steps, and posts each step's
  outputs; it waits only while it has nothing to run;
* task 5, ``core_failure``: the client's verdict on a core that died, hung or fell silent, so
  that every open stream gets an error instead of waiting forever.

Given (read them in ``mini_vllm``): ``MsgpackEncoderBase`` and ``MsgpackDecoderBase`` (``encode``
and ``decode`` around your hooks) in ``engine/serial_utils.py``; ``EngineCoreProcBase`` (the
input queue, ``_add``, ``_abort``, ``_recover``, ``_snapshot``, ``_progress_state``) in
``engine/core_proc.py``, and there too the process around the loop (``run_engine_core``: the
input thread, the heartbeat, the output socket); the clients in ``engine/core_client.py``. Each
file's class right after the base is the reference answer: do not read it before you have
tried.

Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-01 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), ``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-04-vllm-today/labs/lab-01-engine-core -q
"""

from __future__ import annotations

import queue  # noqa: F401  (task 3)
import time  # noqa: F401  (task 4)
from typing import Any

import msgspec  # noqa: F401  (task 1)
import torch  # noqa: F401  (tasks 1, 2 and 4)

from mini_vllm.engine.core_client import (
    HEARTBEAT_TIMEOUT_S,
    describe_exit,  # noqa: F401  (task 5)
)
from mini_vllm.engine.core_proc import SHUTDOWN, EngineCoreProcBase
from mini_vllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from mini_vllm.engine.serial_utils import TENSOR_EXT, MsgpackDecoderBase, MsgpackEncoderBase

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "SHUTDOWN",
    "TENSOR_EXT",
    "EngineCoreAbort",
    "EngineCoreOutputs",
    "EngineCoreProc",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "core_failure",
]

# ---------------------------------------------------------------------------- tasks 1 and 2


class MsgpackEncoder(MsgpackEncoderBase):
    """Encodes a message into frames: ``encode(obj)`` returns ``[body, *buffers]``. Given by
    the base: ``encode`` sets ``self._buffers = []``, has msgspec encode the body (msgspec calls
    your ``_enc_hook`` for every object it cannot encode itself), and returns the body followed
    by ``self._buffers``."""

    def _enc_hook(self, obj: Any) -> Any:
        """Task 1: what goes in the body for ``obj``, an object msgspec cannot encode.

        A ``torch.Tensor`` (while ``encode`` runs, ``self._buffers`` is a list): append its
        bytes to ``self._buffers`` as the next frame, and return the reference the body holds
        in its place, ``msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode(meta))`` with
        ``meta = (dtype, shape, index)``: the dtype's name without ``torch.`` (``"float32"``,
        ``"bfloat16"``), the list of its sizes, and the frame's index in ``self._buffers``.

        The frame is a ``memoryview`` of the tensor's bytes as ``uint8``, C-contiguous, on the
        CPU. A tensor that is already contiguous on the CPU gives a view of its own memory (no
        copy: ZeroMQ sends it as it is); any other (a transposed view, a strided slice, a tensor
        on a GPU) is made contiguous on the CPU first, one copy. A tensor that requires grad is
        sent as its data. Every dtype (``bool`` included) and every shape (0-d, empty) works.

        Anything else: raise ``TypeError`` naming its type (what the engine core sends or
        receives is Structs, builtins and tensors).
        """
        raise NotImplementedError(
            "lab 04-01, task 1: implement MsgpackEncoder._enc_hook "
            "(hint: python -m course hint 04-01 1)"
        )


class MsgpackDecoder(MsgpackDecoderBase):
    """Decodes frames into an object of the type given to ``__init__`` (checked as it is
    decoded). Given by the base: ``decode(frames)`` sets ``self._buffers = frames[1:]`` and
    has msgspec decode ``frames[0]``; msgspec calls your ``_ext_hook`` for each extension in
    the body."""

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        """Task 2: the object an extension of the body stands for.

        ``code == TENSOR_EXT``: ``data`` is the msgpack of ``(dtype, shape, index)`` (task 1's
        ``meta``); return a tensor of that dtype (``getattr(torch, dtype)``) and shape over the
        bytes of frame ``self._buffers[index]``. Wrap the frame, do not copy it
        (``torch.frombuffer``): a writable frame (a ``bytearray``, a writable ``memoryview``, a
        ZeroMQ frame) becomes the tensor's memory. A read-only frame (``bytes``, a read-only
        ``memoryview``) is copied once into a ``bytearray`` first: a tensor over read-only
        memory would write through it (PyTorch warns). A frame of no bytes (a tensor with no
        elements; ``torch.frombuffer`` refuses an empty buffer) gives ``torch.empty`` of the
        shape and dtype.

        Any other ``code``: raise ``ValueError`` naming it.
        """
        raise NotImplementedError(
            "lab 04-01, task 2: implement MsgpackDecoder._ext_hook "
            "(hint: python -m course hint 04-01 2)"
        )


# ---------------------------------------------------------------------------- tasks 3 and 4


class EngineCoreProc(EngineCoreProcBase):
    """The busy loop around one engine core: adds and aborts in, step outputs out.

    Given by the base (``mini_vllm/engine/core_proc.py``): ``self.llm`` (the ``LLM`` whose core
    this is), ``self.engine_core`` (its engine core; a failed step may rebuild it, so read it
    again each time), ``self.input_queue`` (a ``queue.SimpleQueue`` that the input thread
    fills), ``self._post(outputs)`` (sends one ``EngineCoreOutputs`` to the client),
    ``self._add(requests)`` and ``self._abort(abort)`` (apply one add or abort to the engine
    core), ``self._in_core`` (the requests the core holds, by id), ``self._recover()`` (after a
    failed step: aborts everything the core holds, leaves a clean engine, returns the ids that
    failed), ``self._snapshot()`` (the engine's load now, for the client's metrics),
    ``self._progress_state()`` (what any step that makes progress changes) and
    ``self.step_started`` (when the running step began).
    """

    def _process_input_queue(self, block: bool) -> bool:
        """Task 3: apply every add and abort waiting in ``self.input_queue``, in order; return
        ``False`` once shutdown is asked for, else ``True``.

        With ``block``, wait for the first item (the loop has nothing else to do until one
        comes); without, return ``True`` at once when the queue is empty. Then take every item
        already waiting, never waiting for another (``get_nowait``, until ``queue.Empty``):

        * ``(EngineCoreRequestType.ADD, requests)``: ``self._add(requests)``;
        * ``(EngineCoreRequestType.ABORT, abort)``: ``self._abort(abort)``;
        * ``SHUTDOWN``: return ``False`` there (the items behind it stay in the queue);
        * an ``Exception`` (the input thread could not read a message): raise
          ``RuntimeError`` whose message includes the exception's (a core deaf to its client
          must not go on as if all were well).
        """
        raise NotImplementedError(
            "lab 04-01, task 3: implement EngineCoreProc._process_input_queue "
            "(hint: python -m course hint 04-01 3)"
        )

    def run_busy_loop(self) -> None:
        """Task 4: serve until ``_process_input_queue`` returns ``False``, then return.

        First ``torch.set_num_threads(self.llm.num_threads)`` (a per-thread setting: the loop
        may run on a thread of its own). Then, each turn:

        1. ``self._process_input_queue(block=...)``, blocking only when the engine core has no
           unfinished request (``has_unfinished_requests()``): an idle loop waits for input, a
           busy one never does. ``False``: return.
        2. Still no unfinished request (none came, or the input aborted the last ones): post
           ``EngineCoreOutputs(timestamp=time.monotonic(), load=self._snapshot())``, so that
           the client sees the blocks go back, and go round.
        3. Step: ``self.step_started = time.monotonic()``, then ``outputs = core.step_fn()``
           and ``core.post_step()``; afterwards ``self.step_started`` is ``None`` again, whether
           the step returned or raised (the heartbeat reports its age: a stale one reads as a
           hang). ``step_fn`` is ``core.step`` or, under async scheduling (lab 04-02),
           ``core.step_with_batch_queue``, which returns ``None`` when it only started a step:
           then there is nothing to post or check; go round.
        4. A step may return no output (a chunk of a long prompt gains no token); that is fine
           once. But a step with no output that leaves ``self._progress_state()`` where the last
           one with no output left it is a livelock (every later step would do the same): treat
           it as a failed step raising ``RuntimeError(core.stall_message())``. A step with
           outputs clears that memory.
        5. A step that raised an ``Exception`` (4's included): ``failed = self._recover()``, then
           post ``EngineCoreOutputs(timestamp=..., load=self._snapshot(), failed=failed,
           error=f"the engine step failed: {type(exc).__name__}: {exc}", error_kind="step")``
           and go on serving: one bad step must not end the loop.
        6. Otherwise drop each finished output's request from ``self._in_core`` (the core no
           longer holds it: a later failure must not name it) and post
           ``EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(),
           load=self._snapshot())``.

        An exception outside the step (from ``_process_input_queue``) ends the loop: let it
        propagate; the process around the loop reports it to the client.
        """
        raise NotImplementedError(
            "lab 04-01, task 4: implement EngineCoreProc.run_busy_loop "
            "(hint: python -m course hint 04-01 4)"
        )


# ---------------------------------------------------------------------------- task 5


def core_failure(out: EngineCoreOutputs | None, silent_s: float, exitcode: int | None,
                 step_timeout_s: float | None) -> str | None:
    """Task 5: why the engine core is to be taken for dead, or ``None`` while it serves.

    The client's output thread calls this after each poll of the core's socket (a tenth of a
    second): ``out`` is what the core just sent (``None``: nothing came within the poll),
    ``silent_s`` the seconds since it last sent anything, ``exitcode`` its process's exit code
    once it has exited (negative: killed by that signal), ``None`` while it runs. The core
    sends every step's outputs, and when it has nothing to say, a heartbeat (``load is None``)
    at least every 0.25 s whose ``step_age`` says how long the running step has taken (0
    between steps).

    When ``out`` is not ``None``:

    * ``out.fatal`` (the core failed to start, or its loop died): return ``out.error`` (its own
      words; ``"the engine core failed"`` when it gave none);
    * a ``step_age`` above ``step_timeout_s`` (``None``: no limit): return a sentence that
      gives the step's age in whole seconds, ``f"one engine step has run for {age:.0f} s"``;
    * else ``None``: a core that talks is alive.

    When ``out`` is ``None``:

    * the process exited: ``f"the engine core process died ({describe_exit(exitcode)})"``;
    * else silence longer than ``HEARTBEAT_TIMEOUT_S`` (a stopped or frozen process sends no
      heartbeat): a sentence that gives that limit in whole seconds,
      ``f"the engine core stopped answering for {HEARTBEAT_TIMEOUT_S:.0f} s"``;
    * else ``None``.

    Pure: it decides, the caller kills the process and fails the streams.
    """
    raise NotImplementedError(
        "lab 04-01, task 5: implement core_failure (hint: python -m course hint 04-01 5)"
    )

