"""The course's pytest plugin (loaded by the root conftest.py).

- checks LAB_IMPL once, up front, and stops with one line when it names no implementation;
- registers the course's markers, and skips `cuda` / `nvcc` tests with a visible reason on
  machines that lack them;
- with `--course-results PATH`, writes every test's outcome as JSON (used by `python -m course`);
- a kernel's failure to build or run (mini_vllm.csrc's errors) is reported with its own message
  first (the compiler's first error; the emulator's file, line, block and thread) and the frames
  of the test and the lab only; `--emulator-traceback` shows the tools' own frames as well.

What a run prints (one line per unwritten task, repeated failures once, the task list at the
end), the Hypothesis profiles and torch's threads are course.labs.feedback's job, the root
conftest's second plugin.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT
from course.labs.loader import LabImplError, chosen_impl


def pytest_addoption(parser):
    parser.addoption(
        "--course-results",
        metavar="PATH",
        default=None,
        help="write every test's outcome as JSON to PATH (used by `python -m course`)",
    )
    parser.addoption(
        "--emulator-traceback",
        action="store_true",
        default=False,
        help="under a CUDA kernel's failure (its build, the CPU emulation, the GPU worker), show "
        "the Python frames of mini_vllm.csrc and the thread pools too; by default the report "
        "starts with the failure's own line and shows the test's and the lab's frames only",
    )


def pytest_configure(config):
    try:
        chosen_impl()
    except LabImplError as exc:
        raise pytest.UsageError(str(exc)) from None
    for line in (
        "starter_ok: meant to pass on the untouched starter; not graded",
        "points(n): weight of a graded test (default 1)",
        "cuda: needs a CUDA GPU (skipped without one)",
        "nvcc: needs the nvcc compiler on PATH (skipped without it)",
        "oracle: runs kernels and compares them with a PyTorch oracle (on a GPU or emulated)",
        "emulation: runs CUDA kernels in the CPU emulation (needs a host C++ compiler)",
        "asan: runs CUDA kernels emulated under AddressSanitizer and UBSan",
        "race: runs CUDA kernels emulated under ThreadSanitizer",
        "slow: a long test",
    ):
        config.addinivalue_line("markers", line)
    config._course_results = []


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    need_cuda = any(item.get_closest_marker("cuda") for item in items)
    has_cuda = _cuda_available() if need_cuda else False
    has_nvcc = shutil.which("nvcc") is not None
    for item in items:
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(
                pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
            )
        if item.get_closest_marker("nvcc") and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc on PATH (the CUDA toolkit)"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.user_properties.append(("points", _points(item)))
    item.user_properties.append(("starter_ok", item.get_closest_marker("starter_ok") is not None))


# ---------------------------------------------------------------------------------------------
# A kernel's failure: its own line first, the tools' frames hidden
# ---------------------------------------------------------------------------------------------

# The errors mini_vllm.csrc raises when a kernel does not build or misbehaves. Their message is
# what a student acts on; the frames that raise them (the emulator's driver, the compiler's
# thread pool, the GPU worker) are the course's internals.
KERNEL_ERRORS = frozenset({"EmulationError", "EmulationBuildError", "CudaBuildError",
                           "KernelCrashed"})
# Frames under these folders are hidden from a kernel failure's report (the Python install too).
_INTERNALS = tuple(str(p) for p in (REPO_ROOT / "mini_vllm", REPO_ROOT / "course"))


def kernel_error(exc: BaseException | None) -> BaseException | None:
    """The kernel build or run error that `exc` is, or that caused it; None for any other."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kind = type(exc)
        if kind.__name__ in KERNEL_ERRORS and kind.__module__.startswith("mini_vllm.csrc"):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


_INSTALL = tuple({str(Path(p).resolve()) + "/" for p in (sys.prefix, sys.base_prefix,
                                                          sys.exec_prefix)})


def _is_internal(path: str) -> bool:
    path = str(Path(path).resolve())
    return path.startswith(_INTERNALS + _INSTALL) or "site-packages" in path


def _students_frames(excinfo):
    """The traceback without the tools' frames; the whole one if nothing else is left."""
    kept = excinfo.traceback.filter(lambda entry: not _is_internal(str(entry.path)))
    return kept or excinfo.traceback


def kernel_failure_repr(excinfo, error: BaseException):
    """A failure report that starts with the kernel error's first line (what happened, where in
    the student's code), says how to see the hidden frames, then shows the short traceback of
    the test's and the lab's frames and the error's whole message. pytest's own report types
    only (the headline is a plain-text entry), so the summary line, JUnit XML, pytest-xdist and
    the course's folding of repeats read it as any other."""
    from _pytest._code.code import ReprEntryNative

    report = excinfo.getrepr(style="short", chain=False, tbfilter=_students_frames,
                             funcargs=False, truncate_locals=True)
    first = (str(error).strip().splitlines() or [""])[0]
    headline = ReprEntryNative([
        f"{type(error).__name__}: {first}\n",
        "(the kernel tools' Python frames are hidden; pytest --emulator-traceback shows them)\n",
        "\n",
    ])
    report.reprtraceback.reprentries = [headline, *report.reprtraceback.reprentries]
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (report.failed and call.excinfo is not None
            and not item.config.getoption("--emulator-traceback", False)
            and hasattr(report.longrepr, "reprtraceback")):  # a rendered traceback, not one line
        error = kernel_error(call.excinfo.value)
        if error is not None:
            report.longrepr = kernel_failure_repr(call.excinfo, error)
    return report


def _points(item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker and marker.args else 1.0


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    outcome = None
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            outcome = "passed"
        elif report.skipped:
            outcome = "skipped"
        else:
            outcome = props.get("course_outcome", "failed")
    if outcome is None:
        return
    message = ""
    if outcome == "skipped" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    elif outcome not in ("passed", "skipped"):
        message = _short_message(report)
    _RESULTS.append(
        {
            "nodeid": report.nodeid,
            "outcome": outcome,
            "points": props.get("points", 1.0),
            "starter_ok": props.get("starter_ok", False),
            "duration_s": round(report.duration, 4),
            "message": message,
        }
    )


_RESULTS: list[dict] = []


def _short_message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, str):
        return longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return f"{crash.message} ({Path(crash.path).name}:{crash.lineno})"
    return str(longrepr).splitlines()[-1] if str(longrepr) else "failed"


_EXCEPTIONS: dict[str, str] = {}


def pytest_exception_interact(node, call, report):
    """The type of the exception a test failed on (course check tells an assertion from a crash).
    pytest calls this for every failure, after the report is logged."""
    if call.excinfo is not None:
        _EXCEPTIONS.setdefault(node.nodeid, call.excinfo.type.__name__)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--course-results")
    if not path:
        return
    for result in _RESULTS:
        result["exception"] = _EXCEPTIONS.get(result["nodeid"], "")
    report = {"exitstatus": int(exitstatus), "tests": _RESULTS}
    Path(path).write_text(json.dumps(report, indent=1), encoding="utf-8")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    """The student's process of a lab that runs in one (course.labs.student_process) lives for
    one test: killed once the test's own teardown is done."""
    from course.labs import student_process

    student_process.stop_all()
