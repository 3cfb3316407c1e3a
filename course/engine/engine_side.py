"""The student's side of the engine exam: engines built from the composed pieces, run on request.

The exam's verdicts are decided in the worker process (:mod:`course.engine.worker`), which never
imports a student's code. For each composition it forks an *engine process*
(:class:`EngineProcess`) that holds no descriptor of the worker's but one end of a socket,
composes the student's pieces into mini_vllm there, and answers requests: build an engine with
this configuration, run these prompts, run a beam search, serve an engine over HTTP. Every answer
is data (JSON, framed as :mod:`course.labs.student_process` frames it): token ids, finish reasons,
the engine's counters, the steps :class:`StepRecorder` saw. The exam compares them with its
oracle and with the reference engine; nothing the engine process sends is run, imported or
unpickled by the worker, and nothing it writes anywhere is a result.

:class:`Engines` is what answers, in the engine process. The reference engine answers from an
engine process too (nothing composed), so that the worker itself never runs an engine: an engine
may leave threads behind (torch.distributed's gloo), and a process forked from one that has them
may hang.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import socket
import sys
import time
import traceback

import torch

from course.engine.exam import (
    GRACE_S,
    MODELS,
    TINY,
    CaseTimeout,
    EngineDied,
    IdTokenizer,
    SplitCharTokenizer,
    _on_alarm,
    _where,
    tiny_model,
)
from course.labs.student_process import (
    Reader,
    StudentProcessError,
    keep_only_descriptors,
    on_its_own,
    recv_message,
    send_message,
)

HELLO_TIMEOUT_S = 300.0  # composing the pieces (importing the student's files) may take this long
MESSAGE_LIMIT = 1000  # characters of an error message that cross


class StepRecorder:
    """Records every step of an engine, read from what its scheduler and runner expose.

    Installed on one engine's instances (not its classes), so it sees the student's pieces as the
    engine runs them and changes nothing they do. A step's record is a JSON-ready dict with the
    keys of :data:`course.engine.exam.STEP_FIELDS` (and ``given``, ``cut``); block tables are
    followed through the scheduler's outputs (a new request's table, blocks appended, a resumed
    request's new table), exactly as the runner follows them. ``steps`` is the list the records
    go to; each ``generate`` request gets a fresh one. It runs beside the student's code, so what
    it records is the engine process's word: the exam checks outputs against its own oracle and
    uses the steps to explain a difference and to see that a case's mechanism happened.
    """

    def __init__(self, llm) -> None:
        self.steps: list[dict] = []
        self.tables: dict[str, int] = {}
        engine, scheduler = llm.engine, llm.engine.scheduler
        schedule, step = scheduler.schedule, engine.step

        def recorded_schedule():
            output = schedule()
            try:
                record = self._record(scheduler, output)
            except Exception as exc:  # an output the exam cannot read: shown as the difference
                record = {"unreadable": f"{type(exc).__name__}: {exc}"}
            self.steps.append(record)
            return output

        def recorded_step():
            before = len(self.steps)
            outputs = step()
            if len(self.steps) > before:
                batch = getattr(engine.model_runner, "batch_req_ids", None)
                self.steps[-1]["batch"] = [str(r) for r in batch] if batch is not None else None
            return outputs

        scheduler.schedule = recorded_schedule
        engine.step = recorded_step

    def _record(self, scheduler, output) -> dict:
        freed = [[rid, self.tables.pop(rid, 0)] for rid in output.preempted_req_ids]
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = len(new.block_ids[0])
        # A request placed this step: a prefix hit, or a swapped request's kept progress.
        admitted = [[new.req_id, new.num_computed_tokens] for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        for rid, resumed, ids, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                               cached.new_block_ids, cached.num_computed_tokens):
            added = len(ids[0]) if ids else 0
            self.tables[rid] = added if resumed else self.tables.get(rid, 0) + added
            if resumed:
                admitted.append([rid, computed])
        given = sum(len(new.block_ids[0]) for new in output.scheduled_new_reqs) + sum(
            len(ids[0]) if ids else 0 for ids in cached.new_block_ids)
        scheduled = [[rid, int(n)] for rid, n in output.num_scheduled_tokens.items()]
        cut = 0
        for rid, _ in scheduled:
            request = scheduler.requests.get(rid)
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                cut += 1
        return {
            "admitted": admitted,
            "scheduled": scheduled,
            "preempted": freed,
            "swap_out": len(output.blocks_to_swap_out),
            "swap_in": len(output.blocks_to_swap_in),
            "tables": [[rid, self.tables.get(rid, 0)] for rid, _ in scheduled],
            "running": [r.request_id for r in scheduler.running],
            "waiting": [r.request_id for r in scheduler.waiting],
            "swapped": [r.request_id for r in getattr(scheduler, "swapped", ())],
            "batch": None,
            "nan": 0,
            "given": given,
            "cut": cut,
        }


class Engines:
    """The engine process's state: the engines and servers built so far (each named by a number
    the exam holds), and the step records of the generate call running now.

    Every engine's KV cache starts full of NaN, as memory that was never written may be on a
    GPU: a piece that reads a slot it does not own, or multiplies NaN by a weight of 0, turns the
    output into NaN, and every step counts the rows of the model's output that hold NaN.
    """

    def __init__(self, labs: tuple[str, ...] = (), gpu: bool = False) -> None:
        self.labs, self.gpu = tuple(labs), gpu  # composed here, and in a core process it starts
        self.models: dict[str, object] = {}
        self.llms: list = []
        self.recorders: list[StepRecorder] = []
        self.cpu_free: list[int] = []
        self.servers: list = []
        self.current: list[dict] | None = None

    # --- the requests ---------------------------------------------------------------------------

    def forget(self) -> dict:
        """A new case: stop every server, drop every engine (shut down: a KV connector's store
        leaves no segment behind)."""
        for server, _ in self.servers:
            if server is not None:
                server.stop()
        for llm in self.llms:
            if getattr(llm, "_engine", None) is not None:
                llm._engine.shutdown()
        self.llms, self.recorders, self.cpu_free, self.servers = [], [], [], []
        return {}

    def new(self, config: dict) -> dict:
        from mini_vllm.attention.fp8 import is_fp8
        from mini_vllm.entrypoints.llm import LLM

        config = dict(config)
        tokenizer = SplitCharTokenizer() if config.pop("tokenizer", "ids") == "split" \
            else IdTokenizer()
        lookahead = int(config.pop("lookahead", 0))
        if config.get("kv_scales") is not None:
            config["kv_scales"] = [tuple(s) for s in config["kv_scales"]]
        model = config.pop("model", None) or (
            "fp8" if is_fp8(config.get("kv_cache_dtype", "auto")) else "tiny")
        if model not in MODELS:
            raise ValueError(f"no exam model named {model!r} (one of {sorted(MODELS)})")
        llm = LLM(self._model(model), tokenizer=tokenizer, **config)
        swap = llm.engine.scheduler.swap_space
        runner = llm.engine.model_runner
        with torch.no_grad():
            for cache in (*runner.kv_caches, *getattr(runner, "cpu_kv_caches", ())):
                for tensor in cache:
                    tensor.fill_(float("nan"))
        if lookahead:
            _reserve_lookahead(llm, lookahead)
        self.llms.append(llm)
        self.recorders.append(StepRecorder(llm))
        self.cpu_free.append(swap.get_num_free_blocks() if swap is not None else 0)
        return {"engine": len(self.llms) - 1,
                "kv_cache_dtype": str(runner.kv_caches[0][0].dtype),
                "attention": "triton" if getattr(runner.attn_backend, "triton", None) else "paged"}

    def generate(self, engine: int, prompts: list, params: list) -> dict:
        from mini_vllm.sampling_params import SamplingParams

        llm, recorder = self.llms[engine], self.recorders[engine]
        recorder.steps = self.current = []
        outputs = llm.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
        swap = llm.engine.scheduler.swap_space
        answer = {
            "outputs": [{"completions": [{"token_ids": [int(t) for t in c.token_ids],
                                          "finish_reason": str(c.finish_reason)}
                                         for c in out.outputs],
                         "num_cached_tokens": int(out.metrics["num_cached_tokens"])}
                        for out in outputs],
            "stats": _numbers(llm.last_stats),
            "steps": self.current,
            "cpu_blocks_held": (self.cpu_free[engine] - int(swap.get_num_free_blocks())
                                if swap is not None else 0),
        }
        self.current = None
        return answer

    def beam_search(self, engine: int, prompts: list, beam_width: int, max_tokens: int) -> dict:
        from mini_vllm.sampling_params import BeamSearchParams

        llm = self.llms[engine]
        outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=beam_width,
                                                            max_tokens=max_tokens))
        return {"sequences": [[[[int(t) for t in beam.tokens], float(beam.cum_logprob)]
                               for beam in out.sequences] for out in outputs],
                "blocks_in_use": int(llm.engine.num_blocks_in_use),
                "prefix_cache_hits": int(llm.last_stats.prefix_cache_hits)}

    def serve(self, engine: int, multiprocessing: bool = False,
              step_timeout_s: float = 60.0) -> dict:
        """Serve an engine behind the OpenAI-compatible server, on a Unix socket the exam's
        client connects to. ``multiprocessing``: its engine core in a process of its own, which
        composes the same pieces before it builds the engine (a spawned process starts from
        the reference); else on a thread of this one."""
        from course.labs.serving import ServerThread
        from mini_vllm.engine.async_llm import AsyncLLM
        from mini_vllm.entrypoints.openai.api_server import build_app

        llm, setup = self.llms[engine], None
        if multiprocessing:
            from course.engine.compose import compose
            from mini_vllm.entrypoints.llm import LLM

            # The core is built from a copy of the model: one without this process's NaN hook
            # (a closure, which cannot travel to a spawned process).
            knobs = {f.name: getattr(llm.config, f.name)
                     for f in dataclasses.fields(llm.config)}
            llm = LLM(tiny_model(config=TINY), tokenizer=llm.tokenizer, **knobs)
            setup = functools.partial(compose, self.labs, gpu=self.gpu) if self.labs else None
        async_llm = AsyncLLM(llm, model_name="exam", multiprocessing=multiprocessing,
                             step_timeout_s=float(step_timeout_s), core_setup=setup)
        self.servers.append((None, async_llm))  # stopped by forget() even if it fails to start
        server = ServerThread(build_app(async_llm), uds=True).start()
        self.servers[-1] = (server, async_llm)
        return {"server": len(self.servers) - 1, "uds": server.uds}

    def generation_tokens(self, server: int) -> dict:
        return {"tokens": int(self.servers[server][1].stat_logger.generation_tokens)}

    def wait_idle(self, server: int, timeout: float) -> dict:
        from course.labs.serving import wait_idle

        return {"held": wait_idle(self.servers[server][1], float(timeout))}

    def kill_core(self, server: int) -> dict:
        """SIGKILL the engine-core process of a server whose core runs in one."""
        process = self.servers[server][1].core_client.process
        os.kill(process.pid, signal.SIGKILL)
        return {"pid": process.pid}

    def stop_server(self, server: int) -> dict:
        stopping, self.servers[server] = self.servers[server][0], (None, None)
        if stopping is not None:
            stopping.stop()
        return {}

    def route(self, engines: int, block_size: int, num_blocks: int, threshold: int,
              events: list) -> dict:
        """Lab 04-07's router (the composed one) on a stream of events: ``["route", prompt]``
        routes a request, ``["finish", k]`` ends the ``k``-th routed one. The engine chosen for
        each routed request, in order."""
        from mini_vllm.entrypoints import router

        policy = router.PrefixRouter(engines, block_size=block_size, num_blocks=num_blocks,
                                     balance_abs_threshold=threshold)
        chosen: list[int] = []
        for kind, value in events:
            if kind == "route":
                chosen.append(int(policy.route([int(t) for t in value])))
            else:
                policy.finished(chosen[int(value)])
        return {"chosen": chosen}

    # --- answering ------------------------------------------------------------------------------

    REQUESTS = ("forget", "new", "generate", "beam_search", "serve", "generation_tokens",
                "wait_idle", "kill_core", "stop_server", "route")

    def answer(self, request: dict) -> dict:
        """One request (``op``, ``args``, ``seconds`` left for it) answered as data: ``{"ok":
        ...}``, or ``{"error": {"type", "message", "where", "not_implemented"}, "steps": ...}``.
        Past ``seconds`` the request is interrupted (CaseTimeout): ``{"timeout": true, "steps":
        ...}``. ``steps``: what the interrupted generate call had recorded."""
        op, args, seconds = request.get("op"), request.get("args") or {}, request.get("seconds")
        if op not in self.REQUESTS or not isinstance(args, dict):
            return {"error": {"type": "ValueError", "message": f"no request {op!r}"}}
        use_alarm = isinstance(seconds, (int, float)) and seconds > 0
        if use_alarm:
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, float(seconds))
        try:
            return {"ok": getattr(self, op)(**args)}
        except CaseTimeout:
            return {"timeout": True, "steps": self.current}
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the exam says what went wrong
            return {"error": {"type": type(exc).__name__,
                              "message": str(exc)[:MESSAGE_LIMIT], "where": _where(exc),
                              "not_implemented": isinstance(exc, NotImplementedError)},
                    "steps": self.current}
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            if op == "generate":
                self.current = None

    def _model(self, name: str):
        """Exam model ``name`` (a key of MODELS: "fp8" is TINY's twin with head size 16 for an
        fp8 cache), with the hook that counts NaN rows in the running step's record."""
        if name not in self.models:
            model = tiny_model(config=MODELS[name])

            def hook(module, args, output) -> None:
                if self.current and torch.is_tensor(output):
                    self.current[-1]["nan"] += int(torch.isnan(output).any(dim=-1).sum())

            model.register_forward_hook(hook)
            self.models[name] = model
        return self.models[name]


def _numbers(stats) -> dict:
    """The engine's statistics as numbers (``EngineStats``'s fields, a dataclass field's numbers
    as ``field_name``; a tensor or numpy scalar a student's piece left there counts as its
    value)."""
    out = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if dataclasses.is_dataclass(value):  # spec_decoding's counters: spec_decoding_num_drafts
            out.update({f"{f.name}_{k}": v for k, v in _numbers(value).items()})
            continue
        if hasattr(value, "item") and callable(value.item):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f.name] = value
    return out


def _reserve_lookahead(llm, lookahead: int) -> None:
    """Every allocation reserves at least ``lookahead`` slots past the scheduled tokens, as
    speculative decoding reserves them for draft tokens (more if the scheduler asks more)."""
    manager = llm.engine.scheduler.kv_cache_manager
    allocate = manager.allocate_slots

    def allocate_with_lookahead(request, num_new_tokens, *args, num_lookahead_tokens=0,
                                **kwargs):
        return allocate(request, num_new_tokens, *args,
                        num_lookahead_tokens=max(num_lookahead_tokens, lookahead), **kwargs)

    manager.allocate_slots = allocate_with_lookahead


# --- the worker's handles -----------------------------------------------------------------------


class EngineProcess:
    """The worker's handle on one engine process, which composes ``labs`` (the student's) into
    mini_vllm and answers :class:`Engines` requests. ``rows`` is the composition it reports
    (the lab table), ``composition_error`` the reason it could not compose, if any. A call that
    does not finish (no answer within its time and GRACE_S more, an interruption on this side,
    anything but a valid message) kills the process; :meth:`restart` starts it again."""

    def __init__(self, labs: list[str], gpu: bool = False) -> None:
        self.labs, self.gpu = list(labs), gpu
        self.pid = 0
        self.rows: list | None = None
        self.composition_error: str | None = None
        self.restart()

    @property
    def alive(self) -> bool:
        """The process runs (one that ended since the last call is reaped here)."""
        if self.pid:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done = self.pid
            if done:
                pid, self.pid = self.pid, 0
                self.sock.close()
                kill_group(pid, reaped=True)
        return self.pid != 0

    def restart(self) -> None:
        """A fresh process (the old one killed): composed, or with ``composition_error`` set."""
        self.stop()
        ours, theirs = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        worker = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _engine_process(theirs, self.labs, self.gpu, worker)
        theirs.close()
        self.pid, self.sock, self.reader = pid, ours, Reader(ours)
        ours.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = self._receive()
        except TimeoutError:
            self.stop()
            raise EngineDied(f"composing the pieces took over {HELLO_TIMEOUT_S:.0f} s (code "
                             "that runs when a starter.py is imported?)") from None
        if "composition_error" in hello:
            self.composition_error = str(hello["composition_error"])[:MESSAGE_LIMIT]
            self.stop()
            return
        rows = hello.get("composition")
        if not (isinstance(rows, list) and all(
                isinstance(row, list) and len(row) == 3 and all(type(c) is str for c in row)
                for row in rows)):
            self.stop()
            raise EngineDied(str(hello.get("error") or "the engine process did not compose")
                             [:MESSAGE_LIMIT])
        self.rows, self.composition_error = rows, None

    def call(self, op: str, args: dict, seconds: float | None) -> dict:
        if not self.alive:
            raise EngineDied("the engine process is not running")
        self.sock.settimeout(None if seconds is None else seconds + GRACE_S)
        try:
            send_message(self.sock, {"op": op, "args": args, "seconds": seconds}, [])
            return self._receive()
        except TimeoutError:
            self.stop()
            raise CaseTimeout() from None
        except EngineDied:
            raise
        except BaseException:
            self.stop()  # the call did not finish: the process's state is not known
            raise

    def _receive(self) -> dict:
        try:
            header, blobs = recv_message(self.reader)
        except TimeoutError:
            raise
        except (OSError, EOFError, StudentProcessError) as exc:
            why = self._ended()
            raise EngineDied(why or f"the engine process broke the protocol: {exc}") from None
        if blobs or not isinstance(header, dict):
            self.stop()
            raise EngineDied("the engine process sent what the protocol does not allow")
        return header

    def _ended(self) -> str:
        """Why the process is gone; it and what it started in its group are killed and reaped
        here."""
        pid, self.pid = self.pid, 0
        self.sock.close()
        try:  # a crash closes the socket a moment before the process is reaped
            done, status = 0, None
            for _ in range(50):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.01)
        except ChildProcessError:
            done, status = pid, None
        kill_group(pid, reaped=bool(done))
        if not done or status is None:
            return "" if not done else "the engine process ended"
        if os.WIFSIGNALED(status):
            return (f"the engine process died ({signal.Signals(os.WTERMSIG(status)).name}): "
                    "code in a starter.py crashed it or killed it")
        return (f"the engine process exited (code {os.WEXITSTATUS(status)}): code in a "
                "starter.py exited")

    def stop(self) -> None:
        if self.pid:
            pid, self.pid = self.pid, 0
            self.sock.close()
            kill_group(pid)


def kill_group(pid: int, reaped: bool = False) -> None:
    """Kill the engine process and its group (what it started and left there), then reap it.
    Once it is reaped its pid may be another process's: only its group is signalled then."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if reaped:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (OSError, ChildProcessError):
        pass


def _engine_process(sock: socket.socket, labs: list[str], gpu: bool, worker: int) -> None:
    """The engine process: on its own (process group, no descriptor of the worker's), compose,
    say so, answer until the worker hangs up. Never returns."""
    code = 0
    try:
        on_its_own(worker)
        keep_only_descriptors({0, 1, 2, sock.fileno()})
        from course.engine.compose import CompositionError, compose

        try:
            composition = compose(labs, gpu=gpu)
        except CompositionError as exc:
            send_message(sock, {"composition_error": str(exc)}, [])
            return
        except BaseException as exc:  # noqa: BLE001 - said to the worker
            send_message(sock, {"error": f"{type(exc).__name__}: {exc} (at {_where(exc)})"
                                [:MESSAGE_LIMIT]}, [])
            return
        send_message(sock, {"composition": composition.lab_rows()}, [])
        engines, reader = Engines(tuple(labs), gpu), Reader(sock)
        while True:
            try:
                request, _ = recv_message(reader)
            except EOFError:
                return
            answer = engines.answer(request)
            try:
                send_message(sock, answer, [])
            except (TypeError, ValueError, RecursionError) as exc:  # before anything is sent
                send_message(sock, {"error": {"type": "TypeError", "where": "?", "message":
                                              f"an answer that is not data ({exc})"}}, [])
    except BaseException:  # noqa: BLE001 - said on stderr (the worker's log)
        code = 1
        try:
            os.write(2, ("the engine process stopped:\n" + traceback.format_exc()).encode())
        except OSError:
            pass
    finally:
        os._exit(code)
