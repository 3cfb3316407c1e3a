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

The command runs `run` on the student's starter and on the reference side by side (a starter
function that still raises NotImplementedError shows as "not written", and the rest goes on),
prints a table, draws the plot when asked, and prints the questions of the README section whose
heading starts with "Predict" next to it: the student answers them first, then looks.
"""

from __future__ import annotations

import importlib.util
import re
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from course.labs.catalog import Lab
from course.labs.loader import LabImplError, load_module

MEASURE_FILE = "measure.py"


@dataclass
class Series:
    name: str
    # None: not written; a {metric key: value} dict when the measurement defines METRICS
    values: dict[int, float | dict[str, float] | None] = field(default_factory=dict)
    note: str = ""


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


def predict_questions(lab: Lab) -> tuple[int, str, str] | None:
    """(line, heading, body) of the README section whose heading starts with "Predict"."""
    readme = lab.path / "README.md"
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(Predict.*)$", line)
        if not m:
            continue
        body = []
        for nxt in lines[i + 1 :]:
            h = re.match(r"^(#+)\s", nxt)
            if h and len(h[1]) <= len(m[1]):
                break
            body.append(nxt)
        return i + 1, m[2].strip(), "\n".join(body).strip()
    return None


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
    for x in module.sizes(quick):
        for s, fn in runners:
            if fn is None or s.note:
                s.values[x] = None
                continue
            try:
                value = fn(x)
                if hasattr(module, "METRICS"):
                    s.values[x] = {k: None if value[k] is None else float(value[k])
                                   for k in module.METRICS}
                elif isinstance(value, dict):  # several named series, split below
                    s.values[x] = dict(value)
                else:
                    s.values[x] = float(value)
            except NotImplementedError as exc:
                s.values[x] = None
                s.note = f"not written yet: {' '.join(str(exc).split())}"
            except Exception as exc:  # the student's code failed: say so, measure the rest
                s.values[x] = None
                s.note = (f"failed at {x:,}: {type(exc).__name__}: {' '.join(str(exc).split())} "
                          "(run the lab's tests first)")
    return module, series if hasattr(module, "METRICS") else _split_named(series)


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
            written = any(v is not None for v in values.values())
            note = s.note or ("" if written else "not written yet")
            out.append(Series(f"{s.name}: {name}", values, note))
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
                       s.note)
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
        rows = [[f"{x:,}"] + [_fmt(s.values.get(x)) for s in panel] for x in xs]
        widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
        line = "  ".join(f"{{:>{w}}}" for w in widths)
        out += ([""] if out else []) + [y_label, line.format(*headers)]
        out += [line.format(*("-" * w for w in widths))] + [line.format(*r) for r in rows]
    for s in series:
        if s.note:
            out.append(f"{s.name}: {s.note}")
    return "\n".join(out)


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
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s.name)
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
