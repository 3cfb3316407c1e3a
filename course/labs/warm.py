"""A warm pytest: one server process imports torch, pytest and Hypothesis once and forks a child
for each lab run, so that `python -m course check`'s ~200 short runs (most of them one test, on a
planted bug) do not each pay the ~2 s those imports cost a fresh interpreter.

A child is set up as `python -m pytest` would be in the run's folder: its own working folder,
environment, `sys.path` (the folder, then PYTHONPATH, then the interpreter's own), stdin closed,
stdout and stderr into a file, and a process group of its own (a timeout kills the group). The
server imports nothing of the course or of mini_vllm, so each child imports them from the copy it
runs in. torch is only imported, never run, before the fork: no thread pool exists yet to be
copied half-held, and its thread count is set in the child from OMP_NUM_THREADS.

:func:`session` starts a server for the block it guards; :func:`course.labs.runner.run_lab` uses
it when one is running and a fresh interpreter otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# The server: requests are JSON lines on stdin ({"id", "argv", "cwd", "env", "out"}); it answers
# {"id", "pid"} when a child starts and {"id", "code"} when it ends (-N: killed by signal N).
_SERVER = r"""
import json, os, select, signal, sys
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
import torch, pytest, hypothesis  # noqa: F401  (the point of the server: imported once)
BASE_PATH = [p for p in sys.path if p]
live = {}

def answer(record):
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()

def child(req):
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    env = req["env"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [req["cwd"], *extra, *BASE_PATH]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *req["argv"]]
    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    code = 3
    try:
        code = int(pytest.main(req["argv"]))
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

try:
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    child(req)
                live[pid] = req["id"]
                answer({"id": req["id"], "pid": pid})
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer({"id": live.pop(pid), "code": os.waitstatus_to_exitcode(status)})
finally:
    for pid in live:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class WarmPytest:
    """The client of one server; `run` may be called from several threads at once."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("PYTHONPATH", None)  # the server must not import the course from anywhere
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, cwd="/", text=True, bufsize=1,
        )
        self._lock = threading.Lock()
        self._next = 0
        self._events: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            record = json.loads(line)
            with self._cond:
                self._events.setdefault(record["id"], {}).update(record)
                self._cond.notify_all()
        with self._cond:  # the server is gone: every waiting run ends
            self._events[-1] = {"gone": True}
            self._cond.notify_all()

    def _wait(self, rid: int, key: str, timeout: float | None) -> dict | None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: key in self._events.get(rid, {}) or -1 in self._events, timeout)
            return self._events.get(rid) if ok and key in self._events.get(rid, {}) else None

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], out: Path,
            timeout: float) -> int | None:
        """pytest `argv` in `cwd` with `env`, its output to `out`; the exit code, or None when
        it ran past `timeout` (its process group is killed) or the server is gone."""
        with self._lock:
            self._next += 1
            rid = self._next
            request = {"id": rid, "argv": argv, "cwd": str(cwd), "env": env, "out": str(out)}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        started = self._wait(rid, "pid", 60)
        if started is None:
            return None
        done = self._wait(rid, "code", timeout)
        if done is None:
            with contextlib.suppress(OSError):
                os.killpg(started["pid"], signal.SIGKILL)
            self._wait(rid, "code", 30)
            return None
        return int(done["code"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_active: WarmPytest | None = None


def active() -> WarmPytest | None:
    """The server of the current :func:`session`, if any."""
    return _active


@contextlib.contextmanager
def session():
    """Lab runs inside this block fork from one warm server (not on platforms without fork)."""
    global _active
    if not hasattr(os, "fork") or _active is not None:
        yield _active
        return
    _active = WarmPytest()
    try:
        yield _active
    finally:
        server, _active = _active, None
        server.close()
