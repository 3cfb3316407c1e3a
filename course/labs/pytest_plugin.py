"""The course's pytest plugin (loaded by the root conftest.py).

- checks LAB_IMPL once, up front, and stops with one line when it names no implementation;
- registers the course's markers, and skips `cuda` / `nvcc` tests with a visible reason on
  machines that lack them;
- with `--course-results PATH`, writes every test's outcome as JSON (used by `python -m course`).

What a run prints (one line per unwritten task, repeated failures once, the task list at the
end), the Hypothesis profiles and torch's threads are course.labs.feedback's job, the root
conftest's second plugin.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from course.labs.loader import LabImplError, chosen_impl


def pytest_addoption(parser):
    parser.addoption(
        "--course-results",
        metavar="PATH",
        default=None,
        help="write every test's outcome as JSON to PATH (used by `python -m course`)",
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
