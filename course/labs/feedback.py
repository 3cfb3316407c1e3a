"""Quiet, fast feedback for a test run (a pytest plugin; the root conftest.py loads it).

What a student sees when they run a lab's tests:

- a test that failed because the starter still raises the course's NotImplementedError is one
  line, never a rendered traceback (Hypothesis state machines included), with its own outcome,
  "not implemented", in the progress line (N) and the closing counts;
- a failure that repeats across cases of one test (same exception, same traceback, same tier,
  a message of the same shape) is rendered once, in full; that report ends with the count and
  the ids of the other cases, which get no report of their own (`--every-failure` renders each
  one). A crash in the code under test (an exception other than an assertion, raised below the
  test file's last frame) is one failure whichever test reached it: the same line failing the
  same way under ten tests renders once;
- one mistake usually fails several tests, each with a message that names the cause: the first
  failure of the run is rendered in full (pytest's short style when its traceback would pass
  MAX_FULL_LINES), the next MAX_BRIEFS as two lines (the message's first line, then the test's
  rule and the function to open, with the test file's line), and later ones are counted in one
  line after pytest's summary, which lists only the failures shown; captured output keeps its
  last CAPTURED_TAIL lines. A single mistake prints at most about 120 lines
  (scripts/report_lengths.py measures it over the planted bugs); `--every-failure` renders
  everything;
- tensors in failure reports are summarised (shape, dtype, first values), not printed;
- after pytest's closing line, every task the starter still leaves open, in task order, read from
  the starter's source, with the README passage and the hint command for each;
- torch runs with a thread count chosen for the machine (OMP_NUM_THREADS wins when set), so that
  one lab alone is as fast as it is inside `python -m course`;
- pytest's cache (for `--lf` and `--ff`) lives in the temporary folder, not in the repository;
- the Hypothesis profile: HYPOTHESIS_PROFILE when set; otherwise `student` for LAB_IMPL=starter
  (the same examples as `ci`, shrinking bounded to seconds) and `ci` for everything else.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import textwrap
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT, Lab, lab_for_path
from course.labs.loader import ENV_VAR, LabImplError, chosen_impl
from course.labs.tasks import TASK_MESSAGE_RE, open_tasks, readme_section

NOT_IMPLEMENTED = "not_implemented"  # the outcome in --course-results
NI_CATEGORY = "not implemented"  # the outcome in the terminal
NI_PREFIX = "NOT IMPLEMENTED  "
CACHE_ENV = "COURSE_PYTEST_CACHE"  # pyproject.toml: cache_dir = "$COURSE_PYTEST_CACHE"
STUDENT_SHRINK_SECONDS = 10
MAX_IDS = 24  # ids of repeated cases listed under the first one's report
IDS_CHARS = 200  # ... in at most about two lines
# One mistake, one report: the run's first failure is rendered in full (at most MAX_FULL_LINES
# of traceback, else pytest's short style); the next MAX_BRIEFS as two lines (what failed, and
# the test's rule with the function to open); later ones only counted. Captured output keeps
# its last CAPTURED_TAIL lines. --every-failure shows everything.
FULL_REPORTS = 1
MAX_FULL_LINES = 50
MAX_BRIEFS = 8
BRIEF_CHARS = 200
CAPTURED_TAIL = 15


# ---------------------------------------------------------------------------------------------
# Set up before any test module (and so torch) is imported
# ---------------------------------------------------------------------------------------------


def choose_threads(usable: int | None = None) -> int:
    """torch's intra-op threads for a test run: half the CPUs this process may use, 1 to 4.

    The labs' tensors are small: past a few threads, splitting each operation costs more than it
    saves, and on a busy machine threads that wait for a core make a run several times slower
    (lab 02-04 on 2 busy cores: 2 threads 49 s, 1 thread 19 s). Half the CPUs also leaves room
    for the dashboard's second lab, which runs beside the first.
    """
    if usable is None:
        try:
            usable = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS
            usable = os.cpu_count() or 1
    return max(1, min(4, usable // 2))


def _limit_threads() -> None:
    if os.environ.get("OMP_NUM_THREADS"):
        return  # the user's (or the dashboard's) choice
    n = choose_threads()
    os.environ["OMP_NUM_THREADS"] = str(n)  # read by torch when it loads, and by subprocesses
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def default_cache_dir(root: Path = REPO_ROOT) -> Path:
    """pytest's cache for the checkout at `root`: in the temporary folder, one per checkout."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"mini_vllm-pytest-{user}" / digest


_limit_threads()
# Always this checkout's own folder: a value inherited from a parent run belongs to another one.
os.environ[CACHE_ENV] = str(default_cache_dir())


# ---------------------------------------------------------------------------------------------
# Hypothesis profiles
# ---------------------------------------------------------------------------------------------


def hypothesis_profile_name() -> str:
    """HYPOTHESIS_PROFILE when set; `student` for a run of the starters; `ci` otherwise."""
    chosen = os.environ.get("HYPOTHESIS_PROFILE")
    if chosen:
        return chosen
    try:
        return "student" if chosen_impl() == "starter" else "ci"
    except LabImplError:
        return "ci"


def register_hypothesis_profiles() -> str:
    """Register the course's profiles and load the chosen one; returns its name."""
    try:
        from hypothesis import HealthCheck, Phase, settings
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:  # pragma: no cover - hypothesis is a pinned requirement
        return ""
    # Hypothesis keeps caches under .hypothesis/ in the working directory; tests write nothing
    # into the repository, so it goes to the system's temporary folder instead.
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "mini_vllm-hypothesis")
    # No explain phase: after a failure it reruns the test (up to 10 s, measured: 157 reruns of
    # lab 01-01's shape test on the untouched starter) only to say which arguments did not
    # matter. A failing test fails the same without it, and a student waits for every rerun.
    phases = tuple(p for p in Phase if p is not Phase.explain)
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], phases=phases)
    # Derandomized: every run (a student's, CI's, an instructor's grading) explores the same
    # cases, so a green run on a laptop is a green grade.
    ci = dict(derandomize=True, database=None, max_examples=60, **common)
    settings.register_profile("ci", print_blob=True, **ci)
    # The student's: the same examples as ci (same seed, same count), so it passes and fails
    # exactly where grading does; only shrinking is bounded (below) and the reproduce blob,
    # which means nothing to a student, is not printed.
    settings.register_profile("student", print_blob=False, **ci)
    settings.register_profile("thorough", max_examples=1000, **common)
    name = hypothesis_profile_name()
    settings.load_profile(name)
    if name == "student":
        _bound_shrinking(STUDENT_SHRINK_SECONDS)
    return name


# What Hypothesis prints when shrinking hits MAX_SHRINKING_SECONDS; it assumes its own default.
_SLOW_SHRINK_WARNING = "Hypothesis has spent more than five minutes working to shrink"


def _bound_shrinking(seconds: int) -> None:
    """Stop shrinking a failing example after `seconds` (Hypothesis's default is 5 minutes).

    Hypothesis keeps this limit in a module constant that it documents as monkeypatchable; a
    partly shrunk example is still a failing one, and a student waits seconds, not minutes.
    Hitting the limit makes Hypothesis print a warning written for its own five minutes ("...
    PLEASE REPORT THIS"), which here is no news and wrong: that one message becomes a line that
    says what happened. Every other message, health checks included, passes unchanged, and the
    ci and thorough profiles (the course's developers') keep Hypothesis's limit and warning.
    """
    try:
        from hypothesis.internal.conjecture import engine
    except ImportError:  # pragma: no cover
        return
    if hasattr(engine, "MAX_SHRINKING_SECONDS"):
        engine.MAX_SHRINKING_SECONDS = seconds
    report = getattr(engine, "report", None)
    if report is None or getattr(report, "course_bounded", False):
        return

    def bounded_report(text, *args, **kwargs):
        if isinstance(text, str) and _SLOW_SHRINK_WARNING in text:
            text = (f"(Hypothesis stopped simplifying the failing example after "
                    f"{engine.MAX_SHRINKING_SECONDS} s, the course's limit for students: the "
                    "example below may not be the smallest failing one.)")
        return report(text, *args, **kwargs)

    bounded_report.course_bounded = True
    engine.report = bounded_report


# ---------------------------------------------------------------------------------------------
# Not implemented: one line
# ---------------------------------------------------------------------------------------------


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


def not_implemented_line(exc: BaseException) -> str | None:
    """One line for a failure caused by unwritten starter code, or None for any other failure."""
    for e in _exceptions(exc):
        if isinstance(e, LabImplError):
            return f"CANNOT LOAD  {e}"
        if isinstance(e, NotImplementedError):
            frames = traceback.extract_tb(e.__traceback__)
            where = ""
            if getattr(e, "student_where", ""):  # raised in the student's process
                where = f"  ({e.student_where})"
            elif frames:
                last = frames[-1]
                where = f"  ({Path(last.filename).name}:{last.lineno}, in {last.name})"
            message = " ".join((str(e) or "a function raised NotImplementedError").split())
            return f"{NI_PREFIX}{message}{where}"
    return None


# ---------------------------------------------------------------------------------------------
# Tensors in reports
# ---------------------------------------------------------------------------------------------


def _is_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_summary(t, values: int = 6) -> str:
    """`tensor(shape=(3, 8, 64), dtype=float16, first=[0.12, -1.5, ...])`: what a report needs,
    in one line, without formatting the whole tensor."""
    head = f"tensor(shape={tuple(t.shape)}, dtype={str(t.dtype).removeprefix('torch.')}"
    if t.device.type != "cpu":
        head += f", device={t.device}"
    try:
        flat = t.detach().reshape(-1)[:values].to("cpu").tolist()
    except Exception:  # sparse, meta, ...: shape and dtype are what there is
        return head + ")"
    shown = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in flat)
    more = ", ..." if t.numel() > values else ""
    return f"{head}, first=[{shown}{more}])"


@contextmanager
def tensors_summarised():
    """While a failure report is rendered, tensors print as summaries (arguments shown in a
    traceback are otherwise formatted in full for every failing case: slow, and unreadable)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    original = torch.Tensor.__repr__
    torch.Tensor.__repr__ = tensor_summary
    try:
        yield
    finally:
        torch.Tensor.__repr__ = original


def _summarise_tensors_in_assertions() -> None:
    """`assert torch.equal(a, b)` explains itself with the reprs of a and b, built when the
    assertion fails: summarise tensors there too (pytest's private helper; skipped if absent)."""
    try:
        from _pytest.assertion import rewrite
    except ImportError:  # pragma: no cover
        return
    original = getattr(rewrite, "_saferepr", None)
    if original is None or getattr(original, "_course", False):
        return

    def saferepr(obj):
        return tensor_summary(obj) if _is_tensor(obj) else original(obj)

    saferepr._course = True
    rewrite._saferepr = saferepr


# ---------------------------------------------------------------------------------------------
# The plugin's state and hooks
# ---------------------------------------------------------------------------------------------


@dataclass
class _Repeats:
    first: object  # the first case's TestReport, rendered in full
    others: list[str] = field(default_factory=list)  # nodeids of the cases that failed the same


@dataclass
class _State:
    every_failure: bool = False
    full_reports: int = 0  # failures rendered in full so far
    briefs: int = 0  # failures rendered in two lines so far
    unlisted: set[int] = field(default_factory=set)  # id() of reports past MAX_BRIEFS
    by_signature: dict[tuple, _Repeats] = field(default_factory=dict)
    repeated: set[int] = field(default_factory=set)  # id() of the one-line reports of repeats
    # (test without its parameters, the line) -> nodeids of the cases, for the NI section
    not_implemented: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    waiting: dict[tuple[str, int], int] = field(default_factory=dict)  # (lab, task) -> tests
    hidden: dict[str, list] = field(default_factory=dict)
    cases: dict[str, int] = field(default_factory=dict)  # test without parameters -> cases run


def _state(config) -> _State:
    state = getattr(config, "_course_feedback", None)
    if state is None:
        state = config._course_feedback = _State()
    return state


def pytest_addoption(parser):
    parser.addoption(
        "--every-failure",
        action="store_true",
        default=False,
        help="render every failure in full (by default a lab's run renders its first failure in "
        "full, the next 8 in two lines each and counts the rest, and a failure that repeats "
        "across cases or tests is rendered once, with the ids of the others)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    _state(config).every_failure = config.getoption("--every-failure", False)
    results = config.getoption("--course-results", None)
    if results:
        # A run of the course's tooling, in a folder it deletes: keep the cache in there too.
        os.environ[CACHE_ENV] = str(Path(results).resolve().parent / "pytest-cache")
    _summarise_tensors_in_assertions()
    register_hypothesis_profiles()


def pytest_collection_finish(session):
    cases = _state(session.config).cases
    for item in session.items:
        cases[_base_id(item.nodeid)] = cases.get(_base_id(item.nodeid), 0) + 1


def pytest_report_header(config):
    return (
        f"course: {ENV_VAR}={_impl_or('?')}, torch threads {os.environ.get('OMP_NUM_THREADS')}, "
        f"hypothesis profile {hypothesis_profile_name()}"
    )


def _impl_or(default: str) -> str:
    try:
        return chosen_impl()
    except LabImplError:
        return default


def _excinfo(item, call):
    """The exception of this phase. A unittest-style item (a Hypothesis state machine's
    TestCase) keeps it on the item until the unittest plugin's own hook moves it to the call."""
    if call.excinfo is not None:
        return call.excinfo
    pending = getattr(item, "_excinfo", None)
    if call.when == "call" and pending:
        return pending[0]
    return None


def _report_for(item, call, longrepr) -> pytest.TestReport:
    """Our own failed report. When the exception was still waiting on a unittest-style item,
    take it, as the unittest plugin does: left there, it would fail the teardown too."""
    pending = getattr(item, "_excinfo", None)
    if call.excinfo is None and call.when == "call" and pending:
        pending.pop(0)
    return _report(item, call, "failed", longrepr)


def _base_id(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


# The markers that say which tier of a lab's tests a test belongs to (how its code runs: on a
# GPU, emulated, under a sanitizer, compiled by nvcc). Failures of different tiers are different
# findings even when the same lines raise them: a segfault in the plain emulation and the
# sanitizer's exact out-of-bounds read.
TIER_MARKERS = frozenset({"cuda", "nvcc", "oracle", "emulation", "asan", "race"})
_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")
# A case's data quoted in a message: a string's repr, a list, a dict (innermost first).
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
_BRACKETED = re.compile(r"\[[^\[\]]*\]|\{[^{}]*\}")
_FILE_LINE_OR_NUMBER = re.compile(r"[\w.]+\.\w+:\d+|\w*\d\w*")


def message_shape(exc: BaseException) -> str:
    """The first line of `exc`'s message with the values that differ between the cases of one
    mistake blurred: template arguments dropped, quoted strings, lists and dicts (a case's data,
    as an f-string prints it) made "#", every word holding a digit made "#", except a
    file:line, which says where the mistake is. "segmentation fault at starter.cu:189 ... block
    (0,0,0), thread 32 (kernel k<__half, 128>)" and the same for block (3,1,0), thread 7 and
    k<float, 80> have one shape; an out-of-bounds read at starter.cu:113 has another; "the
    pieces of 'naïve' ... ['n', 'a']" and of 'café' have one. The words of a message stay: a
    test that explains two mistakes in two sentences gives two shapes."""
    try:
        line = (str(exc).strip().splitlines() or [""])[0]
    except Exception:  # an exception whose message cannot be built: its type says enough
        line = ""
    line = _QUOTED.sub("#", line)
    for pattern in (_TEMPLATE_ARGS, _BRACKETED):
        while True:
            shorter = pattern.sub("#", line) if pattern is _BRACKETED else pattern.sub("", line)
            if shorter == line:
                break
            line = shorter
    return _FILE_LINE_OR_NUMBER.sub(lambda m: m[0] if ":" in m[0] else "#", line)


def _signature(item, call, excinfo) -> tuple:
    """Two failures are the same when the same test (any parameters) fails in the same phase
    with the same exception type through the same lines; or, for an exception other than an
    assertion, when it comes out of the same lines below the test file (a crash in the lab's
    code, whichever test called it). Either way only within one tier of tests (TIER_MARKERS)
    and with messages of the same shape (`message_shape`). Walking the traceback costs
    microseconds; rendering it costs tens of milliseconds."""
    frames = []
    tb = excinfo.tb
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    tier = tuple(sorted({m.name for m in item.iter_markers()} & TIER_MARKERS))
    said = message_shape(excinfo.value)
    test_file = str(item.path)
    last_in_test = max((i for i, f in enumerate(frames) if f[0] == test_file), default=None)
    below = frames[last_in_test + 1 :] if last_in_test is not None else []
    if below and not excinfo.errisinstance(AssertionError):
        return ("crash", test_file, call.when, excinfo.type.__qualname__, tuple(below), tier,
                said)
    return (_base_id(item.nodeid), call.when, excinfo.type.__qualname__, tuple(frames), tier,
            said)


@dataclass
class _CrashLine:
    path: str
    lineno: int
    message: str


@dataclass
class _OneLine:
    """A failure report of one line (what `longrepr` holds for a repeated failure)."""

    text: str
    reprcrash: _CrashLine

    def toterminal(self, tw) -> None:
        tw.line(self.text)

    def __str__(self) -> str:
        return self.text


def _report(item, call, outcome: str, longrepr) -> pytest.TestReport:
    return pytest.TestReport(
        item.nodeid,
        item.location,
        {x: 1 for x in item.keywords},
        outcome,
        longrepr,
        call.when,
        [(f"Captured {key} {when}", content) for when, key, content in item._report_sections],
        call.duration,
        call.start,
        call.stop,
        user_properties=item.user_properties,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Report unwritten starter code, and repeats of a failure already rendered, as one line,
    without rendering a traceback at all: rendering one costs most of a failing run's time."""
    if call.when == "collect":
        return None
    excinfo = _excinfo(item, call)
    if excinfo is None or excinfo.errisinstance((pytest.skip.Exception, pytest.exit.Exception)):
        return None
    state = _state(item.config)
    line = not_implemented_line(excinfo.value)
    if line is not None:
        if line.startswith(NI_PREFIX):
            item.user_properties.append(("course_outcome", NOT_IMPLEMENTED))
            _count_not_implemented(state, item, line)
        else:  # CANNOT LOAD: a real error, but the same one for every test of the lab
            sig = ("cannot load", _base_id(item.nodeid).split("::")[0], line)
            if _is_repeat(state, sig, item) and not state.every_failure:
                return _report_for(item, call, _repeat_line(state, sig, line))
        return _report_for(item, call, line)
    if state.every_failure or item.get_closest_marker("xfail"):
        return None
    sig = _signature(item, call, excinfo)
    if _is_repeat(state, sig, item):
        crash = _crash_line(item, excinfo)
        first = state.by_signature[sig].first
        text = f"same failure as {first.nodeid.split('::', 1)[-1]} (shown above): {crash.message}"
        return _report_for(item, call, _OneLine(text, crash))
    if state.full_reports >= FULL_REPORTS and _in_a_lab(item):
        state.briefs += 1
        if state.briefs > MAX_BRIEFS:
            item._course_unlisted = True
        return _report_for(item, call, _brief(item, excinfo))
    return None


def _in_a_lab(item) -> bool:
    """A test of a lab (what a student runs); the course's own tests keep every report."""
    try:
        lab_for_path(Path(str(item.path)))
    except ValueError:
        return False
    return Path(str(item.path)).name.startswith("test_")


def _crash_line(item, excinfo) -> _CrashLine:
    tb = excinfo.traceback[-1] if excinfo.traceback else None
    return _CrashLine(str(tb.path) if tb else str(item.path), (tb.lineno + 1) if tb else 0,
                      _first_line(excinfo.value))


def _brief(item, excinfo) -> _OneLine:
    """A later failure of the run in two lines: the exception with its message's first line,
    then the test's rule and the function to open (the line course/labs/assertions.py adds, or
    the message's second line) with where in the test file it failed."""
    in_test = [e for e in excinfo.traceback if str(e.path) == str(item.path)]
    where = in_test[-1] if in_test else (excinfo.traceback[-1] if excinfo.traceback else None)
    place = f"{Path(str(where.path)).name}:{where.lineno + 1}" if where else item.location[0]
    try:
        lines = [line.strip() for line in str(excinfo.value).strip().splitlines()]
    except Exception:  # a message that cannot be built: the type says enough
        lines = []
    head = f"{excinfo.type.__name__}: {lines[0]}" if lines else excinfo.type.__name__
    rule = next((line for line in lines[1:] if line.startswith(("(the test:", "broken:"))),
                lines[1] if len(lines) > 1 else "")
    text = f"{_cut(head)}\n  {_cut(rule) + '  ' if rule else ''}[{place}]"
    return _OneLine(text, _crash_line(item, excinfo))


def _cut(line: str) -> str:
    return line if len(line) <= BRIEF_CHARS else line[:BRIEF_CHARS - 3] + "..."


def _is_repeat(state: _State, sig: tuple, item) -> bool:
    group = state.by_signature.get(sig)
    if group is None:
        state.by_signature[sig] = _Repeats(first=None)
        item._course_signature = sig
        return False
    if group.first is None:  # the first case's report is still being made
        return False
    group.others.append(item.nodeid)
    item._course_repeat = True
    return True


def _repeat_line(state: _State, sig: tuple, line: str) -> str:
    first = state.by_signature[sig].first
    return f"{line}  (same as {first.nodeid.split('::', 1)[-1]})"


def _count_not_implemented(state: _State, item, line: str) -> None:
    message = line[len(NI_PREFIX) :]
    state.not_implemented.setdefault((_base_id(item.nodeid), message), []).append(item.nodeid)
    m = TASK_MESSAGE_RE.search(message)
    if m:
        key = (m["lab"], int(m["task"]))
        state.waiting[key] = state.waiting.get(key, 0) + 1


@pytest.hookimpl(wrapper=True, specname="pytest_runtest_makereport")
def pytest_runtest_makereport_render(item, call):
    """Around every report: tensors summarised while it renders; remember the first report of
    each failure, and which reports are repeats."""
    excinfo = _excinfo(item, call)  # before pytest's own hooks take it off a unittest item
    with tensors_summarised():
        report = yield
    state = _state(item.config)
    if report.failed and call.when != "collect" and not state.every_failure:
        _keep_it_short(item, report, excinfo, state)
    sig = getattr(item, "_course_signature", None)
    if sig is not None and report.failed:
        group = _state(item.config).by_signature.get(sig)
        if group is not None and group.first is None:
            group.first = report
        item._course_signature = None
    if getattr(item, "_course_repeat", False):
        _state(item.config).repeated.add(id(report))
        item._course_repeat = False
    if getattr(item, "_course_unlisted", False):
        _state(item.config).unlisted.add(id(report))
        item._course_unlisted = False
    return report


@contextmanager
def _tbstyle(config, style: str):
    """pytest's --tb for the calls inside (`Item.repr_failure` reads it): the public way to
    render one report in another style."""
    before = config.option.tbstyle
    config.option.tbstyle = style
    try:
        yield
    finally:
        config.option.tbstyle = before


def _keep_it_short(item, report, excinfo, state: _State) -> None:
    """In a lab's tests, a report rendered in full counts against FULL_REPORTS, and one whose
    traceback runs past MAX_FULL_LINES (a failure deep in a library) is rendered again in
    pytest's short style; captured output keeps its tail."""
    if not _in_a_lab(item):
        return
    if hasattr(report.longrepr, "reprtraceback"):
        state.full_reports += 1
        if excinfo is not None and len(str(report.longrepr).splitlines()) > MAX_FULL_LINES:
            with tensors_summarised(), _tbstyle(item.config, "short"):
                report.longrepr = item.repr_failure(excinfo)
    sections = []
    for title, content in report.sections:
        lines = content.splitlines()
        if len(lines) > CAPTURED_TAIL:
            content = "\n".join([f"(the first {len(lines) - CAPTURED_TAIL} lines are left out: "
                                 "--every-failure shows them)", *lines[-CAPTURED_TAIL:]])
        sections.append((title, content))
    report.sections = sections


def pytest_report_teststatus(report, config):
    # A collection report has no user_properties (a test module that does not import).
    properties = getattr(report, "user_properties", ())
    if report.failed and ("course_outcome", NOT_IMPLEMENTED) in properties:
        return NI_CATEGORY, "N", ("NOT IMPLEMENTED", {"yellow": True})
    return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Around pytest's own summary: repeats leave the FAILURES section (their first case says
    where else it failed); afterwards, the one-line list of what is not implemented yet."""
    state = _state(config)
    stats = terminalreporter.stats
    for group in state.by_signature.values():
        if group.first is not None and group.others:
            _add_repeats_section(group, state.cases.get(_base_id(group.first.nodeid), 0))
    for key in ("failed", "error"):
        reports = stats.get(key, [])
        keep = [r for r in reports if id(r) not in state.repeated | state.unlisted]
        if len(keep) != len(reports):
            state.hidden[key] = reports
            stats[key] = keep
    try:
        return (yield)
    finally:
        for key, reports in state.hidden.items():
            stats[key] = reports
        state.hidden.clear()
        _write_unlisted(terminalreporter, state)
        _write_not_implemented(terminalreporter, state)


def _write_unlisted(tr, state: _State) -> None:
    """After pytest's summary: the failures shown in two lines or not at all, and how to see
    them rendered in full."""
    if state.briefs == 0:
        return
    if state.unlisted:
        n = len(state.unlisted) + sum(len(g.others) for g in state.by_signature.values()
                                      if g.first is not None and id(g.first) in state.unlisted)
        tr.write_line(f"... and {n} more failing test{'s' if n > 1 else ''} not shown: fix the "
                      "first failure above, then run again (--lf reruns only the failures).")
    tr.write_line("Failures after the first show two lines each: python -m pytest "
                  "'<test id>' renders one in full, --every-failure all of them.")


def _add_repeats_section(group: _Repeats, cases: int) -> None:
    """Under the first case's report: how many other cases failed the same way, and which
    (all of them when few; otherwise the first MAX_IDS and how to see the rest)."""
    n = len(group.others)
    base = _base_id(group.first.nodeid)
    test = base.split("::", 1)[-1]
    if any(_base_id(o) != base for o in group.others):  # a crash reached from several tests
        params = [o.split("::", 1)[-1] for o in group.others]
        tests = len({_base_id(o) for o in group.others} | {base})
        title = f"the same failure in {n} other case{'s' if n > 1 else ''} ({tests} tests)"
    elif n + 1 == cases:
        params = [o[len(base) :] or o for o in group.others]
        title = f"the same failure in every other case of {test} ({n})"
    else:
        params = [o[len(base) :] or o for o in group.others]
        title = f"the same failure in {n} other case{'s' if n > 1 else ''} of {test}"
    listed: list[str] = []
    for param in params[:MAX_IDS]:
        if listed and sum(len(p) + 1 for p in listed) + len(param) > IDS_CHARS:
            break
        listed.append(param)
    shown = " ".join(listed)
    if n > len(listed):
        shown += (f" ... and {n - len(listed)} more (--every-failure renders each; --lf reruns "
                  "them)")
    body = textwrap.fill(shown, width=100, break_on_hyphens=False)
    longrepr = group.first.longrepr
    if hasattr(longrepr, "addsection"):  # printed right under the traceback
        longrepr.addsection(title, body)
    else:
        group.first.sections.append((title, body))


def _write_not_implemented(tr, state: _State) -> None:
    if not state.not_implemented:
        return
    n = sum(len(v) for v in state.not_implemented.values())
    tr.write_sep("=", f"not implemented yet: {n} test{'s' if n != 1 else ''}", yellow=True)
    rows = []
    for (base, message), nodeids in state.not_implemented.items():
        name = base.split("::", 1)[-1]
        if len(nodeids) > 1:
            name += f" [{len(nodeids)} cases]"
        rows.append((name, message.split("  (", 1)[0]))  # where: in the task list below
    width = min(max(len(r[0]) for r in rows), 60)
    for name, message in rows:
        tr.write_line(f"{name:<{width}}  {message}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """After pytest's closing line: the tasks still to do."""
    result = yield
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and _impl_or("") == "starter":
        try:
            write_task_list(tr, _labs_run(session), _state(session.config))
        except Exception as exc:  # the list is a courtesy; never fail a run over it
            tr.write_line(f"(could not list the open tasks: {exc})")
    return result


def _labs_run(session) -> list[Lab]:
    labs: dict[Path, Lab] = {}
    for item in session.items:
        try:
            lab = lab_for_path(item.path)
        except ValueError:
            continue
        labs.setdefault(lab.path, lab)
    return sorted(labs.values(), key=lambda lab: lab.id)


def write_task_list(tr, labs: list[Lab], state: _State) -> None:
    for lab in labs:
        tasks = open_tasks(lab)
        if not tasks:
            continue
        tr.write_sep(
            "=",
            f"lab {lab.id}: {len(tasks)} task{'s' if len(tasks) > 1 else ''} to do, next first",
            yellow=True,
        )
        for i, task in enumerate(tasks):
            waiting = state.waiting.get((lab.id, task.number), 0)
            where = f"{task.file}:{task.line}"
            section = readme_section(lab, task.number)
            if section:
                where += f", README.md:{section[0]}"
            tail = ""
            if waiting:
                tail = f"  {waiting} test{'s wait' if waiting != 1 else ' waits'} on it"
            marker = "next" if i == 0 else "    "
            tr.write_line(f"{marker} task {task.number:<2}  {task.names}  ({where}){tail}")
        first = tasks[0]
        section = readme_section(lab, first.number)
        read = f"README.md:{section[0]} ({section[1]})" if section else "the lab's README"
        tr.write_line(
            f"Start with task {first.number}: {first.what.rstrip('.')}. It is explained in {read}; "
            f"stuck? python -m course hint {lab.id} {first.number}"
        )
