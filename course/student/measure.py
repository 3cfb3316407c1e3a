"""Predict, then measure, on your own code: `python -m course measure 02-01 [--plot out.png]`.

A lab opts in with a `measure.py` in its folder that defines:

    TITLE = "..."                 # what is measured
    X_LABEL, Y_LABEL = "...", "..."
    LOG_X, LOG_Y = True, True     # axes of the plot (optional; default linear)
    def sizes(quick: bool) -> list[int]: ...          # the x values
    def run(impl, x: int) -> float: ...               # one measurement of a lab implementation
                                                      # (the module: starter or solution), or a
                                                      # dict {name: float or None} of several
                                                      # (one series each: "yours: v1", ...)
    BASELINES = {"name": callable(x) -> float}        # optional: other designs to compare
    METRICS = {"key": "label", ...}   # optional: several quantities per run; `run` (and each
                                      # baseline) then returns {key: value or None}, and each
                                      # metric gets its own table and plot panel
    ROUNDS = 3                    # optional: sweep the sizes this many times, interleaved, and
                                  # keep each point's minimum (timings on a loaded machine)
    SPREAD = True                 # optional: keep every round instead; the table shows each
                                  # point's median and its range (a load test's noise)
    def seconds(x: int) -> float: ...   # optional: about how long one run of x takes on a quiet
                                  # 2-core machine; the command then says how long it will take
                                  # before it starts, and prints a line per finished point
    def summary(values) -> list[str]: ...   # optional: lines printed under the table that
                                  # answer the questions ({series name: {x: value or None}})

The command runs `run` on the student's starter and on the reference side by side (a starter
function that still raises NotImplementedError shows as "not written", and the rest goes on),
prints a table, draws the plot when asked, and prints the questions of the README section whose
heading starts with "Predict" next to it: the student answers them first, then looks. So the
README's part of that section after the command block (the reference's numbers, "was your guess
right?") is printed after the table, never before it. On log-log axes the table is followed by
each series' fitted slope (a cost that grows like x^k has slope k).
"""

from __future__ import annotations

import importlib.util
import math
import re
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from course.labs.catalog import Lab
from course.labs.loader import LabImplError, load_module
from course.labs.student_process import beside_the_student

MEASURE_FILE = "measure.py"
GPUS = ("T4", "A100", "H100")  # --arch: the GPUs a static report (lab 02-06) is compiled for


@dataclass
class Series:
    name: str
    # None: not written; a {metric key: value} dict when the measurement defines METRICS
    values: dict[int, float | dict[str, float] | None] = field(default_factory=dict)
    note: str = ""
    # With SPREAD: every round's value per x (the value above is their median)
    rounds: dict[int, list] = field(default_factory=dict)


def load_measurement(lab: Lab) -> ModuleType:
    path = lab.path / MEASURE_FILE
    if not path.is_file():
        raise ValueError(f"lab {lab.id} has no measurement yet (no {MEASURE_FILE} in its folder)")
    spec = importlib.util.spec_from_file_location(
        f"course_measure_{lab.id.replace('-', '_')}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("TITLE", "X_LABEL", "Y_LABEL", "sizes", "run"):
        if not hasattr(module, name):
            raise ValueError(f"{path}: a measurement must define {name}")
    return module


@dataclass(frozen=True)
class Predict:
    """The README's "Predict" section, cut at its command block: `questions` (printed before the
    run) holds no answer; `after` (the text after the block, up to the next heading of any level)
    is printed after the table, so an answer written there never comes first."""

    line: int
    heading: str
    questions: str
    after: str = ""


def predict_questions(lab: Lab) -> Predict | None:
    """The README section whose heading starts with "Predict", split at its first code block."""
    readme = lab.path / "README.md"
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(Predict.*)$", line)
        if not m:
            continue
        before: list[str] = []
        after: list[str] | None = None  # None until the command block has closed
        fence = False
        for nxt in lines[i + 1 :]:
            if not fence and re.match(r"^#+\s", nxt):
                break  # the section (or, after the command, any subsection) ends here
            if nxt.startswith("```"):
                fence = not fence
                if not fence and after is None:
                    after = []  # the command block closed: what follows is for after the run
                if after is None or not nxt.strip("`").strip() and after == []:
                    continue
            if nxt.startswith("!["):
                continue  # a figure: the README shows it, a terminal cannot
            if after is None:
                if not fence:
                    before.append(nxt)
            else:
                after.append(nxt)
        questions = "\n".join(before).strip().split("\n\n")
        if after is not None and questions[-1].rstrip().endswith(":"):
            questions.pop()  # "Then measure:" introduced the command, which is not shown
        return Predict(i + 1, m[2].strip(), "\n\n".join(questions),
                       "\n".join(after or []).strip())
    return None


def check_predict(lab: Lab) -> list[str]:
    """Problems with a lab's predict-then-measure section (`course check`): a lab with a
    measure.py needs a README section whose heading starts with "Predict", holding at least one
    numbered question and then the lab's `python -m course measure` command in a code block;
    the command prints only what comes before that block before it runs, so an answer written
    after the block is never printed first."""
    if not (lab.path / MEASURE_FILE).is_file():
        return []
    predict = predict_questions(lab)
    if predict is None:
        return ["README.md has no section whose heading starts with 'Predict'"]
    readme = (lab.path / "README.md").read_text(encoding="utf-8").splitlines()
    section = "\n".join(readme[predict.line:])
    problems = []
    if not re.search(r"(?m)^\d+\.\s", predict.questions):
        problems.append(f"README.md:{predict.line}: the Predict section asks no numbered "
                        "question before its command block")
    if not re.search(rf"(?m)^```[a-z]*\n[^`]*python -m course measure {lab.id}\b", section):
        problems.append(f"README.md:{predict.line}: the Predict section must give "
                        f"`python -m course measure {lab.id}` in a code block after the "
                        "questions (what follows the block is printed after the run)")
    return problems


def _impl(lab: Lab, impl: str) -> tuple[ModuleType | None, str]:
    try:
        return load_module(lab.path, impl, lab.id), ""
    except LabImplError as exc:
        return None, str(exc)


def measure(lab: Lab, quick: bool = False, impls: tuple[str, ...] = ("starter", "solution")):
    """Run the lab's measurement; returns (module, [Series]) in the order: yours, reference,
    baselines."""
    module = load_measurement(lab)
    names = {"starter": "yours (starter.py)", "solution": "reference"}
    series = []
    runners = []
    for impl in impls:
        loaded, error = _impl(lab, impl)
        s = Series(names[impl], note=error)
        series.append(s)
        runners.append((s, None if loaded is None else (lambda x, m=loaded: module.run(m, x))))
    for name, fn in getattr(module, "BASELINES", {}).items():
        s = Series(name)
        series.append(s)
        runners.append((s, fn))
    xs = module.sizes(quick)
    rounds = max(1, int(getattr(module, "ROUNDS", 1)))
    progress = None
    if hasattr(module, "seconds"):
        from course.labs.console import Progress

        progress = Progress(rounds * len(xs) * len(runners), "measuring")
    # Rounds interleave the series and the sizes, so that a burst of load from another process
    # spoils one round's point, not a whole curve; each point keeps its smallest value (or,
    # with SPREAD, every value).
    for r in range(rounds):
        for x in xs:
            for s, fn in runners:
                if progress is not None:
                    progress.started(f"{s.name} at {x:,}")
                start = time.perf_counter()
                _measure_point(module, s, fn, x)
                if progress is not None:
                    progress.finished(f"round {r + 1}, {s.name} at {x:,}: "
                                      f"{time.perf_counter() - start:.0f} s")
    if progress is not None:
        progress.close()
    return module, series if hasattr(module, "METRICS") else _split_named(series)


def planned_seconds(module: ModuleType, quick: bool, series: int = 2) -> float | None:
    """About how long `measure` will take (None when the measurement does not say): every
    round runs every size for each of `series` implementations and every baseline."""
    seconds = getattr(module, "seconds", None)
    if seconds is None:
        return None
    runs = max(1, int(getattr(module, "ROUNDS", 1))) * (series + len(getattr(module, "BASELINES",
                                                                               {})))
    return runs * sum(seconds(x) for x in module.sizes(quick))


def _measure_point(module: ModuleType, s: Series, fn, x: int) -> None:
    """One value of series `s` at `x` (the minimum over rounds); a failure is noted once."""
    if fn is None or s.note:
        s.values[x] = None
        return
    try:
        value = fn(x)
        if hasattr(module, "METRICS"):
            value = {k: None if value[k] is None else float(value[k]) for k in module.METRICS}
        elif isinstance(value, dict):  # several named series, split below
            value = dict(value)
        else:
            value = float(value)
        if getattr(module, "SPREAD", False):
            s.rounds.setdefault(x, []).append(value)
            s.values[x] = _median(s.rounds[x])
        else:
            s.values[x] = _smaller(s.values.get(x, value), value)
    except NotImplementedError as exc:
        s.values[x] = None
        s.note = f"not written yet: {' '.join(str(exc).split())}"
    except Exception as exc:  # the student's code failed: say so, measure the rest
        s.values[x] = None
        s.note = (f"failed at {x:,}: {type(exc).__name__}: {' '.join(str(exc).split())} "
                  "(run the lab's tests first)")


def _smaller(old, new):
    """The smaller of two measurements of one point (per key for dicts; None stays None)."""
    if isinstance(old, dict):
        return {k: new[k] if old.get(k) is None or new[k] is None else min(old[k], new[k])
                for k in new}
    if old is None or new is None:
        return new
    return min(old, new)


def _median(values: list):
    """The median of one point's rounds (per key for dicts; a None round is left out)."""
    if values and isinstance(values[0], dict):
        return {k: _median([v[k] for v in values]) for k in values[0]}
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def fitted_slope(values: dict[int, float | None]) -> float | None:
    """Least-squares slope of log(y) against log(x) over the positive points (None below two):
    a cost growing like x^k gives k, whatever the constant factor of the machine."""
    pts = [(math.log(x), math.log(y)) for x, y in values.items()
           if y is not None and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return None if var == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / var


def slope_lines(module: ModuleType, series: list[Series]) -> list[str]:
    """One line per series of plain numbers on log-log axes: its fitted slope, and what one
    doubling of x multiplies y by."""
    if not (getattr(module, "LOG_X", False) and getattr(module, "LOG_Y", False)):
        return []
    out = []
    for y_label, panel in panels(module, series):
        lines = []
        for s in panel:
            k = fitted_slope(s.values)
            if k is not None:
                lines.append(f"  {s.name}: slope {k:.2f} (doubling x multiplies y by "
                             f"{2 ** k:.1f})")
        if lines:
            out += [f"Fitted log-log slope of y = {y_label} against x = {module.X_LABEL} "
                    "(a cost growing like x^k has slope k):", *lines]
    return out


def _split_named(series: list[Series]) -> list[Series]:
    """A series whose run returned dicts becomes one series per name ("yours: v1"); a name
    whose every value is None (the run caught NotImplementedError) is noted as not written."""
    out = []
    for s in series:
        names = [k for v in s.values.values() if isinstance(v, dict) for k in v]
        if not names:
            out.append(s)
            continue
        for name in dict.fromkeys(names):
            values = {x: (v or {}).get(name) for x, v in s.values.items()}
            values = {x: None if v is None else float(v) for x, v in values.items()}
            rounds = {x: [(v or {}).get(name) for v in vs] for x, vs in s.rounds.items()}
            written = any(v is not None for v in values.values())
            note = s.note or ("" if written else "not written yet")
            out.append(Series(f"{s.name}: {name}", values, note, rounds))
    return out


def panels(module: ModuleType, series: list[Series]) -> list[tuple[str, list[Series]]]:
    """(y label, series of plain numbers) per quantity: one panel, or one per METRICS entry."""
    metrics = getattr(module, "METRICS", None)
    if not metrics:
        return [(module.Y_LABEL, series)]
    return [
        (
            label,
            [
                Series(s.name, {x: None if v is None else v[key] for x, v in s.values.items()},
                       s.note, {x: [None if v is None else v[key] for v in vs]
                                for x, vs in s.rounds.items()})
                for s in series
            ],
        )
        for key, label in metrics.items()
    ]


def format_table(module: ModuleType, series: list[Series]) -> str:
    out = []
    for y_label, panel in panels(module, series):
        xs = sorted({x for s in panel for x in s.values})
        headers = [module.X_LABEL] + [s.name for s in panel]
        rows = [[f"{x:,}"] + [_cell(s, x) for s in panel] for x in xs]
        widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
        line = "  ".join(f"{{:>{w}}}" for w in widths)
        out += ([""] if out else []) + [y_label, line.format(*headers)]
        out += [line.format(*("-" * w for w in widths))] + [line.format(*r) for r in rows]
    for s in series:
        if s.note:
            out.append(f"{s.name}: {s.note}")
    slopes = slope_lines(module, series)
    if slopes:
        out += [""] + slopes
    summary = getattr(module, "summary", None)
    if summary is not None:
        lines = summary({s.name: dict(s.values) for s in series})
        if lines:
            out += [""] + list(lines)
    return "\n".join(out)


def _cell(s: Series, x: int) -> str:
    """A table cell: the value, and with several rounds their range, "0.031 (0.027-0.04)"."""
    known = [v for v in s.rounds.get(x, []) if v is not None]
    if len(known) < 2 or s.values.get(x) is None:
        return _fmt(s.values.get(x))
    return f"{_fmt(s.values[x])} ({_fmt(min(known))}-{_fmt(max(known))})"


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def plot(module: ModuleType, series: list[Series], path: Path | None, show: bool) -> Path | None:
    """Draw the series (matplotlib); save to `path` and/or show a window."""
    import matplotlib

    if not show:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels(module, series)
    cols = min(2, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (y_label, panel) in zip(axes.flat, groups):
        for s in panel:
            pts = [(x, y) for x, y in sorted(s.values.items()) if y is not None]
            if not pts:
                continue
            line, = ax.plot(*zip(*pts), marker="o", label=s.name)
            ranges = [[v for v in s.rounds.get(x, []) if v is not None] for x, _ in pts]
            if all(len(r) >= 2 for r in ranges):  # the rounds' range around each median
                ax.errorbar([x for x, _ in pts], [y for _, y in pts], fmt="none",
                            ecolor=line.get_color(), alpha=0.5, capsize=3,
                            yerr=[[y - min(r) for (_, y), r in zip(pts, ranges)],
                                  [max(r) - y for (_, y), r in zip(pts, ranges)]])
        if getattr(module, "LOG_X", False):
            ax.set_xscale("log")
        if getattr(module, "LOG_Y", False):
            ax.set_yscale("log")
        ax.set_xlabel(module.X_LABEL)
        ax.set_ylabel(y_label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(module.TITLE)
    fig.tight_layout()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    if show:
        plt.show()
    plt.close(fig)
    return path


def best_of(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` calls of fn() in seconds (the least disturbed by the machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@beside_the_student
def peak_tensor_bytes(fn, existing=()) -> int:
    """The most bytes of tensor storage that `fn()` held at once, counting every tensor created
    while it ran (torch functions and Tensor methods, seen through a TorchFunctionMode) until it
    was freed. Tensors in `existing` (the inputs) are not counted. Deterministic, unlike the
    process's memory, and it works on the CPU."""
    from torch.overrides import TorchFunctionMode

    class _Tracker(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors using it]
            self.current = self.peak = 0
            self.skip = {t.untyped_storage().data_ptr() for t in existing}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._track(t)
            return out

        def _track(self, t) -> None:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.skip:
                return
            entry = self.live.get(ptr)
            if entry is None:
                entry = self.live[ptr] = [nbytes, 0]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(t, self._release, ptr)

        def _release(self, ptr: int) -> None:
            entry = self.live.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[ptr]

    import torch

    tracker = _Tracker()
    with tracker:
        fn()
    return tracker.peak


def command(lab: Lab, quick: bool = False, plot_path: Path | None = None, show: bool = False,
            arch: str | None = None) -> int:
    """`python -m course measure LAB`: the questions, then the measurement, then the README's
    after-the-run text. A measurement that defines `can_time()` and `static_report(arch)` (lab
    02-06) prints the static report when it cannot time here, or when `arch` is given; exit 0
    when a table or a static report was produced, 2 when neither could be."""
    import sys

    predict = predict_questions(lab)
    if predict is not None:
        print(f"{predict.heading} (README.md:{predict.line}): answer these before you look at "
              "the numbers.\n")
        print(predict.questions + "\n")
    try:
        module = load_measurement(lab)
        static = getattr(module, "static_report", None)
        timed = getattr(module, "can_time", lambda: True)()
        if static is not None and (arch is not None or not timed):
            if not timed:
                print("No CUDA GPU here, so nothing is timed; what the compiled code says "
                      "instead:\n")
            print(static(arch or GPUS[-1]))
            if not timed:
                _after(predict)
                return 0
            print()
        if not timed:
            raise ValueError(f"lab {lab.id}'s measurement needs a CUDA GPU, and this machine "
                             "has none")
        planned = planned_seconds(module, quick)
        if planned is not None:
            line = (f"This run takes about {_minutes(planned)} on a quiet 2-core machine "
                    "(longer on a busy one)")
            if not quick:
                line += f"; --quick takes about {_minutes(planned_seconds(module, True))}"
            print(line + ".\n", flush=True)
        module, series = measure(lab, quick=quick)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(module.TITLE)
    print(format_table(module, series))
    if plot_path or show:
        path = plot(module, series, plot_path, show)
        if path is not None:
            print(f"\nplot: {path}")
    else:
        print("\nDraw it: add --plot FILE.png (or --show for a window).")
    _after(predict)
    return 0


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _after(predict: Predict | None) -> None:
    """The README's text after the command block, once the student has the numbers."""
    if predict is not None and predict.after:
        print(f"\nNow compare (README.md:{predict.line}, after the command):\n")
        print(predict.after)
