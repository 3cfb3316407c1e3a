"""The grading sandbox (course/grading/sandbox.py) for real: small Python programs run through
`run_session` at the strongest levels this machine allows, and stopped by their limits, kept
from the host's files, and leaving nothing behind. A level or mechanism this machine lacks is
skipped with the reason."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from course.grading import sandbox
from course.grading.sandbox import Isolation, Limits, hidden_paths

MiB = 1 << 20
SEND = """\
import json, os, sys
CHANNEL = int(sys.argv[1])
def send(**message):
    os.write(CHANNEL, (json.dumps(message) + "\\n").encode())
"""


def _namespaces_work() -> bool:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if not (sys.platform == "linux" and unshare and setpriv):
        return False
    try:
        return subprocess.run([unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork",
                               "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def isolation(level: str, **changes) -> Isolation:
    """The probed isolation at `level` (skipped where this machine does not have it)."""
    probed = sandbox.probe()
    if level == "namespaces+nobody" and probed.level != level:
        pytest.skip(f"level namespaces+nobody needs root, unshare and setpriv here "
                    f"(probed {probed.level!r}: {'; '.join(probed.notes)})")
    if level == "namespaces" and not _namespaces_work():
        pytest.skip("level namespaces needs unprivileged user namespaces")
    iso = replace(probed, level=level, network=True, pid_namespace=True,
                  user_dropped=level == "namespaces+nobody")
    return replace(iso, **changes)


def strongest() -> str:
    return sandbox.probe().level if sandbox.probe().level != "process-group" else "namespaces"


@pytest.fixture
def session(tmp_path):
    """run(iso, code, *args, limits=..., hide=..., keep=...) runs `code` (with `send(**msg)`
    for the channel) as prog.py in a fresh workspace under tmp_path; returns (run, ws). The
    workspaces are removed afterwards."""
    made = []

    def run(iso: Isolation, code: str, *args: str, limits: Limits | None = None,
            hide=(), keep=(), parent: Path | None = None, files: dict | None = None):
        ws = sandbox.Workspace(parent or tmp_path, iso)
        made.append(ws)
        ws.tree.mkdir()
        (ws.tree / "prog.py").write_text(SEND + code)
        for name, text in (files or {}).items():
            (ws.tree / name).write_text(text)
        ws.seal()
        result = sandbox.run_session(
            [sys.executable, "prog.py", "{channel}", *args], ws, sandbox.minimal_env(ws, {}),
            60, list(hide), limits=limits, keep=list(keep))
        return result, ws

    yield run
    for ws in made:
        ws.remove()


def the(run, kind: str) -> dict:
    found = [m for m in run.messages if m.get("kind") == kind]
    assert found, f"no {kind!r} message; session log:\n{run.log_tail}"
    return found[-1]


# --- (a) memory ----------------------------------------------------------------------------------

GROW = """\
blocks = []
def high_water():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
for step in range(1, 33):  # 64 MiB at a time, up to 2 GiB
    blocks.append(b"\\x01" * (64 << 20))
    send(kind="step", step=step, rss=high_water())
"""


@pytest.mark.parametrize("mechanism", ["cgroup", "rlimit-as"])
def test_a_growing_process_is_stopped_at_the_memory_limit(session, mechanism):
    probed = sandbox.probe()
    if mechanism == "cgroup":
        if not probed.memory.startswith("cgroup"):
            pytest.skip(f"no usable memory cgroup here (memory limited by {probed.memory})")
        iso = isolation(strongest())
    else:
        if sandbox.gpu_visible():
            pytest.skip("RLIMIT_AS is not used where a GPU is visible")
        iso = isolation(strongest(), memory="rlimit-as", processes="rlimit-nproc")
    limit = 512 * MiB
    run, _ = session(iso, GROW, limits=Limits(memory_bytes=limit))
    steps = [m for m in run.messages if m.get("kind") == "step"]
    assert run.memory_limit_hit, run.log_tail
    assert run.memory_mechanism == (probed.memory if mechanism == "cgroup" else "rlimit-as")
    assert 3 <= len(steps) < 32, run.log_tail  # it did allocate, and it was stopped
    assert max(m["rss"] for m in steps) <= limit
    if mechanism == "cgroup":
        assert run.peak_memory_bytes is not None and run.peak_memory_bytes <= limit
        assert run.returncode != 0 and not run.timed_out
    else:
        assert "MemoryError" in run.log_tail


def test_the_memory_error_texts_are_recognised():
    for text in ("MemoryError", "RuntimeError: [enforce fail at alloc_cpu.cpp:117] "
                 "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
                 "OSError: [Errno 12] Cannot allocate memory", "terminate called after "
                 "throwing an instance of 'std::bad_alloc'"):
        assert sandbox.looks_like_memory_error(text), text
    for text in ("", "AssertionError: 3 != 4", "torch.OutOfMemoryError: CUDA out of memory"):
        assert not sandbox.looks_like_memory_error(text), text


# --- (b) private, size-limited /tmp, /dev/shm, HOME and TMPDIR ----------------------------------

WRITE = """\
name = sys.argv[2]
for folder in ("/tmp", "/dev/shm", os.environ["HOME"], os.environ["TMPDIR"]):
    written, error = 0, None
    try:
        with open(os.path.join(folder, name), "wb") as f:
            for _ in range(100):  # 100 MiB, 1 MiB at a time
                f.write(b"\\x02" * (1 << 20))
                f.flush()
                written += 1 << 20
    except OSError as exc:
        error = exc.errno
    send(kind="wrote", folder=folder, written=written, errno=error)
"""


@pytest.mark.parametrize("level", ["namespaces+nobody", "namespaces"])
def test_writes_stop_at_their_limits_and_leave_nothing_behind(session, level):
    iso = isolation(level)
    name = f"course-sandbox-test-{secrets.token_hex(6)}"
    cap = 32 * MiB
    run, ws = session(iso, WRITE, name,
                      limits=Limits(tmp_bytes=cap, shm_bytes=cap, home_bytes=cap))
    wrote = {m["folder"]: m for m in run.messages if m.get("kind") == "wrote"}
    assert set(wrote) == {"/tmp", "/dev/shm", str(ws.home), str(ws.tmp)}, run.log_tail
    for folder, m in wrote.items():
        assert m["errno"] == errno.ENOSPC, (folder, m)
        assert cap - 4 * MiB <= m["written"] <= cap, (folder, m)
    for folder in (Path("/tmp"), Path("/dev/shm"), ws.home, ws.tmp):
        assert not (folder / name).exists(), folder
    assert os.listdir(ws.home) == [] and os.listdir(ws.tmp) == []
    assert not run.memory_limit_hit


# --- (c) the host is hidden ---------------------------------------------------------------------

LOOK = """\
import importlib
def attempt(what, action):
    try:
        return repr(action())[:200]
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.errno}"
checkout, staging, course_git = sys.argv[2:5]
import mymod, pytest
send(kind="look",
     uid=os.getuid(),
     mymod=mymod.VALUE,
     caps=[l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0],
     secret=attempt("read", lambda: open(os.path.join(checkout, "test_lab.py")).read()),
     git=attempt("read", lambda: open(os.path.join(checkout, ".git", "config")).read()),
     venv=attempt("read", lambda: open(os.path.join(checkout, ".venv", "ok.txt")).read()),
     staging=attempt("list", lambda: os.listdir(staging)),
     course_git=attempt("read", lambda: open(course_git, "rb").read()) if course_git else None,
     root=attempt("list", lambda: os.listdir("/root")),
     write_tree=attempt("write", lambda: open("new.py", "w").write("x")),
     write_out=attempt("write", lambda: open("../out/result.json", "w").write("{}")))
"""


@pytest.fixture
def checkout():
    """A fake instructor's checkout outside /tmp (in this repository's root): a test file, a
    .git/config with a token, and a .venv that must stay readable."""
    try:
        root = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=sandbox.COURSE_ROOT))
    except OSError as exc:
        pytest.skip(f"cannot write a fake checkout beside the course: {exc}")
    (root / "test_lab.py").write_text("SECRET = 'the instructor's tests'\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[http]\n\textraheader = AUTHORIZATION: token\n")
    (root / ".venv").mkdir()
    (root / ".venv" / "ok.txt").write_text("environment")
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("level", ["namespaces+nobody", "namespaces"])
@pytest.mark.parametrize("where", ["workspace in /tmp", "workspace outside /tmp"])
def test_the_host_is_hidden_but_the_workspace_and_python_are_not(session, checkout, level,
                                                                 where):
    iso = isolation(level)
    staging = Path(tempfile.mkdtemp(prefix="course-grade-"))  # another grading run
    try:
        (staging / "submission.py").write_text("x = 1\n")
        course_git = sandbox.COURSE_ROOT / ".git"
        parent = checkout / "work" if where == "workspace outside /tmp" else None
        if parent:
            parent.mkdir(mode=0o711)
        run, ws = session(
            iso, LOOK, str(checkout), str(staging),
            str(course_git) if course_git.exists() else "",
            hide=[checkout], keep=[checkout / ".venv"], parent=parent,
            files={"mymod.py": "VALUE = 42\n"},
        )
    finally:
        shutil.rmtree(staging)
    look = the(run, "look")
    assert look["mymod"] == 42 and look["caps"] == "0000000000000000"
    assert look["uid"] == (65534 if level == "namespaces+nobody" else 0)
    # Hidden: a file reads as empty (it is /dev/null), a folder cannot be entered.
    hidden = ("''", "b''", f"PermissionError: {errno.EACCES}",
              f"FileNotFoundError: {errno.ENOENT}")
    assert look["secret"] in hidden and look["git"] in hidden, look
    assert look["venv"] == repr("environment")
    assert look["staging"] == f"FileNotFoundError: {errno.ENOENT}"
    if look["course_git"] is not None:
        assert look["course_git"] in hidden, look
    if level == "namespaces+nobody" and Path("/root").is_dir():
        assert look["root"] == f"PermissionError: {errno.EACCES}"
    # The course copy is read-only: a bind mount, whoever owns the files.
    assert look["write_tree"] in (f"OSError: {errno.EROFS}", f"PermissionError: {errno.EACCES}")
    if level == "namespaces":
        assert look["write_tree"] == f"OSError: {errno.EROFS}"
    assert look["write_out"] == "2"
    assert (ws.out / "result.json").read_text() == "{}"
    assert run.returncode == 0 and not run.memory_limit_hit


# --- (d) hidden_paths ---------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    for d in ("a/keep/deep", "a/other", "b"):
        (root / d).mkdir(parents=True)
    (root / "a" / "file.txt").write_text("x")
    (root / "a" / "keep" / "deep" / "f").write_text("x")
    (root / "link").symlink_to(root / "a" / "keep")
    return root


def test_hidden_paths_hide_a_root_whole_unless_it_leads_to_a_kept_path(tree):
    keep = [tree / "a" / "keep"]
    assert hidden_paths(keep, [tree]) == [tree / "a" / "file.txt", tree / "a" / "other",
                                          tree / "b"]
    assert hidden_paths(keep, [tree / "b"]) == [tree / "b"]
    assert hidden_paths([tree / "b"], [tree / "a"]) == [tree / "a"]
    assert hidden_paths(keep, [tree / "a" / "keep"]) == []  # a kept path is left alone


def test_hidden_paths_follow_kept_paths_through_links_and_skip_links(tree):
    # Kept through a symbolic link: what it resolves to stays; the link itself is never hidden.
    got = hidden_paths([tree / "link" / "deep"], [tree])
    assert tree / "link" not in got and tree / "a" / "keep" not in got
    assert tree / "a" / "other" in got and tree / "b" in got
    # A root given through a link is hidden where it really is.
    assert hidden_paths([], [tree / "link"]) == [tree / "a" / "keep"]


def test_hidden_paths_repeat_nothing_and_skip_what_is_missing(tree):
    keep = [tree / "a" / "keep"]
    got = hidden_paths(keep, [tree, tree / "b", tree / "a", tree / "missing"])
    assert got == [tree / "a" / "file.txt", tree / "a" / "other", tree / "b"]
    # A root inside a kept path was asked for explicitly: it is hidden.
    assert hidden_paths(keep, [tree / "a" / "keep" / "deep"]) == [tree / "a" / "keep" / "deep"]


def test_the_default_roots_hide_the_checkout_but_keep_python():
    keep = sandbox.kept_paths()
    got = hidden_paths(keep, sandbox.hidden_roots([]))
    assert Path("/") not in got and Path("/usr") not in got and Path("/tmp") not in got
    prefix = Path(os.path.realpath(sys.prefix))
    assert not any(h == prefix or h in prefix.parents or prefix in h.parents for h in got)
    if (sandbox.COURSE_ROOT / "tests").exists() and not sandbox.COURSE_ROOT.is_relative_to(
            prefix):
        assert sandbox.COURSE_ROOT / "tests" in got or any(
            h in (sandbox.COURSE_ROOT / "tests").parents for h in got)
    for folder in ("/home", "/root", "/srv", "/opt", "/mnt", "/media", "/var"):
        p = Path(folder)
        if p.is_dir() and not p.is_symlink() and not any(
                k == p or p in k.parents for k in map(Path, map(os.path.realpath, keep))):
            assert p in got, folder


# --- (e) processes ------------------------------------------------------------------------------

FORK = """\
import time
forked, error = 0, None
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as exc:
        error = exc.errno
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    forked += 1
send(kind="forked", forked=forked, errno=error)
"""


@pytest.mark.parametrize("mechanism", ["cgroup", "rlimit-nproc"])
def test_the_process_limit_holds_and_nothing_outlives_the_run(session, mechanism):
    probed = sandbox.probe()
    if mechanism == "cgroup":
        if not probed.processes.startswith("cgroup"):
            pytest.skip(f"no usable pids cgroup here (processes limited by {probed.processes})")
        iso = isolation(strongest())
    else:
        # RLIMIT_NPROC binds only a user that is not root: the nobody level.
        iso = isolation("namespaces+nobody", processes="rlimit-nproc")
    run, ws = session(iso, FORK, limits=Limits(processes=32))
    forked = the(run, "forked")
    assert forked["errno"] == errno.EAGAIN and 8 <= forked["forked"] < 32, forked
    assert run.seconds < 30  # the sleeping children did not hold the run open
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        assert not (b"prog.py" in cmdline and str(ws.root).encode() in environ), (
            f"process {entry.name} outlived the run")


LOOPBACK = """\
import socket
own = socket.create_server(("127.0.0.1", 0))
talk = socket.create_connection(own.getsockname(), timeout=5)
peer, _ = own.accept()
talk.sendall(b"ping")
heard = peer.recv(4).decode()
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=5).close()
    host = "reached"
except OSError as exc:
    host = type(exc).__name__
send(kind="loopback", heard=heard, host=host)
"""


@pytest.mark.parametrize("level", ["namespaces", "namespaces+nobody"])
def test_a_session_talks_to_itself_over_loopback_but_not_to_the_host(session, level):
    """The session's network namespace has its own loopback, up (torch.distributed's gloo needs
    one, lab 04-05): its processes connect to each other over 127.0.0.1, and a server listening
    on the host's 127.0.0.1 is out of reach."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as host:
        run, _ = session(isolation(level), LOOPBACK, str(host.getsockname()[1]))
    seen = the(run, "loopback")
    assert seen["heard"] == "ping", run.log_tail
    assert seen["host"] == "ConnectionRefusedError", seen


def test_the_session_cgroup_is_removed():
    probed = sandbox.probe()
    if not probed.memory.startswith("cgroup"):
        pytest.skip(f"no usable memory cgroup here (memory limited by {probed.memory})")
    cg = sandbox.Cgroups.create(probed.memory, probed.processes, Limits(), "course-sandbox-t")
    assert cg is not None
    dirs = list(cg.dirs.values())
    assert all(d.is_dir() for d in dirs)
    hit, peak = cg.finish()
    assert not hit and (peak is None or peak >= 0)
    assert not any(d.exists() for d in dirs)


# --- the record and the refusal -----------------------------------------------------------------


def test_isolation_records_its_limits_and_mechanisms():
    iso = sandbox.probe(Limits(memory_bytes=2 << 30))
    record = iso.as_dict()
    assert record["limits"]["memory_bytes"] == 2 << 30
    assert record["limits"] == Limits(memory_bytes=2 << 30).as_dict()
    assert record["memory_limit"] in ("cgroup2", "cgroup1", "rlimit-as", "none")
    assert record["process_limit"] in ("cgroup2", "cgroup1", "rlimit-nproc")
    json.dumps(record)


def test_require_refuses_weak_isolation_unless_allowed():
    weak = Isolation("process-group", notes=("not running as root",), memory="rlimit-as")
    with pytest.raises(sandbox.IsolationError, match="weaker than 'namespaces\\+nobody'.*"
                       "--allow-weak-isolation"):
        sandbox.require(weak)
    sandbox.require(weak, allow_weak=True)
    sandbox.require(Isolation("namespaces+nobody", True, True, True, memory="cgroup2"))
    with pytest.raises(sandbox.IsolationError, match="no memory limit"):
        sandbox.require(Isolation("namespaces+nobody", True, True, True, memory="none"))


# --- a grader that is not root -------------------------------------------------------------------

AS_A_USER = """\
import json, os, sys, tempfile
from pathlib import Path
from course.grading import sandbox
iso = sandbox.probe()
if iso.level != "namespaces":
    print(json.dumps({"skip": f"{iso.level}: {'; '.join(iso.notes)}"}))
    sys.exit()
parent, name = Path(sys.argv[1]), sys.argv[2]
ws = sandbox.Workspace(parent, iso)
ws.tree.mkdir()
(ws.tree / "prog.py").write_text(
    "import os\\n"
    f"open('/tmp/{name}', 'w').write('x')\\n"
    "blocks = [b'x' * (64 << 20) for _ in range(32)]\\n")
ws.seal()
run = sandbox.run_session([sys.executable, "prog.py"], ws, sandbox.minimal_env(ws, {}), 60, [],
                          limits=sandbox.Limits(memory_bytes=512 << 20))
ws.remove()
print(json.dumps({"level": iso.level, "memory": run.memory_mechanism,
                  "hit": run.memory_limit_hit, "log": run.log_tail}))
"""


def _nobody_runs(python: str) -> bool:
    return subprocess.run(
        ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups",
         "/bin/sh", "-c", 'exec "$0" -c "import json"', python],
        capture_output=True, timeout=60).returncode == 0


def test_a_grader_that_is_not_root_gets_the_namespaces_level():
    """The grader run by a plain user (nobody here): user namespaces, RLIMIT_AS, and the same
    private /tmp. Mounts in a user namespace must not touch the host's mount table (mount -n)."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv:
        pytest.skip("needs root (to start a grader as nobody) and setpriv")
    python = next((p for p in (sys.executable, shutil.which("python3"), "/usr/bin/python3")
                   if p and _nobody_runs(p)), None)
    if python is None:
        pytest.skip("user nobody can run no Python here")
    parent = Path(tempfile.mkdtemp(prefix="course-sandbox-user-"))
    try:
        os.chown(parent, sandbox.NOBODY, sandbox.NOBODY)
        name = f"course-sandbox-test-{secrets.token_hex(6)}"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(parent),
               "PYTHONPATH": str(sandbox.COURSE_ROOT)}
        proc = subprocess.run(
            [setpriv, f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}",
             "--clear-groups", python, "-c", AS_A_USER, str(parent), name],
            cwd=parent, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if "skip" in result:
            pytest.skip(f"user nobody gets no user namespace here ({result['skip']})")
        assert result["memory"] == "rlimit-as" and result["hit"], result["log"]
        assert not (Path("/tmp") / name).exists()
        assert os.listdir(parent) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)
