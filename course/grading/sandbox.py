"""Run a grading session (a pytest process that runs student code) as far from the grader as the
operating system allows.

Levels, best first (`probe()` picks the best that works on this machine):

- "namespaces+nobody" (the grader runs as root, `unshare` and `setpriv` exist): new network
  namespace (no network), PID namespace (every process of the lab dies with it, daemons
  included), mount namespace (the grader's output and the other submissions are hidden under
  empty tmpfs mounts), and the session runs as the unprivileged user `nobody`, who can write
  only its throwaway HOME and temp dir: not the course copy, not the Python environment (no .pth),
  not the grader's output.
- "namespaces" (unprivileged user namespaces): the same namespaces, but the code runs as the
  grader's own user, so it could write wherever that user can.
- "process-group": a new session and process group only; every process still carrying this lab's
  token in its environment is killed when the lab ends.

Always: a minimal environment, a throwaway HOME and TMPDIR, limits on file size and processes,
a wall-clock budget after which the whole lab is killed.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

NOBODY = 65534
FSIZE_LIMIT = 512 * 1024 * 1024  # bytes one process may write to a file
NPROC_LIMIT = 4096  # processes of the sandbox's user
TOKEN_ENV = "COURSE_SANDBOX_TOKEN"

# sh as PID 1 of the new namespace: hide the paths given before "--", then run the rest. It does
# not exec, so that the namespace's init is sh (which reaps) rather than the session.
_HIDE_AND_RUN = (
    'while [ "$1" != "--" ]; do mount -t tmpfs -o size=4k,mode=0 none "$1" 2>/dev/null; '
    'shift; done; shift; "$@"'
)


@dataclass(frozen=True)
class Isolation:
    level: str
    network: bool = False  # True: no network
    pid_namespace: bool = False
    user_dropped: bool = False  # runs as nobody
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "no_network": self.network,
            "pid_namespace": self.pid_namespace,
            "runs_as_nobody": self.user_dropped,
            "notes": list(self.notes),
        }


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_NS = ["--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc"]


@cache
def probe() -> Isolation:
    """The strongest isolation this machine allows (tried once per process)."""
    notes = []
    if os.environ.get("COURSE_SANDBOX") == "process-group":
        return Isolation("process-group", notes=("COURSE_SANDBOX=process-group",))
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if sys.platform == "linux" and unshare and os.geteuid() == 0 and setpriv:
        check = [unshare, *_NS, "--", setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                 "--clear-groups", "--", sys.executable, "-c", "import pytest, course"]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        try:
            ok = subprocess.run(check, capture_output=True, timeout=60, env=env).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return Isolation("namespaces+nobody", True, True, True)
        notes.append(
            f"running as root, but user nobody cannot run {sys.executable} with pytest "
            "(make the Python environment world-readable); falling back"
        )
    elif os.geteuid() == 0:
        notes.append("running as root but unshare or setpriv is missing")
    else:
        notes.append("not running as root: student code runs as the grader's own user")
    if sys.platform == "linux" and unshare and _works(
        [unshare, "--user", "--map-root-user", *_NS, "true"]
    ):
        return Isolation("namespaces", True, True, False, tuple(notes))
    notes.append("no namespaces available: network is not cut off, and a daemon that clears "
                 "its environment can outlive the lab")
    return Isolation("process-group", notes=tuple(notes))


def wrap(argv: list[str], iso: Isolation, hide: list[Path]) -> list[str]:
    """The command line that runs `argv` at isolation level `iso`."""
    limits = ["prlimit", f"--fsize={FSIZE_LIMIT}", f"--nproc={NPROC_LIMIT}", "--core=0", "--"]
    if not shutil.which("prlimit"):
        limits = []
    hidden = [str(p) for p in hide if p.exists()]
    if iso.level == "namespaces+nobody":
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "--no-new-privs", "--"]
        return ["unshare", *_NS, "--", "/bin/sh", "-c", _HIDE_AND_RUN, "sh", *hidden, "--",
                *limits, *drop, *argv]
    if iso.level == "namespaces":
        return ["unshare", "--user", "--map-root-user", *_NS, "--", "/bin/sh", "-c",
                _HIDE_AND_RUN, "sh", *hidden, "--", *limits, *argv]
    return [*limits, *argv]


class Workspace:
    """A folder of one lab's run: `tree` (the course copy, read-only to the sandbox), and the
    sandbox's own `home` and `tmp`."""

    def __init__(self, parent: Path, iso: Isolation):
        self.root = Path(os.path.realpath(parent)) / f"ws-{secrets.token_hex(8)}"
        self.root.mkdir(mode=0o711)
        self.tree, self.home, self.tmp = self.root / "tree", self.root / "home", self.root / "tmp"
        self.iso = iso

    def seal(self) -> None:
        """The tree becomes read-only to the sandbox; home and tmp are its own."""
        for d in (self.home, self.tmp):
            d.mkdir(mode=0o700)
            if self.iso.user_dropped:
                os.chown(d, NOBODY, NOBODY)
        for dirpath, _dirs, filenames in os.walk(self.tree):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    os.chmod(p, 0o444)

    def remove(self) -> None:
        for dirpath, dirnames, _ in os.walk(self.root):
            for d in dirnames:
                try:
                    os.chmod(os.path.join(dirpath, d), 0o700)
                except OSError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


def minimal_env(ws: Workspace, extra: dict[str, str]) -> dict[str, str]:
    bin_dirs = [os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        bin_dirs.insert(1, os.path.dirname(nvcc))
    env = {
        "PATH": os.pathsep.join(dict.fromkeys(bin_dirs)),
        "HOME": str(ws.home),
        "TMPDIR": str(ws.tmp),
        "XDG_CACHE_HOME": str(ws.home / ".cache"),
        "MPLCONFIGDIR": str(ws.home / ".matplotlib"),
        "MPLBACKEND": "Agg",
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(ws.tree),
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
    }
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(extra)
    return env


@dataclass
class SessionRun:
    messages: list[dict]
    returncode: int | None
    timed_out: bool
    seconds: float
    log_tail: str


def run_session(
    argv: list[str],
    ws: Workspace,
    env: dict[str, str],
    budget: float,
    hide: list[Path],
    on_message=None,
) -> SessionRun:
    """Run `argv` sandboxed in `ws`, passing it the write end of a channel as the argument
    "{channel}"; read JSON lines from the channel until it closes or `budget` seconds pass, then
    kill everything the run started."""
    import json

    r, w = os.pipe()
    token = secrets.token_hex(16)
    env = dict(env, **{TOKEN_ENV: token})
    cmd = wrap([a.replace("{channel}", str(w)) for a in argv], ws.iso, hide)
    log_path = ws.root / "session.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ws.tree, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            pass_fds=(w,), start_new_session=True,
        )
    os.close(w)
    messages: list[dict] = []
    buf, timed_out = b"", False
    try:
        while True:
            left = start + budget - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    messages.append(msg)
                    if on_message:
                        on_message(msg)
    finally:
        os.close(r)
        _kill(proc, token)
    return SessionRun(messages, proc.returncode, timed_out, time.monotonic() - start,
                      _tail(log_path))


def _kill(proc: subprocess.Popen, token: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    sweep(token)


def sweep(token: str) -> list[int]:
    """Kill every process whose environment carries `token` (those that left the group)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return killed


def _tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")
