"""Run a grading session (a pytest process that runs student code) as far from the grader as the
operating system allows, with limits that hold and nothing left behind.

Levels, best first (`probe()` picks the best that works on this machine; `require()` refuses
anything below the first unless the instructor allows it):

- "namespaces+nobody" (the grader runs as root, `unshare` and `setpriv` exist): new network
  (no network), PID (every process of the lab dies with it, daemons included), IPC (no System V
  segment outlives it), UTS and mount namespaces, and the session runs as the unprivileged user
  `nobody` with no capabilities and `no_new_privs`.
- "namespaces" (unprivileged user namespaces): the same namespaces, the session runs as root of
  its own user namespace (the grader's own user outside) with an empty capability bounding set,
  so it cannot undo the mounts below.
- "process-group": a new session and process group only; every process still carrying this lab's
  token in its environment, or left in its cgroup, is killed when the lab ends. No private
  mounts: what the session writes to /tmp or /dev/shm stays there.

What the session sees (both namespace levels; mounts live in the session's own mount namespace
and vanish with it, the host's mounts are untouched):

- /tmp and /dev/shm are fresh tmpfs mounts of `Limits.tmp_bytes` and `Limits.shm_bytes`; the
  workspace, which usually lives under the grader's staging folder in /tmp, is carried into the
  new /tmp at the same path. Other grading runs' staging folders are not there.
- The workspace is read-only (the course copy, spec files), except its `home` and `tmp`
  (tmpfs of `Limits.home_bytes` each, owned by `nobody` at the nobody level; HOME and TMPDIR)
  and `out` (a host folder for what the grader reads back, e.g. the exam's cases.json).
- The Python environment (sys.prefix, the base interpreter), nvcc's CUDA folder and the other
  kept paths are bound read-only; everything else outside the system folders (/usr, /etc, /bin,
  /lib*, /dev, /proc, /sys) is hidden: `hidden_paths()` covers each folder with an empty
  read-only tmpfs of mode 0 and each file with /dev/null, descending only into folders that hold
  a kept path (so /root, /home, /srv, /opt, /mnt, /media, /run, /var, the instructor's checkout,
  its .git and the grader's reports are unreadable, while a venv inside the checkout stays; the
  names in a folder that was descended into stay listable, their contents do not).

Limits (`Limits`, recorded in class.json through `Isolation.as_dict()`):

- memory: a cgroup of its own per session (cgroup v2 `memory.max` with `memory.swap.max=0`, or
  the v1 memory controller's `memory.limit_in_bytes` and `memory.memsw.limit_in_bytes`); the
  kernel's OOM killer stops the process that crosses it, `SessionRun.memory_limit_hit` reads the
  cgroup's OOM kill count and `peak_memory_bytes` its peak charge (RSS, page cache and the
  session's tmpfs pages). Without a usable cgroup: RLIMIT_AS, which bounds address space, not
  resident memory (`import torch, pytest` reserves 0.65 GB of address space for 0.23 GB
  resident; a torch lab's whole pytest session peaked at 0.69 GB, so 3 GiB leaves it room), and
  a hit is recognised from the session's output (`looks_like_memory_error`). RLIMIT_AS is never
  set when an NVIDIA GPU is visible (CUDA reserves far more address space than it uses): there,
  without a cgroup, memory is not limited and `require()` refuses.
- processes: the cgroup's `pids.max`, else RLIMIT_NPROC (per user: sessions that run as nobody
  at once share it; root ignores it).
- file size (RLIMIT_FSIZE), no core dumps, and a wall-clock budget after which the whole lab is
  killed; then its cgroup is emptied and removed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

NOBODY = 65534
MiB = 1024 * 1024
GiB = 1024 * MiB
# The largest file one process may make. Disk is bounded by the tmpfs sizes; this is for files
# that are memory: lab 02-06 maps sparse shared-memory files past 2^31 elements (8 GiB of
# address space, a few MiB touched), which a smaller limit refuses (EFBIG) to every submission.
FSIZE_LIMIT = 16 * GiB
NPROC_LIMIT = 4096  # RLIMIT_NPROC when a pids cgroup does the real counting
TOKEN_ENV = "COURSE_SANDBOX_TOKEN"
SANDBOX_FAILED = 97  # exit status of the wrapper when it could not set the sandbox up
COURSE_ROOT = Path(__file__).resolve().parents[2]  # the checkout the grader runs from

# Folders a session needs whole; every other top-level folder is hidden (see hidden_paths).
SYSTEM_PATHS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/dev",
                "/proc", "/sys", "/tmp")


@dataclass(frozen=True)
class Limits:
    """What one grading session may use. Sizes in bytes."""

    memory_bytes: int = 3 * GiB
    processes: int = 256
    tmp_bytes: int = 512 * MiB  # the private /tmp
    shm_bytes: int = 64 * MiB  # the private /dev/shm
    home_bytes: int = 256 * MiB  # the workspace's home, and again its tmp (TMPDIR)
    file_bytes: int = FSIZE_LIMIT  # the largest file one process may write

    def as_dict(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "processes": self.processes,
            "tmp_bytes": self.tmp_bytes,
            "shm_bytes": self.shm_bytes,
            "home_bytes": self.home_bytes,
            "file_bytes": self.file_bytes,
        }


@dataclass(frozen=True)
class Isolation:
    level: str
    network: bool = False  # True: no network
    pid_namespace: bool = False
    user_dropped: bool = False  # runs as nobody
    notes: tuple[str, ...] = field(default_factory=tuple)
    limits: Limits = field(default_factory=Limits)
    memory: str = "none"  # how memory is limited: "cgroup2", "cgroup1", "rlimit-as" or "none"
    processes: str = "rlimit-nproc"  # "cgroup2", "cgroup1" or "rlimit-nproc"

    @property
    def private_mounts(self) -> bool:
        return self.level in ("namespaces+nobody", "namespaces")

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "no_network": self.network,
            "pid_namespace": self.pid_namespace,
            "runs_as_nobody": self.user_dropped,
            "private_tmp_and_hidden_host": self.private_mounts,
            "memory_limit": self.memory,
            "process_limit": self.processes,
            "limits": self.limits.as_dict(),
            "notes": list(self.notes),
        }


class IsolationError(Exception):
    """The sandbox available here is weaker than the grader was asked to accept."""


def python() -> str:
    """The interpreter that sessions run: this one, by a path with its environment's folders
    resolved (a `.venv` that is a link into a hidden folder, such as a checkout, would not be
    found inside the sandbox), keeping the file name (resolving it would leave the venv)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)),
                        os.path.basename(sys.executable))


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_NS = ["--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc"]
# The new network namespace's loopback interface is down; brought up (SIOCGIFFLAGS, then
# SIOCSIFFLAGS with IFF_UP) so that a session's processes can talk to each other over
# 127.0.0.1, as torch.distributed's gloo must (lab 04-05). It reaches only that namespace.
LOOPBACK_UP = (
    "import fcntl, socket, struct\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "ifreq = lambda flags: struct.pack('16sh22x', b'lo', flags)\n"
    "flags = struct.unpack('16sh22x', fcntl.ioctl(s, 0x8913, ifreq(0)))[1]\n"
    "fcntl.ioctl(s, 0x8914, ifreq(flags | 1))\n"
)


@cache
def _probe_level() -> Isolation:
    notes = []
    if os.environ.get("COURSE_SANDBOX") == "process-group":
        return Isolation("process-group", notes=("COURSE_SANDBOX=process-group",))
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if sys.platform == "linux" and unshare and os.geteuid() == 0 and setpriv:
        check = [unshare, *_NS, "--", setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                 "--clear-groups", "--", python(), "-c", "import pytest"]
        # Not `course`: sessions import it from their copy of the course, and the checkout it
        # runs from may sit in a home folder that nobody cannot enter (as on GitHub's runners).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        try:
            ok = subprocess.run(check, capture_output=True, timeout=60, env=env).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        iso = Isolation("namespaces+nobody", True, True, True)
        failed = None if ok else (
            f"running as root, but user nobody cannot run {python()} with pytest "
            "(make the Python environment world-readable); falling back")
        failed = failed or _trial(iso)
        if failed is None:
            return iso
        notes.append(failed)
    elif os.geteuid() == 0:
        notes.append("running as root but unshare or setpriv is missing")
    else:
        notes.append("not running as root: student code runs as the grader's own user")
    if sys.platform == "linux" and unshare and setpriv and _works(
        [unshare, "--user", "--map-root-user", *_NS, "true"]
    ):
        iso = Isolation("namespaces", True, True, False, tuple(notes))
        failed = _trial(iso)
        if failed is None:
            return iso
        notes.append(failed)
    notes.append("no namespaces available: network is not cut off, /tmp is shared, the host's "
                 "files are not hidden, and a daemon that clears its environment can outlive "
                 "the lab")
    return Isolation("process-group", notes=tuple(notes))


def _trial(iso: Isolation) -> str | None:
    """Run a trivial session at `iso` with the whole mount plan: None if it worked, else why."""
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="course-sandbox-probe-"))
    try:
        os.chmod(parent, 0o711)
        ws = Workspace(parent, iso)
        ws.tree.mkdir()
        ws.seal()
        run = run_session([python(), "-c", "import json, site"], ws, minimal_env(ws, {}), 60,
                          [])
        if run.returncode == 0:
            return None
        return (f"the {iso.level} sandbox did not start here (exit {run.returncode}): "
                f"{run.log_tail.strip()[-300:]}; falling back")
    except OSError as exc:
        return f"the {iso.level} sandbox did not start here ({exc}); falling back"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@cache
def probe(limits: Limits | None = None) -> Isolation:
    """The strongest isolation this machine allows, with `limits` (default `Limits()`) and the
    mechanisms that will enforce them (worked out once per process)."""
    limits = limits or Limits()
    base = _probe_level()
    memory, processes, notes = _mechanisms()
    return replace(base, limits=limits, memory=memory, processes=processes,
                   notes=base.notes + notes)


def require(iso: Isolation, allow_weak: bool = False) -> None:
    """Refuse to grade below the full sandbox, unless the instructor said so."""
    if allow_weak:
        return
    problems = []
    if iso.level != "namespaces+nobody":
        problems.append(f"isolation is {iso.level!r}, weaker than 'namespaces+nobody'")
    if iso.memory == "none":
        problems.append("no memory limit can be enforced")
    if problems:
        why = "; ".join(iso.notes)
        raise IsolationError(
            "; ".join(problems) + (f" ({why})" if why else "") + ". Run the grader as root "
            "(e.g. with sudo) on Linux with unshare and setpriv (util-linux) and a Python "
            "environment that user nobody can read, or pass --allow-weak-isolation to grade "
            "with what this machine allows."
        )


# --- hiding the host ----------------------------------------------------------------------------


def hidden_paths(keep: list[Path], roots: list[Path]) -> list[Path]:
    """The paths to cover so that, of each root, only what leads to a kept path stays visible.

    A root that holds no kept path is hidden whole; one that holds a kept path (or is one of its
    ancestors) is descended into, its other children hidden one by one, and a kept path itself is
    left alone with everything under it. Symbolic links are never hidden (a link shows nothing of
    its own, and its target is hidden or kept on its own account). A root inside a kept path is
    still hidden: it was asked for explicitly. Paths are compared as given and resolved."""
    kept: set[Path] = set()
    for k in keep:
        kept.add(Path(os.path.abspath(k)))
        kept.add(Path(os.path.realpath(k)))

    def leads_to_kept(p: Path) -> bool:
        return any(k == p or p in k.parents for k in kept)

    found: dict[Path, None] = {}  # ordered, without repeats

    def visit(p: Path) -> None:
        if not leads_to_kept(p):
            found[p] = None
            return
        if p in kept:
            return
        try:
            with os.scandir(p) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:  # not a folder, or unreadable to us (then unreadable to the session)
            return
        for entry in entries:
            if not entry.is_symlink():
                visit(Path(entry.path))

    for root in sorted({Path(os.path.realpath(r)) for r in roots}, key=lambda p: len(p.parts)):
        if not os.path.lexists(root):
            continue
        if any(h == root or h in root.parents for h in found):
            continue  # already covered
        visit(root)
    return list(found)


def _python_paths() -> list[Path]:
    """The folders the interpreter and its environment live in."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(python()), os.path.dirname(os.path.realpath(sys.executable))}
    # Package folders that a .pth file adds from elsewhere (an environment layered on another).
    paths |= {os.path.realpath(p) for p in sys.path
              if ("site-packages" in p or "dist-packages" in p) and os.path.isdir(p)}
    return [Path(p) for p in paths if p]


def _library_dirs() -> set[Path]:
    """Folders of the shared libraries this process has loaded (e.g. a Nix store path)."""
    found = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                found.add(Path(parts[5].split(" (deleted)")[0]).parent)
    except OSError:
        pass
    return found


def readonly_paths(extra: list[Path] = ()) -> list[Path]:
    """Kept folders that the session gets read-only binds of: the Python environment, CUDA,
    `extra`."""
    paths = _python_paths() + [Path(p) for p in extra]
    nvcc = shutil.which("nvcc")
    if nvcc:
        paths.append(Path(os.path.realpath(nvcc)).parents[1])
    if os.environ.get("CUDA_HOME"):
        paths.append(Path(os.environ["CUDA_HOME"]))
    return paths


def kept_paths(ws: Workspace | None = None, extra: list[Path] = ()) -> list[Path]:
    """What a session must still see: the system folders, the read-only paths, the folders of
    LD_LIBRARY_PATH and of the libraries loaded here, the workspace."""
    keep = [Path(p) for p in SYSTEM_PATHS] + readonly_paths(extra)
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d.startswith("/"):
            keep.append(Path(d))
    keep.extend(_library_dirs())
    if ws is not None:
        keep.append(ws.root)
    return keep


def hidden_roots(extra: list[Path] = ()) -> list[Path]:
    """Where hiding starts: the whole file system, the checkout the grader runs from, a checkout
    that holds the Python environment (a .venv inside a clone), and `extra`."""
    roots = [Path("/"), COURSE_ROOT, *extra]
    for prefix in {sys.prefix, os.path.realpath(sys.prefix)}:
        parent = Path(prefix).parent
        if (parent / ".git").exists():
            roots.append(parent)
    return roots


def _under(p: Path, top: Path) -> bool:
    return p == top or top in p.parents


def _minimal(paths: list[Path]) -> list[Path]:
    """`paths` without those inside another one of them."""
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda q: len(q.parts)):
        if not any(_under(p, q) for q in out):
            out.append(p)
    return out


def mount_script(ws: Workspace, iso: Isolation, limits: Limits, keep: list[Path],
                 readonly: list[Path], hide: list[Path], cwd: Path) -> str:
    """The shell script that PID 1 of the new namespaces runs (as root there) before the
    session: the loopback interface up, private /tmp and /dev/shm, the workspace carried over
    read-only with its own home, tmp and out, `readonly` bound read-only, `hide` hidden. It
    ends by running "$@" (without exec: the namespace's init stays a shell, which reaps)."""
    q = shlex.quote
    tmp = Path(os.path.realpath("/tmp"))
    shm = Path("/dev/shm")
    w = ws.root
    system = [Path(p) for p in SYSTEM_PATHS if p != "/tmp"]

    def real(paths: list[Path]) -> set[Path]:
        return {Path(os.path.realpath(p)) for p in paths if os.path.exists(p)} - {Path("/")}

    # Kept paths under /tmp are carried into the new one (the outermost of each nest).
    carry = _minimal([p for p in real(keep) | {w} if _under(p, tmp) and p != tmp])
    ro = {p for p in real(readonly) if not _under(p, w) and not _under(p, shm)
          and p not in system and p != tmp}
    lines = [
        "umask 022",
        f'fail() {{ echo "sandbox: $*" >&2; exit {SANDBOX_FAILED}; }}',
        'mnt() { mount -n "$@" || fail "mount $* failed"; }',  # -n: no utab
        'hide() { if [ -L "$1" ]; then :; elif [ -d "$1" ]; then '
        'mnt -t tmpfs -o ro,nosuid,nodev,noexec,size=4k,mode=0 course-hidden "$1"; '
        'elif [ -e "$1" ]; then mnt --bind /dev/null "$1"; fi; }',
        f"{q(python())} -c {q(LOOPBACK_UP)} || fail 'could not bring the loopback interface up'",
    ]
    # 1. The new /tmp is first mounted on the workspace's tmp folder (somewhere we know exists
    #    and is not hidden), filled with binds of what must survive, then moved over /tmp.
    stage = w / "tmp"
    lines.append(f"mnt -t tmpfs -o nosuid,nodev,size={limits.tmp_bytes},mode=1777 course-tmp "
                 f"{q(str(stage))}")
    for p in carry:
        inside = stage / p.relative_to(tmp)
        if p.is_dir():
            lines.append(f"mkdir -p {q(str(inside))} || fail 'mkdir {inside}'")
        else:  # a file: bind it onto an empty one
            lines.append(f"mkdir -p {q(str(inside.parent))} && : > {q(str(inside))} "
                         f"|| fail 'mkdir {inside}'")
        lines.append(f"mnt --bind {q(str(p))} {q(str(inside))}")
    lines.append(f"mnt --move {q(str(stage))} {q(str(tmp))}")
    lines.append(f"if [ -d /dev/shm ]; then mnt -t tmpfs -o nosuid,nodev,size={limits.shm_bytes},"
                 "mode=1777 course-shm /dev/shm; fi")
    # 2. The read-only paths and the workspace bound read-only, deepest first, so that an outer
    #    one's recursive bind takes the inner ones along; the workspace's out stays writable.
    for p in sorted(ro | {w}, key=lambda x: -len(x.parts)):
        if p == w:
            lines.append(f"mnt --bind {q(str(w / 'out'))} {q(str(w / 'out'))}")
        lines.append(f"mnt --rbind {q(str(p))} {q(str(p))}")
        lines.append(f"mnt -o remount,bind,ro {q(str(p))}")
    owner = f",uid={NOBODY},gid={NOBODY}" if iso.user_dropped else ""
    for name in ("home", "tmp"):
        lines.append(f"mnt -t tmpfs -o nosuid,nodev,size={limits.home_bytes},mode=0700{owner} "
                     f"course-{name} {q(str(w / name))}")
    # 3. Hide the rest (paths under the replaced /tmp and /dev/shm are gone already).
    for p in hide:
        if (_under(p, tmp) or _under(p, shm)) and not any(_under(p, k) for k in carry):
            continue
        lines.append(f"hide {q(str(p))}")
    lines.append(f"cd {q(str(cwd))} || fail 'cd {cwd}'")
    lines.append('"$@"')
    return "\n".join(lines)


# --- memory and process limits -----------------------------------------------------------------


def _mountinfo() -> list[tuple[str, str, str, str]]:
    """(root, mount point, type, super options) of each mount of this process."""
    rows = []
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        a, b = pre.split(), post.split()
        if len(a) >= 5 and len(b) >= 3:
            unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)  # noqa: E731
            rows.append((unescape(a[3]), unescape(a[4]), b[0], b[2]))
    return rows


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    own = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return own
    for line in text.splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and not ctrls:
            own[""] = path
        for c in ctrls.split(","):
            if c:
                own[c] = path
    return own


def _cgroup_dir(controller: str) -> Path | None:
    """The folder of this process's own cgroup: v2 when `controller` is "", else the v1
    hierarchy that carries `controller`."""
    own = _own_cgroups().get(controller)
    if own is None:
        return None
    for root, mountpoint, fstype, opts in _mountinfo():
        if (controller == "" and fstype == "cgroup2") or (
            fstype == "cgroup" and controller in opts.split(",")
        ):
            rel = os.path.relpath(own, root) if own.startswith(root) else own.lstrip("/")
            return Path(mountpoint) / ("" if rel == "." else rel)
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _keyed(path: Path) -> dict[str, int]:
    """A cgroup file of "key value" lines."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Cgroups:
    """The cgroup(s) of one session: created with its limits, joined by the wrapper shell before
    anything else runs, emptied, read and removed by `finish()`."""

    def __init__(self, kind: str, dirs: dict[str, Path]):
        self.kind, self.dirs = kind, dirs  # dirs: {"memory": ..., "pids": ...} (same in v2)

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in dict.fromkeys(self.dirs.values())]

    @classmethod
    def create(cls, memory: str, processes: str, limits: Limits, name: str) -> Cgroups | None:
        """New cgroups named `name` for the mechanisms asked for ("cgroup2" or "cgroup1" for
        memory and for processes), or None when they do not apply or could not be made (the
        caller then falls back to rlimits)."""
        if memory not in ("cgroup2", "cgroup1"):
            return None
        made = cls(memory, {})
        try:
            if memory == "cgroup2":
                d = _v2_child(name)
                if d is None:
                    return None
                made.dirs["memory"] = d
                if processes == "cgroup2":
                    made.dirs["pids"] = d
            else:
                for ctrl in ("memory", "pids") if processes == "cgroup1" else ("memory",):
                    parent = _cgroup_dir(ctrl)
                    if parent is None or not parent.is_dir():
                        raise OSError(f"no cgroup v1 {ctrl} hierarchy")
                    (parent / name).mkdir()
                    made.dirs[ctrl] = parent / name
            mem = made.dirs["memory"]
            if memory == "cgroup2":
                _write(mem / "memory.max", str(limits.memory_bytes))
                if (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
            else:
                _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    try:  # no swapping past the limit (fails where swap accounting is off)
                        _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
                    except OSError:
                        pass
            if "pids" in made.dirs:
                _write(made.dirs["pids"] / "pids.max", str(limits.processes))
            return made
        except OSError:
            made._remove()
            return None

    def memory_stats(self) -> tuple[bool, int | None]:
        """(the OOM killer struck, the peak memory charge in bytes) for the memory cgroup."""
        d = self.dirs.get("memory")
        if d is None:
            return False, None
        if self.kind == "cgroup2":
            events = _keyed(d / "memory.events")
            return events.get("oom_kill", 0) > 0, _number(d / "memory.peak")
        oom = _keyed(d / "memory.oom_control")
        if "oom_kill" in oom:
            hit = oom["oom_kill"] > 0
        else:  # older kernels: the limit was reached at least once
            hit = (_number(d / "memory.failcnt") or 0) > 0
        return hit, _number(d / "memory.max_usage_in_bytes")

    def finish(self) -> tuple[bool, int | None]:
        """Kill whatever is left in the cgroups, read the memory figures, remove them."""
        self._kill_all()
        stats = self.memory_stats()
        self._remove()
        return stats

    def _kill_all(self, wait: float = 10.0) -> None:
        deadline = time.monotonic() + wait
        for d in dict.fromkeys(self.dirs.values()):
            if self.kind == "cgroup2" and (d / "cgroup.kill").exists():
                try:
                    _write(d / "cgroup.kill", "1")
                except OSError:
                    pass
        while time.monotonic() < deadline:
            pids = []
            for f in self.procs_files:
                try:
                    pids += [int(p) for p in f.read_text().split()]
                except (OSError, ValueError):
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)

    def _remove(self) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def _v2_child(name: str) -> Path | None:
    """A new v2 cgroup with the memory (and, where there, pids) controller: beside our own
    cgroup (a cgroup with processes cannot have controlled children), or under it when ours is
    the root."""
    own = _cgroup_dir("")
    if own is None or not (own / "cgroup.controllers").exists():
        return None
    parent = own if not (own.parent / "cgroup.controllers").exists() else own.parent
    d = parent / name
    try:
        d.mkdir()
    except OSError:
        return None
    try:
        have = set((d / "cgroup.controllers").read_text().split())
        if "memory" not in have:
            wanted = " ".join(f"+{c}" for c in ("memory", "pids")
                              if c in (parent / "cgroup.controllers").read_text().split())
            _write(parent / "cgroup.subtree_control", wanted)
            have = set((d / "cgroup.controllers").read_text().split())
        if "memory" not in have:
            raise OSError("no memory controller")
        return d
    except OSError:
        try:
            d.rmdir()
        except OSError:
            pass
        return None


def gpu_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


@cache
def _mechanisms() -> tuple[str, str, tuple[str, ...]]:
    """(memory mechanism, process mechanism, notes) that work on this machine."""
    notes: list[str] = []
    if sys.platform != "linux":
        return "none", "rlimit-nproc", ("memory is not limited on this platform",)
    name = f"course-probe-{secrets.token_hex(4)}"
    for kind in ("cgroup2", "cgroup1"):
        # The pids controller is optional: ask for both, then for memory alone.
        for processes in (kind, "rlimit-nproc"):
            cg = Cgroups.create(kind, processes, Limits(), name)
            if cg is not None:
                got_pids = "pids" in cg.dirs and processes == kind
                cg._remove()
                return kind, (kind if got_pids else "rlimit-nproc"), ()
    if gpu_visible():
        notes.append("memory is not limited: no usable memory cgroup, and RLIMIT_AS would stop "
                     "CUDA from starting")
        return "none", "rlimit-nproc", tuple(notes)
    if not shutil.which("prlimit"):
        notes.append("memory and processes are not limited: no usable cgroup, and no prlimit")
        return "none", "rlimit-nproc", tuple(notes)
    notes.append("no usable memory cgroup: memory is limited by RLIMIT_AS (address space)")
    return "rlimit-as", "rlimit-nproc", tuple(notes)


_MEMORY_ERROR = re.compile(
    r"\bMemoryError\b|can't allocate memory|cannot allocate memory|std::bad_alloc", re.I
)


def looks_like_memory_error(text: str) -> bool:
    """Whether `text` (a session's output, a test's message) shows an allocation refused, the
    sign of a hit under RLIMIT_AS."""
    return bool(_MEMORY_ERROR.search(text or ""))


# --- running ------------------------------------------------------------------------------------


def wrap(argv: list[str], iso: Isolation, hide: list[Path], ws: Workspace,
         limits: Limits | None = None, cgroups: Cgroups | None = None, keep: list[Path] = (),
         rlimit_as: bool = False) -> list[str]:
    """The command line that runs `argv` at isolation level `iso` in `ws`: join `cgroups`, enter
    the namespaces, mount (see mount_script), set the rlimits (RLIMIT_AS when `rlimit_as`),
    drop privileges."""
    limits = limits or iso.limits
    rl: list[str] = []
    if shutil.which("prlimit"):
        nproc = limits.processes
        if cgroups is not None and "pids" in cgroups.dirs:
            nproc = max(limits.processes, NPROC_LIMIT)  # pids.max counts; this is a backstop
        rl = ["prlimit", f"--fsize={limits.file_bytes}", f"--nproc={nproc}", "--core=0",
              *([f"--as={limits.memory_bytes}"] if rlimit_as else []), "--"]
    join: list[str] = []
    if cgroups is not None:
        join = ["/bin/sh", "-c",
                'p=$$; while [ "$1" != -- ]; do echo "$p" > "$1" || { echo "sandbox: cannot '
                f'join the cgroup $1" >&2; exit {SANDBOX_FAILED}; }}; shift; done; shift; '
                'exec "$@"', "sh", *map(str, cgroups.procs_files), "--"]
    if not iso.private_mounts:
        return [*join, *rl, *argv]
    keep_all = kept_paths(ws, list(keep))
    hidden = hidden_paths(keep_all, hidden_roots(hide))
    script = mount_script(ws, iso, limits, keep_all, readonly_paths(list(keep)), hidden, ws.tree)
    caps = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    if iso.level == "namespaces+nobody":
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *caps,
                "--"]
        return [*join, "unshare", *_NS, "--", "/bin/sh", "-c", script, "sh", *rl, *drop, *argv]
    drop = ["setpriv", *caps, "--"]
    return [*join, "unshare", "--user", "--map-root-user", *_NS, "--", "/bin/sh", "-c", script,
            "sh", *rl, *drop, *argv]


class Workspace:
    """A folder of one lab's run: `tree` (the course copy, read-only to the sandbox), the
    sandbox's own `home` and `tmp` (private tmpfs mounts at the namespace levels: what the session
    writes there never reaches the host) and `out` (a host folder the session may write and the
    grader reads back after the run)."""

    def __init__(self, parent: Path, iso: Isolation):
        self.root = Path(os.path.realpath(parent)) / f"ws-{secrets.token_hex(8)}"
        self.root.mkdir(mode=0o711)
        self.tree, self.home, self.tmp = self.root / "tree", self.root / "home", self.root / "tmp"
        self.out = self.root / "out"
        self.iso = iso

    def seal(self) -> None:
        """The tree becomes read-only to the sandbox; home, tmp and out are its own."""
        for d in (self.home, self.tmp, self.out):
            d.mkdir(mode=0o700, exist_ok=True)
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
    bin_dirs = [os.path.dirname(python()), "/usr/local/bin", "/usr/bin", "/bin"]
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
    memory_limit_hit: bool = False  # the session crossed its memory limit (see run_session)
    peak_memory_bytes: int | None = None  # the cgroup's peak charge; None under RLIMIT_AS
    memory_mechanism: str = "none"  # what limited memory in this run
    sandbox_failed: bool = False  # the sandbox could not be set up (the grader's problem)


def run_session(
    argv: list[str],
    ws: Workspace,
    env: dict[str, str],
    budget: float,
    hide: list[Path],
    on_message=None,
    *,
    limits: Limits | None = None,
    keep: list[Path] = (),
) -> SessionRun:
    """Run `argv` sandboxed in `ws`, passing it the write end of a channel as the argument
    "{channel}"; read JSON lines from the channel until it closes or `budget` seconds pass, then
    kill everything the run started. `hide`: more paths to hide (whole, or but for what leads to
    a kept path); `keep`: more paths the session must see; `limits`: default `ws.iso.limits`.

    `memory_limit_hit`: under a cgroup, the OOM killer struck in it; under RLIMIT_AS, the session's
    output or a message reads like a refused allocation (`looks_like_memory_error`)."""
    iso = ws.iso
    limits = limits or iso.limits
    r, w = os.pipe()
    token = secrets.token_hex(16)
    env = dict(env, **{TOKEN_ENV: token})
    cgroups = None
    if iso.memory.startswith("cgroup") or iso.processes.startswith("cgroup"):
        cgroups = Cgroups.create(iso.memory, iso.processes, limits, f"course-sandbox-{token}")
    if cgroups is not None:
        mechanism = cgroups.kind
    elif iso.memory == "none" or gpu_visible() or not shutil.which("prlimit"):
        mechanism = "none"
    else:  # RLIMIT_AS, asked for or as the fallback when the cgroup could not be made
        mechanism = "rlimit-as"
    cmd = wrap([a.replace("{channel}", str(w)) for a in argv], iso, hide, ws, limits, cgroups,
               list(keep), rlimit_as=mechanism == "rlimit-as")
    log_path = ws.root / "session.log"
    start = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=ws.tree, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                pass_fds=(w,), start_new_session=True,
            )
    except BaseException:
        os.close(r)
        os.close(w)
        if cgroups is not None:
            cgroups.finish()
        raise
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
        hit, peak = cgroups.finish() if cgroups is not None else (False, None)
    seconds = time.monotonic() - start
    tail = _tail(log_path)
    if mechanism.startswith("cgroup"):
        memory_hit = hit
    else:
        memory_hit = mechanism == "rlimit-as" and (
            looks_like_memory_error(_tail(log_path, 1 << 20))
            or any(looks_like_memory_error(v) for m in messages for v in m.values()
                   if isinstance(v, str))
        )
    failed = proc.returncode == SANDBOX_FAILED and "sandbox: " in tail and not messages
    return SessionRun(messages, proc.returncode, timed_out, seconds, tail, memory_hit, peak,
                      mechanism, failed)


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
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            data = f.read()
    except OSError:
        return ""
    return data.decode(errors="replace")
