"""The course's figures, drawn by the course's own code, for the notebooks and the READMEs.

The drawing lives here, once: ``phase01`` to ``phase04`` hold functions that build
a scenario with mini_vllm's real classes and return a matplotlib figure. The phase notebooks call
them (and show the figure inline); ``python -m course figures`` calls the same functions and
writes the SVG files that the READMEs embed, ``phase-*/figures/<name>.svg``.

The SVG output is deterministic: matplotlib's defaults with a fixed style, glyphs drawn as paths
from the font matplotlib ships (DejaVu Sans), a fixed ``svg.hashsalt`` for element ids, no date.
``python -m course figures --check`` (run by the test suite) regenerates every figure in memory
and compares it with the committed file. Coordinates may differ in their last digits between
CPUs (a float32 matmul is not bit-identical everywhere), so numbers are compared to within
``TOLERANCE`` SVG units (points; far below a pixel) and everything else must be identical.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from course.labs.catalog import REPO_ROOT

CREATOR = "mini_vllm course: python -m course figures"
STYLE = {
    "svg.fonttype": "path",
    "svg.hashsalt": "mini_vllm-course-figures",
    "font.family": ["DejaVu Sans"],
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "savefig.facecolor": "white",
}
TOLERANCE = 0.05


@dataclass(frozen=True)
class FigureSpec:
    """One committed figure: where it goes and which function draws it."""

    phase: str  # the phase folder
    name: str  # file stem under <phase>/figures/
    make: str  # "module:function" under course.figures, called with no argument

    @property
    def path(self) -> Path:
        return REPO_ROOT / self.phase / "figures" / f"{self.name}.svg"

    @property
    def rel(self) -> str:
        return f"{self.phase}/figures/{self.name}.svg"

    def function(self):
        module, func = self.make.split(":")
        return getattr(importlib.import_module(f"course.figures.{module}"), func)


P1, P2, P3 = "phase-01-attention", "phase-02-paged-attention", "phase-03-scheduler"
P4 = "phase-04-vllm-today"
FIGURES = [
    FigureSpec(P1, "masks", "phase01:masks"),
    FigureSpec(P1, "online-softmax", "phase01:online_softmax"),
    FigureSpec(P1, "flat-cache", "phase01:flat_cache"),
    FigureSpec(P2, "blocks-decode", "phase02:blocks_decode"),
    FigureSpec(P2, "blocks-free", "phase02:blocks_free"),
    FigureSpec(P2, "prefix-hit", "phase02:prefix_hit"),
    FigureSpec(P2, "fork", "phase02:fork"),
    FigureSpec(P2, "copy-on-write", "phase02:copy_on_write"),
    FigureSpec(P2, "fragmentation", "phase02:fragmentation"),
    FigureSpec(P2, "key-cache-layout", "phase02:key_cache_layout"),
    FigureSpec(P2, "v2-partitions", "phase02:v2_partitions"),
    FigureSpec(P3, "timeline", "phase03:timeline"),
    FigureSpec(P3, "recompute-vs-swap", "phase03:recompute_vs_swap"),
    FigureSpec(P3, "token-budget", "phase03:token_budget"),
    FigureSpec(P3, "chunked-prefill-batch", "phase03:chunked_prefill_batch"),
    FigureSpec(P3, "latency-vs-rate", "load:latency_vs_rate"),
    FigureSpec(P3, "ttft-cdf", "load:ttft_cdf"),
    FigureSpec(P4, "rejection-sampling", "phase04:rejection_sampling"),
]


def lab_module(lab_id: str, pieces=None):
    """Lab ``lab_id``'s module: ``pieces.module(lab_id)`` in a notebook (the student's starter
    when ``YOURS`` and the lab is finished), else the lab's solution.py."""
    if pieces is not None:
        return pieces.module(lab_id)
    from course.labs.catalog import discover
    from course.labs.loader import load_module

    lab = next((lab for lab in discover() if lab.id == lab_id), None)
    if lab is None:
        raise LookupError(f"no lab {lab_id!r}")
    return load_module(lab.path, "solution", lab.id)


def render(spec: FigureSpec) -> bytes:
    """Draw ``spec`` with the fixed style and return its SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(STYLE)
        fig = spec.function()()
        try:
            buf = io.BytesIO()
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": CREATOR})
        finally:
            plt.close("all")
    return buf.getvalue()


_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
# Element ids that matplotlib derives from hashes of their content (clip paths, markers).
_HASH_ID = re.compile(rb"\b([pm])[0-9a-f]{10}\b")


def same_svg(a: bytes, b: bytes, tolerance: float = TOLERANCE) -> bool:
    """True when the two SVGs are the same drawing: identical apart from numbers that differ by
    at most ``tolerance`` (and the content-hash ids that such numbers feed)."""
    if a == b:
        return True
    a, b = _HASH_ID.sub(rb"\1#", a), _HASH_ID.sub(rb"\1#", b)
    if _NUMBER.split(a) != _NUMBER.split(b):
        return False
    pairs = zip(_NUMBER.findall(a), _NUMBER.findall(b))
    return all(abs(float(x) - float(y)) <= tolerance for x, y in pairs)


def select(names: list[str] | None) -> list[FigureSpec]:
    if not names:
        return list(FIGURES)
    known = {f.name: f for f in FIGURES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown figure(s): {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def readme_embeds(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """Which README embeds which figure: {figure path relative to root: [README paths]}."""
    found: dict[str, list[str]] = {}
    for readme in sorted(root.glob("phase-*/**/README.md")):
        text = readme.read_text(encoding="utf-8")
        for m in re.finditer(r"!\[[^\]]*\]\(([^)\s]+\.svg)\)", text):
            target = (readme.parent / m[1]).resolve()
            try:
                rel = str(target.relative_to(root.resolve()))
            except ValueError:
                rel = m[1]
            found.setdefault(rel, []).append(str(readme.relative_to(root)))
    return found


def check(specs: list[FigureSpec], full: bool) -> list[str]:
    """Problems: a committed figure that regeneration would change, a missing one; with
    ``full``, also an SVG under phase-*/figures/ that nothing draws, a README embedding a
    figure that does not exist, and a figure no README embeds."""
    problems = []
    for spec in specs:
        if not spec.path.is_file():
            problems.append(f"{spec.rel} is missing")
        elif not same_svg(spec.path.read_bytes(), render(spec)):
            problems.append(f"{spec.rel} is not what its code draws now ({spec.make})")
    if full:
        drawn = {spec.rel for spec in FIGURES}
        for path in sorted(REPO_ROOT.glob("phase-*/figures/*")):
            rel = str(path.relative_to(REPO_ROOT))
            if rel not in drawn:
                problems.append(f"{rel} is drawn by no function in course/figures")
        embeds = readme_embeds()
        for rel, readmes in sorted(embeds.items()):
            if rel not in drawn:
                problems.append(f"{readmes[0]} embeds {rel}, which no function draws")
        for rel in sorted(drawn - set(embeds)):
            problems.append(f"{rel} is embedded in no README")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course figures",
        description="Draw the README figures (phase-*/figures/*.svg) with the course's code.",
    )
    parser.add_argument("names", nargs="*", help="figure names (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed figure is not current")
    parser.add_argument("--list", action="store_true", help="list the figures and exit")
    args = parser.parse_args(argv)
    specs = select(args.names)
    if args.list:
        for spec in specs:
            print(f"{spec.rel:<55} {spec.make}")
        return 0
    if args.check:
        problems = check(specs, full=not args.names)
        for p in problems:
            print(f"  - {p}")
        if problems:
            print(f"{len(problems)} problem(s). Regenerate with `python -m course figures`.")
            return 1
        print(f"{len(specs)} figures are current.")
        return 0
    for spec in specs:
        data = render(spec)
        spec.path.parent.mkdir(parents=True, exist_ok=True)
        old = spec.path.read_bytes() if spec.path.is_file() else None
        if old is not None and same_svg(old, data):
            print(f"  unchanged  {spec.rel}")
            continue
        spec.path.write_bytes(data)
        print(f"  wrote      {spec.rel} ({len(data) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
