"""The course's pytest plugin (loaded by the root conftest.py).

- checks LAB_IMPL once, up front, and stops with one line when it names no implementation;
- registers the course's markers and Hypothesis profiles, and skips `cuda` / `nvcc` tests with a
  visible reason on machines that lack them;
- reports a test that failed because the starter raised NotImplementedError as one line naming
  the lab, the task and the function, and lists the tasks still to do at the end of the run;
- with `--course-results PATH`, writes every test's outcome as JSON (used by `python -m course`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

from course.labs import lab_for_path
from course.loader import ENV_VAR, LabImplError, chosen_impl, load_module

TASK_RE = re.compile(r"lab (\d\d-\d\d), task (\d+)")
NOT_IMPLEMENTED = "not_implemented"


def pytest_addoption(parser):
    parser.addoption(
        "--course-results",
        metavar="PATH",
        default=None,
        help="write every test's outcome as JSON to PATH (used by `python -m course`)",
    )


def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:  # pragma: no cover - hypothesis is a pinned requirement
        return
    # Hypothesis keeps caches under .hypothesis/ in the working directory; tests write nothing
    # into the repository, so it goes to the system's temporary folder instead.
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "mini_vllm-hypothesis")
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    # Derandomized: every run (a student's, CI's, an instructor's grading) explores the same cases.
    settings.register_profile(
        "ci", derandomize=True, database=None, max_examples=60, print_blob=True, **common
    )
    settings.register_profile("thorough", max_examples=1000, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
    _register_hypothesis_profiles()
    config._course_results = []
    config._course_tasks = {}


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


def _exceptions(exc: BaseException | None):
    """The exception, the ones it wraps (groups, causes), depth first."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend(getattr(e, "exceptions", ()) or ())
        stack.append(e.__cause__)
        stack.append(e.__context__)


def _not_implemented_line(exc: BaseException) -> str | None:
    """One line for a failure caused by unwritten starter code, or None for any other failure."""
    for e in _exceptions(exc):
        if isinstance(e, LabImplError):
            return f"CANNOT LOAD  {e}"
        if isinstance(e, NotImplementedError):
            frames = traceback.extract_tb(e.__traceback__)
            where = ""
            if frames:
                last = frames[-1]
                where = f"  ({Path(last.filename).name}:{last.lineno}, in {last.name})"
            message = str(e) or "a function raised NotImplementedError"
            return f"NOT IMPLEMENTED  {message}{where}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Report unwritten starter code as one line, without rendering a traceback at all.

    Rendering a long traceback for each of a few hundred failing tests costs most of a starter
    run's time, and tells a student nothing the one line does not.
    """
    if call.excinfo is None or call.when == "collect":
        return None
    line = _not_implemented_line(call.excinfo.value)
    if line is None:
        return None
    item.user_properties.append(("course_outcome", NOT_IMPLEMENTED))
    m = TASK_RE.search(line)
    if m:
        item.config._course_tasks.setdefault((m.group(1), int(m.group(2))), line.split("  (")[0])
    return pytest.TestReport(
        item.nodeid,
        item.location,
        {x: 1 for x in item.keywords},
        "failed",
        line,
        call.when,
        [(f"Captured {key} {when}", content) for when, key, content in item._report_sections],
        call.duration,
        call.start,
        call.stop,
        user_properties=item.user_properties,
    )


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tasks = config._course_tasks
    if not tasks:
        return
    tr = terminalreporter
    tr.section("what to implement next")
    for key in sorted(tasks):
        tr.write_line(tasks[key].replace("NOT IMPLEMENTED  ", "  "))
    first = sorted(tasks)[0]
    tr.write_line(
        f"Start with lab {first[0]}, task {first[1]} (the lab's README explains each task), "
        f"then run the tests again. {ENV_VAR}={chosen_impl()}."
    )


GIVEN_ENV = "COURSE_GIVEN_NAMES"


def _reexported_names() -> list[str]:
    """Names of a loaded starter that are the very objects of the reference solution.

    The untouched starter takes some helpers from mini_vllm on purpose; `python -m course grade`
    lists those in COURSE_GIVEN_NAMES. Any other name that is identical to the solution's object
    means the starter imports the answer instead of implementing it.
    """
    given = os.environ.get(GIVEN_ENV)
    if given is None or chosen_impl() != "starter":
        return []
    allowed = set(json.loads(given))
    found = []
    for name, module in list(sys.modules.items()):
        if not (name.startswith("course_labs.") and name.endswith(".starter")):
            continue
        lab_dir = Path(module.__file__).parent
        try:
            solution = load_module(lab_dir, "solution", lab_for_path(lab_dir).id)
        except Exception:
            continue
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr, None)
            if attr not in allowed and obj is not None and obj is getattr(solution, attr, None):
                found.append(attr)
    return sorted(found)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--course-results")
    if not path:
        return
    report = {"exitstatus": int(exitstatus), "tests": _RESULTS, "reexported": _reexported_names()}
    Path(path).write_text(json.dumps(report, indent=1), encoding="utf-8")
