"""Tensor parallelism for the engine: one process per rank, every rank running every step.

Rank 0's model runner lives in the engine's own process (the *driver*); ranks 1 to ``tp - 1``
each run in a worker process of their own, started here. Every rank holds its shard of the model
and of the KV cache (:func:`mini_vllm.model_executor.model_loader.tp_loader.shard_model`) and
the same request states. A step: the driver sends the scheduler's output to every worker (with
its random generator's state, so that sampling draws the same numbers on every rank), then all
ranks run the same step and meet in its collectives; each samples the same tokens from the same
gathered logits, and only the driver's output goes back to the engine.

Lifetime: workers start with the engine and stop with :meth:`TensorParallelRunner.shutdown`
(the engine's ``shutdown``, or when the executor is collected). A worker whose driver is gone
(a crash, a kill) sees it die, removes the rendezvous folder the driver could not, and exits;
a rank that waits in a collective for a rank that died gives up after ``timeout_s``. Nothing is
left behind: the rendezvous file lives in a temporary folder removed at shutdown.

Not here (upstream has them): workers that never share the engine's process (upstream's
driver is a worker process too, fed through a shared-memory queue), pipeline parallelism, and
overlapping a step's communication with its computation.

upstream: vllm/v1/executor/multiproc_executor.py:125 @ v0.33.0
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import shutil
import tempfile
import weakref
from multiprocessing.connection import wait
from typing import Any

import torch

from mini_vllm.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
)
from mini_vllm.model_executor.model_loader.tp_loader import check_tp_size, shard_model

START_TIMEOUT_S = 300.0


def _worker_main(rank: int, tp_size: int, init_method: str, model, runner_cls: type,
                 runner_kwargs: dict, conn, timeout_s: float) -> None:
    """A worker: join the group, keep this rank's shard, then run every step it is sent until
    told to stop (``None``) or its pipe closes."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    try:
        group = init_tensor_parallel(rank, tp_size, init_method, timeout_s=timeout_s)
        runner = runner_cls(shard_model(model, group), **runner_kwargs)
        del model
        conn.send(("ready", None))
        # The driver's death, seen directly: a forked worker also holds the driver's end of its
        # own pipe, so that pipe never reports end-of-file.
        driver = mp.parent_process()
        while True:
            if conn not in wait([conn, driver.sentinel]):
                break  # the driver is gone
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the driver is gone
            if message is None:
                return
            rng_state, scheduler_output = message
            torch.set_rng_state(rng_state)
            runner.execute_model(scheduler_output)
        # A driver that died could not remove the rendezvous folder: the last one out does.
        shutil.rmtree(os.path.dirname(init_method.removeprefix("file://")), ignore_errors=True)
    except BaseException as exc:  # noqa: BLE001 (reported to the driver, then the worker ends)
        try:
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
    finally:
        destroy_tensor_parallel()
        conn.close()


def _start_method() -> str:
    """Fork where it is safe (Linux, CUDA not started: the worker inherits the model without a
    copy, and a script needs no ``if __name__ == "__main__"`` guard), else spawn; upstream's
    rule (``VLLM_WORKER_MULTIPROC_METHOD``)."""
    forkable = "fork" in mp.get_all_start_methods() and os.uname().sysname == "Linux"
    return "fork" if forkable and not torch.cuda.is_initialized() else "spawn"


class TensorParallelRunner:
    """The engine's model runner at ``tp_size > 1``: rank 0's runner (every attribute the engine
    reads is the driver's), with :meth:`execute_model` run on every rank.

    upstream: vllm/v1/executor/multiproc_executor.py:125 @ v0.33.0
    """

    def __init__(self, model, tp_size: int, runner_cls: type, *, timeout_s: float = 120.0,
                 **runner_kwargs: Any) -> None:
        check_tp_size(model.config, tp_size)
        if get_tp_group().world_size > 1:
            raise RuntimeError("a tensor-parallel engine already runs in this process; shut it "
                               "down (llm.engine.shutdown()) before starting another")
        if mp.current_process().daemon:
            raise RuntimeError("tensor parallelism starts worker processes, which a daemon "
                               "process cannot (the server's engine-core process is one); run "
                               "the engine in the caller's process with tensor_parallel_size > 1")
        self.tp_size = tp_size
        self._folder = tempfile.mkdtemp(prefix="mini_vllm-tp-")
        init_method = f"file://{self._folder}/rendezvous"
        ctx = mp.get_context(_start_method())
        self._conns, self._procs = [], []
        try:
            for rank in range(1, tp_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, name=f"mini_vllm-tp-rank{rank}",
                    args=(rank, tp_size, init_method, model, runner_cls, runner_kwargs, child,
                          timeout_s))
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            group = init_tensor_parallel(0, tp_size, init_method, timeout_s=timeout_s)
            # A copy: the cut is in place, and the caller's model must stay whole (LLM builds
            # its engine again from it; the workers got theirs when they were forked).
            self.runner = runner_cls(shard_model(copy.deepcopy(model), group), **runner_kwargs)
            for rank, conn in enumerate(self._conns, 1):
                self._expect_ready(rank, conn)
        except BaseException:
            self.shutdown()
            raise
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs, self._folder)

    def _expect_ready(self, rank: int, conn) -> None:
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"tensor parallelism: rank {rank} did not start within "
                               f"{START_TIMEOUT_S:.0f} s")
        kind, detail = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"tensor parallelism: a worker failed to start: {detail}")

    def execute_model(self, scheduler_output):
        """Send the step to every worker, run rank 0's share, return rank 0's output.

        upstream: vllm/v1/executor/multiproc_executor.py:406 @ v0.33.0
        """
        message = (torch.get_rng_state(), scheduler_output)
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), 1):
            try:
                if conn.poll():  # a worker speaks only when it fails (or its pipe closed)
                    raise RuntimeError(f"tensor parallelism: {conn.recv()[1]}; shut the "
                                       "engine down and start a new one")
                conn.send(message)
            except (EOFError, OSError) as exc:
                raise RuntimeError(
                    f"tensor parallelism: rank {rank} is gone (exit code {proc.exitcode}); shut "
                    "the engine down and start a new one") from exc
        return self.runner.execute_model(scheduler_output)

    def __getattr__(self, name: str):
        if name == "runner":  # not built yet (a failed start)
            raise AttributeError(name)
        return getattr(self.runner, name)

    def shutdown(self) -> None:
        """Stop every worker and leave the group (idempotent).

        upstream: vllm/v1/executor/multiproc_executor.py:610 @ v0.33.0
        """
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _stop(self._conns, self._procs, self._folder)


def _stop(conns: list, procs: list, folder: str) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for conn in conns:
        conn.close()
    destroy_tensor_parallel()
    shutil.rmtree(folder, ignore_errors=True)
