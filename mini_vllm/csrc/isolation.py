"""Run GPU kernel calls in a child process, so that one bad kernel fails one call.

An illegal address (or any other "sticky" CUDA error) leaves a process's CUDA context unusable:
every later CUDA call in that process fails with the same error. A test run that calls a
student's kernel in-process then reports the first mistake once and every later test as that
same error. ``IsolatedRunner`` keeps the kernel calls in a worker process with its own context:

* a call that returns, or raises an ordinary exception (a ``ValueError`` from an input check),
  comes back as it would in-process, and the worker stays for the next call;
* a call that ends in a CUDA error raises ``KernelCrashed`` with the error and a note that the
  worker's context was discarded; the next call starts a fresh worker;
* a worker that dies (a segmentation fault, ``os._exit``) raises ``KernelCrashed`` too.

The worker runs the student's code, so what it sends back is read as data, never unpickled:
``torch.load(weights_only=True)`` takes tensors, numbers, strings and their lists, tuples and
dicts, and refuses anything else (an object whose unpickling would run code, say) before any of
it runs. An error comes back as its class's name and its message; it is raised here as that
class when the class is a builtin one or mini_vllm's, else as a ``RuntimeError`` naming it.

Calls name their function as ``(where, name)``: ``where`` is a module name (imported in the
worker) or a picklable callable that returns the module (for a lab's starter, which belongs to
no package, the course passes its own loader, e.g. ``functools.partial(load_module, folder,
impl, lab_id)``; this package never imports the course). Tensors travel as CPU tensors (the
worker moves them to the GPU and back, see ``run_on_gpu``).

upstream: none (vLLM's tests run kernels in-process; this isolation is the course's)
"""

from __future__ import annotations

import builtins
import importlib
import io
import multiprocessing
import os
import pickle
import re
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["IsolatedRunner", "KernelCrashed", "run_on_gpu"]

# Substrings of the errors that leave a CUDA context unusable.
STICKY_CUDA_ERRORS = ("CUDA error", "illegal memory access", "illegal address",
                      "device-side assert", "unspecified launch failure", "AcceleratorError")


class KernelCrashed(RuntimeError):
    """A kernel call broke its worker process (a CUDA error or a crash); later calls get a fresh
    worker."""


# A module's name, or a picklable callable that loads the module in the worker.
Where = str | Callable[[], ModuleType]


def _resolve(where: Where, name: str):
    module = importlib.import_module(where) if isinstance(where, str) else where()
    return getattr(module, name)


def _send(conn, reply: tuple) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(reply, buffer)
    conn.send_bytes(buffer.getvalue())


def _receive(conn) -> tuple:
    """A reply of the worker, as data only (module doc); ``pickle.UnpicklingError`` otherwise."""
    import torch

    try:
        reply = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=True)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise
    except Exception as exc:  # a refused type, or bytes that are no torch.save at all
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        why = f"it names {found.group(1)}" if found else type(exc).__name__
        raise pickle.UnpicklingError(why) from None
    if not (isinstance(reply, tuple) and reply and reply[0] in ("ok", "error")):
        raise pickle.UnpicklingError(f"not a reply: {type(reply).__name__}")
    return reply


def _rebuilt(module: str, name: str, message: str) -> Exception:
    """The worker's error as an exception of this process: its own class when that is a builtin
    one or mini_vllm's (looked up here, never received), else a RuntimeError naming it."""
    cls = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif module == "mini_vllm" or module.startswith("mini_vllm."):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a class whose constructor takes other arguments
            pass
    return RuntimeError(f"{name}: {message}")


def _worker(conn) -> None:
    while True:
        try:
            request = conn.recv()  # from the test's process: trusted
        except EOFError:
            return
        if request is None:
            return
        where, name, args, kwargs = request
        try:
            result = _resolve(where, name)(*args, **kwargs)
            _send(conn, ("ok", result))
        except BaseException as exc:  # reported to the parent, which decides
            text = f"{type(exc).__name__}: {exc}"
            sticky = any(s in text for s in STICKY_CUDA_ERRORS)
            _send(conn, ("error", type(exc).__module__, type(exc).__qualname__, str(exc), text,
                         traceback.format_exc(), sticky))
            if sticky:
                return  # this context is broken: the parent starts a new worker


class IsolatedRunner:
    """A worker process for kernel calls (started on first use, restarted after a crash)."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _discard(self) -> None:
        if self._proc is not None:
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._proc = self._conn = None
        self.restarts += 1

    def call(self, where: Where, name: str, *args: Any, **kwargs: Any) -> Any:
        """``name(*args, **kwargs)`` of module ``where``, run in the worker."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((where, name, args, kwargs))
            reply = _receive(self._conn)
        except pickle.UnpicklingError as exc:
            raise RuntimeError(
                f"{name}: the worker's reply is not plain data (tensors, numbers, strings and "
                f"their lists, tuples and dicts) and was refused unread ({exc}); return only such "
                "values from a kernel call") from None
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(timeout=5)  # reap it, so that its exit code is known
            code = self._proc.exitcode
            self._discard()
            raise KernelCrashed(
                f"{name}: the worker process running the kernel died (exit code {code}): a crash "
                "in the kernel or its launcher. This call fails; the next one gets a fresh worker."
            ) from None
        if reply[0] == "ok":
            return reply[1]
        _, module, cls_name, message, text, tb, sticky = reply
        if sticky:
            self._discard()
            raise KernelCrashed(
                f"{name}: {text}\nThe kernel left its CUDA context unusable (an illegal address, "
                "an assert...): this test fails, and the next kernel call gets a fresh process, so "
                "other tests are not affected. Run this test alone with CUDA_LAUNCH_BLOCKING=1, or "
                "under compute-sanitizer, to find the faulting access.\n--- worker traceback ---\n"
                + tb
            )
        error = _rebuilt(str(module), str(cls_name), str(message))
        error.add_note(f"--- worker traceback ---\n{tb}")
        raise error

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._discard()


def run_on_gpu(where: Where, name: str, outputs: list[int], *args: Any, **kwargs: Any):
    """In the worker: move tensor arguments to the GPU, call ``name``, synchronise, and return
    the arguments at positions ``outputs`` (written by the call) as CPU tensors."""
    import torch

    moved = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    _resolve(where, name)(*moved, **kwargs)
    torch.cuda.synchronize()
    return [moved[i].cpu() for i in outputs]


def _probe(kind: str, path: str = "") -> Any:
    """What the isolation's own tests run in a worker: a value, an error, a crash."""
    if kind == "pid":
        return os.getpid()
    if kind == "value-error":
        raise ValueError("bad input: nothing was run")
    if kind == "cuda-error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if kind == "exit":
        os._exit(9)
    if kind == "segfault":  # what a crash in native code looks like: the process dies on a signal
        import ctypes

        ctypes.string_at(0)
    if kind == "data":  # what a kernel call returns: tensors and plain values
        import torch

        return {"out": [torch.arange(3.0)], "n": 1, "name": "v1", "pair": (0.5, None)}
    if kind == "forged":  # a reply whose unpickling would write a file (here: `path`)
        return _Forged(path)
    if kind == "foreign-error":  # an error of a class of the student's own
        raise type("StudentsError", (Exception,), {"__module__": "lab_02_06_starter"})("mine")
    raise AssertionError(kind)


class _Forged:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
