"""The grading session's pytest plugin (loaded only by `python -m course grade`, `-p`).

Two modes:

--course-manifest PATH   collect only (in the instructor's checkout, before any student code
                         runs) and write every test's id, weight, tier and skip reason as JSON.
--course-channel FD      run the lab: the session process collects the tests but never imports
                         the student's code. In a lab whose code runs in a student's process
                         (course.labs.student_process), each test runs here, in the session,
                         and only the student's process is forked for it. In any other lab,
                         each test runs in a forked child (its own process group) that reports
                         one JSON message through a pipe of its own. The session forwards what
                         it verified to the grader through FD, which no process that runs
                         student code holds.

A child that dies before reporting (os._exit, a signal, a crash) or outlives its timeout scores
what the session saw, not what the child chose: "exited", "crashed", "timed out".
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
import types
from pathlib import Path

import pytest

import course.labs.loader as loader
from course.labs.catalog import lab_for_path
from course.labs.student_process import not_dumpable

# Seconds a child gets past its pytest-timeout before the session kills it: pytest-timeout fails
# a cooperative test with a traceback; the kill stops one that ignores the signal.
KILL_GRACE = 5.0
MAX_MESSAGE = 64 * 1024


def pytest_addoption(parser):
    group = parser.getgroup("course grading")
    group.addoption("--course-manifest", metavar="PATH", default=None)
    group.addoption("--course-channel", metavar="FD", type=int, default=None)
    group.addoption("--course-spec", metavar="PATH", default=None)


# --- manifest (collect only, instructor's code) -------------------------------------------------


def _skip_reason(item) -> str | None:
    from _pytest.skipping import evaluate_skip_marks

    skipped = evaluate_skip_marks(item)
    return skipped.reason if skipped else None


def _timeout_of(item) -> float | None:
    try:
        import pytest_timeout

        return pytest_timeout._get_item_settings(item).timeout
    except Exception:
        return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    path = config.getoption("--course-manifest")
    if not path:
        return
    tests = []
    for item in items:
        marker = item.get_closest_marker("points")
        tests.append(
            {
                "nodeid": item.nodeid,
                "lab": lab_for_path(item.path).id,
                "weight": float(marker.args[0]) if marker and marker.args else 1.0,
                "starter_ok": item.get_closest_marker("starter_ok") is not None,
                "tier": "gpu" if item.get_closest_marker("cuda") else "cpu",
                "skip": _skip_reason(item),
            }
        )
    Path(path).write_text(json.dumps({"tests": tests}, indent=1), encoding="utf-8")


def pytest_collectreport(report):
    channel = _CHANNEL.get("fd")
    if channel is not None and report.failed:
        _send(channel, {"type": "collect_error", "nodeid": report.nodeid,
                        "message": str(report.longrepr)[-2000:]})


# --- run mode -----------------------------------------------------------------------------------

_CHANNEL: dict[str, int] = {}


def pytest_configure(config):
    fd = config.getoption("--course-channel")
    if fd is None:
        return
    _CHANNEL["fd"] = fd
    spec_path = config.getoption("--course-spec")
    config._course_spec = json.loads(Path(spec_path).read_text()) if spec_path else {}
    not_dumpable()
    _guard_session()


def _guard_session() -> None:
    """The session process must never import the student's starter: only forked children do,
    and for a lab whose code runs in a student's process (course.labs.student_process), only
    that process (and the reference check's own child) does: the test's process never holds the
    student's code, so nothing the student writes runs beside the test's verdict."""
    session_pid = os.getpid()
    original = loader.load_module

    def guarded(lab_dir, impl, lab_id):
        if impl == "starter" and os.getpid() == session_pid:
            raise loader.LabImplError(
                f"lab {lab_id}: the grading session does not import student code; a test "
                "module touched `lab.<name>` outside a test or fixture"
            )
        if (impl == "starter" and loader.runs_in_student_process(lab_id)
                and not _REFERENCE_CHECK.get("pid") == os.getpid()):
            raise loader.LabImplError(
                f"lab {lab_id}: the student's code runs in a process of its own here; a test "
                "loaded it in the test's process (use `lab.<name>` through load_lab)"
            )
        return original(lab_dir, impl, lab_id)

    loader.load_module = guarded


_REFERENCE_CHECK: dict[str, int] = {}


def _send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    fd = _CHANNEL.get("fd")
    if fd is None:
        return None
    config = session.config
    spec = config._course_spec
    _send(fd, {"type": "start", "items": len(session.items), "pid": os.getpid()})
    from course.labs import student_process

    if student_process.enabled() and session.items:  # once here, not in every test's
        student_process.warm(session.items[0].path.parent)  # student process
    in_session = _runs_in_student_process(session.items)
    if in_session:
        sys.stdin = open(os.devnull)
    if spec.get("reference_check") and loader.chosen_impl() == "starter" and session.items:
        reference = _in_child(fd, lambda: _reference_check(session, spec),
                              float(spec.get("test_timeout", 60)))
        _send(fd, {"type": "reference", **reference})
        if reference.get("findings") or reference.get("error"):
            # The lab scores 0 whatever its tests say (it takes the reference, or the student's
            # module does not load): running them would only cost time.
            _send(fd, {"type": "done"})
            return True
    for item in session.items:
        reason = _skip_reason(item)
        if reason is not None:
            _send(fd, {"type": "test", "nodeid": item.nodeid, "outcome": "skipped",
                       "kind": "skipped", "message": reason, "duration": 0.0})
            continue
        timeout = _timeout_of(item) or float(spec.get("test_timeout", 60))
        start = time.perf_counter()
        grace = float(spec.get("kill_grace", KILL_GRACE))
        if in_session:
            result = _in_session(lambda item=item: _run_test(item), timeout, grace)
        else:
            result = _in_child(fd, lambda item=item: _run_test(item), timeout, grace)
        result = _checked(result)
        _send(fd, {"type": "test", "nodeid": item.nodeid, **result,
                   "duration": round(time.perf_counter() - start, 3)})
    _send(fd, {"type": "done"})
    return True


def _runs_in_student_process(items) -> bool:
    """The session's tests are a lab's whose code runs in a student's process: no student code
    runs in those tests, so they need no process of their own."""
    from course.labs import student_process

    if not items or not student_process.enabled():
        return False
    try:
        lab = lab_for_path(items[0].path)
    except ValueError:  # tests outside the course's labs
        return False
    return loader.runs_in_student_process(lab.id)


_OUTCOMES = {"passed", "failed", "not_implemented", "skipped"}


def _checked(result: dict) -> dict:
    """Keep only the fields the grader reads, with the types it expects."""
    outcome = result.get("outcome")
    if outcome not in _OUTCOMES | {"timed_out", "crashed", "exited"}:
        return {"outcome": "crashed", "kind": "protocol",
                "message": "the test's process sent a malformed report"}
    return {
        "outcome": outcome,
        "kind": str(result.get("kind", ""))[:40],
        "message": str(result.get("message", ""))[:2000],
        "detail": str(result.get("detail", ""))[:6000],
    }


def _in_child(channel: int, work, timeout: float, grace: float = KILL_GRACE) -> dict:
    """Run `work()` in a forked child with its own process group; return its one message, or
    what the session observed when it sent none."""
    r, w = os.pipe()
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"course-test-{os.getpid()}.log"
    pid = os.fork()
    if pid == 0:  # the child: from here on, student code may run
        try:
            os.setpgid(0, 0)
            os.close(r)
            os.close(channel)
            log = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.stdin = open(os.devnull)
            message = work()
        except BaseException as exc:  # noqa: B036 - report anything rather than nothing
            message = {"outcome": "failed", "kind": "harness",
                       "message": f"{type(exc).__name__}: {exc}"}
        try:
            _send(w, message)
        finally:
            os._exit(0)
    os.close(w)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    data, deadline, timed_out, status = b"", time.monotonic() + timeout + grace, False, None
    eof = False
    # Read until the child has exited and its message is drained (a process it left behind may
    # hold the pipe open: that does not make the test wait), or until the deadline.
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            _kill_group(pid)
            _, status = os.waitpid(pid, 0)
            break
        if eof:
            time.sleep(min(left, 0.02))
        elif select.select([r], [], [], min(left, 0.05))[0]:
            chunk = os.read(r, 65536)
            data += chunk
            eof = not chunk or len(data) > MAX_MESSAGE
            if chunk:
                continue
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            os.set_blocking(r, False)
            try:
                while not eof and len(data) <= MAX_MESSAGE and (chunk := os.read(r, 65536)):
                    data += chunk
            except BlockingIOError:
                pass
    os.close(r)
    _kill_group(pid)  # whatever the test left running
    tail = _tail(out_path)
    if timed_out:
        return {"outcome": "timed_out", "kind": "timeout",
                "message": f"timed out: still running after {timeout:g} s (killed)",
                "detail": tail}
    try:
        message = json.loads(data.decode())
        if not isinstance(message, dict):
            raise ValueError
        return message
    except ValueError:
        pass
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return {"outcome": "crashed", "kind": "signal",
                "message": f"crashed: the test's process died of {sig}", "detail": tail}
    code = os.WEXITSTATUS(status)
    return {"outcome": "exited", "kind": "exit",
            "message": f"exited: the test's process ended (exit code {code}) without reporting "
            f"a result (os._exit, sys.exit or pytest.exit in student code?)", "detail": tail}


def _in_session(work, timeout: float, grace: float) -> dict:
    """Run `work()` here, for a test that holds no student code (its lab's code runs in a
    student's process, which the test forks and `stop_all` ends). As in a child, what the test
    and the student's process print goes to a file of the test's own, and a test still waiting
    on the student's process `grace` seconds past its timeout (pytest-timeout failed to end it)
    is ended by killing that process: its requests then fail, and the test reads "timed out"."""
    from course.labs import student_process

    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"course-test-{os.getpid()}.log"
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    overran = threading.Event()

    def overrun():
        overran.set()
        student_process.kill_all()

    watchdog = threading.Timer(timeout + grace, overrun)
    watchdog.daemon = True
    watchdog.start()
    try:
        message = work()
    except BaseException as exc:  # noqa: B036 - report anything rather than nothing
        message = {"outcome": "failed", "kind": "harness",
                   "message": f"{type(exc).__name__}: {exc}"}
    finally:
        watchdog.cancel()
        student_process.stop_all()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the file is going away anyway
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    tail = _tail(out_path)
    if overran.is_set():
        return {"outcome": "timed_out", "kind": "timeout",
                "message": f"timed out: still running after {timeout:g} s (the student's "
                "process was killed)", "detail": tail}
    return message


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _tail(path: Path, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            text = f.read().decode(errors="replace")
        path.unlink()
        return text
    except OSError:
        return ""


# --- inside a child -----------------------------------------------------------------------------


def _hook_snapshot(config) -> dict:
    """Every registered plugin, and every hook's implementations (pytest adds hook callers
    lazily, so only hooks present in both snapshots are compared)."""
    hooks = {
        name: tuple(id(impl.function) for impl in caller.get_hookimpls())
        for name, caller in vars(config.hook).items()
        if hasattr(caller, "get_hookimpls")
    }
    return {"plugins": {id(p) for p in config.pluginmanager.get_plugins()}, "hooks": hooks}


def _tampered(before: dict, after: dict) -> list[str]:
    changed = [f"{len(after['plugins'] - before['plugins'])} plugin(s) registered"] if (
        after["plugins"] - before["plugins"]) else []
    hooks_b, hooks_a = before["hooks"], after["hooks"]
    return changed + sorted(n for n in hooks_b.keys() & hooks_a.keys() if hooks_b[n] != hooks_a[n])


def _code_snapshot(item) -> dict:
    """The functions a test relies on: its module's, the course's checking helpers', builtins',
    and the test item's own method and function."""
    import builtins

    snap = {}
    for module in (getattr(item, "module", None), sys.modules.get("course.labs.numerics"),
                   sys.modules.get("course.labs.loader"), builtins):
        if module is None:
            continue
        for name, value in list(vars(module).items()):
            code = getattr(value, "__code__", None)
            if callable(value):
                snap[f"{module.__name__}.{name}"] = (id(value), id(code))
    obj = getattr(item, "obj", None)
    func = getattr(obj, "__func__", obj)  # a unittest item's obj is a fresh bound method
    snap["the test item"] = ("runtest" in vars(item), id(func), id(getattr(func, "__code__", None)))
    return snap


def _code_changed(before: dict, item) -> list[str]:
    after = _code_snapshot(item)
    return [f"{name} was replaced" for name, value in before.items() if after.get(name) != value]


def _refuse_plugins(config):
    """Refuse new plugins while a test runs; returns what allows them again (for the session
    that runs its tests itself)."""
    def refuse(*args, **kwargs):
        raise RuntimeError("registering a pytest plugin is not allowed while grading")

    manager = config.pluginmanager
    manager.register = refuse
    manager.import_plugin = refuse

    def allow():
        for name in ("register", "import_plugin"):
            vars(manager).pop(name, None)

    return allow


def _run_test(item) -> dict:
    """setup, call, teardown; the outcome is decided here from the exceptions raised, without
    pytest's report hooks (which a plugin registered by student code could rewrite), and void
    when the set of plugins or hook implementations changed while the test ran."""
    config = item.config
    try:  # pytest-timeout fails a cooperative test with a traceback; the session kills the rest
        import pytest_timeout

        settings = pytest_timeout._get_item_settings(item)
        if settings.timeout:
            config.hook.pytest_timeout_set_timer(item=item, settings=settings)
    except Exception:
        pass
    before = _hook_snapshot(config)
    allow_plugins = _refuse_plugins(config)
    result = {"outcome": "passed", "kind": "", "message": ""}
    # The phases go through pytest's hooks (fixtures such as caplog and capsys rely on the
    # logging and capture plugins' wrappers), but the outcome is decided here, from what they
    # raise; a plugin added meanwhile (which could swallow an exception) is caught below.
    code_before = _code_snapshot(item)
    changed: list[str] = []
    try:
        item.ihook.pytest_runtest_setup(item=item)
        # A plugin added during setup could wrap the call and leave before the end: look now.
        changed = _tampered(before, _hook_snapshot(config)) + _code_changed(code_before, item)
        if not changed:
            item.ihook.pytest_runtest_call(item=item)
            recorded = _recorded_failure(item)
            if recorded is not None:
                raise recorded
    except BaseException as exc:  # noqa: B036
        result = _classify(exc, item)
    try:
        # What pytest's report hooks would have recorded for fixtures that read it at teardown
        # (tmp_path keeps or removes its folder by the outcome).
        from _pytest.tmpdir import tmppath_result_key

        item.stash.setdefault(tmppath_result_key, {}).update(
            setup=True, call=result["outcome"] == "passed")
    except Exception:
        pass
    try:
        cancel = getattr(item, "cancel_timeout", None)
        if cancel:
            cancel()
        item.ihook.pytest_runtest_teardown(item=item, nextitem=None)
    except BaseException as exc:  # noqa: B036
        if result["outcome"] == "passed":
            result = _classify(exc, item)
            result["message"] = "in teardown: " + result["message"]
    changed = changed or (_tampered(before, _hook_snapshot(config))
                          + _code_changed(code_before, item))
    allow_plugins()
    if changed:
        return {"outcome": "failed", "kind": "tampered",
                "message": "the test's machinery changed while it ran: "
                + ", ".join(changed[:5])}
    return result


def _recorded_failure(item) -> BaseException | None:
    """A unittest.TestCase item (Hypothesis's stateful machines are some) does not raise: the
    TestCase's result object, which is the item, records the failure and pytest reports it from
    there (its unittest plugin's makereport). The first one recorded, as pytest takes it."""
    recorded = getattr(item, "_excinfo", None)
    if isinstance(recorded, list) and recorded:
        return getattr(recorded[0], "value", None)
    return None


def _classify(exc: BaseException, item) -> dict:
    from _pytest.outcomes import Exit, Failed, Skipped

    from course.labs.feedback import not_implemented_line as _not_implemented_line

    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    detail += getattr(exc, "student_traceback", "")  # the frames in the student's process
    if isinstance(exc, Skipped):
        return {"outcome": "skipped", "kind": "skipped", "message": str(exc.msg)}
    line = _not_implemented_line(exc)
    if line is not None:
        kind = "import" if line.startswith("CANNOT LOAD") else "not_implemented"
        outcome = "failed" if kind == "import" else "not_implemented"
        return {"outcome": outcome, "kind": kind, "message": line, "detail": detail}
    if isinstance(exc, Failed) and str(exc).startswith("Timeout"):
        # The test's process is well (it waited on the student's process, or the test is
        # cooperative): what overran is the code under test.
        return {"outcome": "timed_out", "kind": "timeout",
                "message": f"timed out: {str(exc).splitlines()[0][:200]}", "detail": detail}
    if getattr(exc, "outcome", None) in ("exited", "crashed"):  # the student's process ended
        return {"outcome": exc.outcome, "kind": "exit" if exc.outcome == "exited" else "signal",
                "message": f"{exc.outcome}: {str(exc)[:300]}", "detail": detail}
    if isinstance(exc, (AssertionError, Failed)):
        kind = "assertion"
    elif isinstance(exc, (SystemExit, KeyboardInterrupt, Exit)):
        kind = "exit"
    else:
        kind = "error"
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    where = _where(exc)
    return {"outcome": "failed", "kind": kind, "message": message + where, "detail": detail}


def _where(exc: BaseException) -> str:
    if getattr(exc, "student_where", ""):  # raised in the student's process
        return f"  ({exc.student_where})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"  ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


# --- the reference check (a child of its own) ---------------------------------------------------


def _reference_check(session, spec) -> dict:
    """Does the student's starter take the reference's objects instead of writing them?

    The names to check come from the published starter (spec), not from the student's `__all__`;
    the module is the one the loader returned, not whatever sys.modules holds afterwards; and a
    finding counts only when the published starter does not show it too (its given helpers).
    """
    _REFERENCE_CHECK["pid"] = os.getpid()
    item = session.items[0]
    lab = lab_for_path(item.path)
    solution = loader.load_module(lab.path, "solution", lab.id)
    refs = {name: getattr(solution, name) for name in spec["tasks"] if hasattr(solution, name)}
    published = types.ModuleType(loader.module_name(lab.id, "published"))
    published.__file__ = str(lab.path / "starter.py")
    sys.modules[published.__name__] = published
    exec(compile(spec["published_source"], published.__file__, "exec"), published.__dict__)
    allowed = _findings(published, refs)
    try:
        student = loader.load_module(lab.path, "starter", lab.id)
    except Exception as exc:
        return {"findings": [], "error": str(exc)[:500]}
    return {"findings": sorted(_findings(student, refs) - allowed)}


def _functions_of(value) -> list:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    if isinstance(value, types.FunctionType):
        return [value]
    # A Triton kernel (compiled or interpreted): the Python function it was made from.
    made_from = getattr(value, "fn", None)
    if isinstance(made_from, types.FunctionType) and type(value).__module__.startswith("triton."):
        return [made_from]
    return []


# Code this short (in bytes of bytecode) is too common to say that it was copied.
MIN_COPIED_CODE = 64


def _shape(code: types.CodeType) -> tuple:
    """What a function's code is, whatever its name, file or local names: its bytecode, the
    global and attribute names it uses and its constants. The reference's source run again
    (exec, a copied file) has the reference's shape under new objects."""
    consts = tuple(_shape(c) if isinstance(c, types.CodeType) else repr(c)
                   for c in code.co_consts)
    return (code.co_code, code.co_names, consts)


def _code_objects(obj) -> list[types.CodeType]:
    """The code objects of a function or of a class's methods (its bases' too), nested code
    included, each once."""
    funcs = []
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if klass.__module__ == "builtins":
                continue
            for value in vars(klass).values():
                funcs.extend(_functions_of(value))
    else:
        funcs.extend(_functions_of(obj))
    stack = [f.__code__ for f in funcs if hasattr(f, "__code__")]
    found: dict[int, types.CodeType] = {}
    while stack:
        code = stack.pop()
        if id(code) not in found:
            found[id(code)] = code
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return list(found.values())


def _course_code(code: types.CodeType) -> bool:
    where = code.co_filename
    return not (where.startswith((sys.prefix, sys.base_prefix, "<")) or "site-packages" in where)


def _findings(module, refs: dict) -> set[str]:
    ref_ids = {id(obj): name for name, obj in refs.items()}
    ref_codes: dict[int, str] = {}
    ref_shapes: dict[tuple, str] = {}
    for name, obj in refs.items():
        for code in _code_objects(obj):
            ref_codes.setdefault(id(code), name)
            # The course's own code only: a base class from torch is no one's copy.
            if len(code.co_code) >= MIN_COPIED_CODE and _course_code(code):
                ref_shapes.setdefault(_shape(code), name)
    ref_classes = {id(obj): name for name, obj in refs.items() if isinstance(obj, type)}
    found: set[str] = set()
    for name, value in list(vars(module).items()):
        if id(value) in ref_ids:
            found.add(f"holds the reference's {ref_ids[id(value)]}")
            continue
        wrapped = getattr(value, "__wrapped__", None) or getattr(value, "func", None)
        if wrapped is not None and id(wrapped) in ref_ids:
            found.add(f"wraps the reference's {ref_ids[id(wrapped)]}")
        if isinstance(value, type) and value.__module__ == module.__name__:
            for base in value.__mro__[1:]:
                if id(base) in ref_classes:
                    found.add(f"{name} subclasses the reference's {ref_classes[id(base)]}")
            for attr, member in vars(value).items():
                if id(member) in ref_ids:
                    found.add(f"{name}.{attr} is the reference's {ref_ids[id(member)]}")
                for f in _functions_of(member):
                    if id(f.__code__) in ref_codes:
                        found.add(f"{name}.{attr} runs the reference's code "
                                  f"({ref_codes[id(f.__code__)]})")
        for f in _functions_of(value):
            if id(f.__code__) in ref_codes:
                found.add(f"{name} runs the reference's code ({ref_codes[id(f.__code__)]})")
        for code in _code_objects(value) if callable(value) else ():
            if id(code) in ref_codes:
                continue  # said above
            shape = ref_shapes.get(_shape(code)) if len(code.co_code) >= MIN_COPIED_CODE else None
            if shape is not None:
                found.add(f"{name} runs a copy of the reference's code ({shape})")
                break
    return found
