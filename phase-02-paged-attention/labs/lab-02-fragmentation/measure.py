"""Predict, then measure: how much KV memory paging wastes as the block size grows.

`python -m course measure 02-02 --plot block_size.png` replays the `instruct` trace (short
requests: about 80 tokens each) through paging with your PagedKV and your slot_breakdown at
block sizes from 1 to 256 tokens, beside the reference and beside the best and the worst
contiguous reservation (measured with the reference). Answer the README's "Predict, then
measure" questions before you look.
"""

from __future__ import annotations

import functools
from pathlib import Path

TITLE = "KV memory wasted by paging on short requests (the instruct trace)"
X_LABEL = "block size (tokens)"
Y_LABEL = "% of committed KV memory not holding token states"
LOG_X = True
TRACE = "instruct"


def sizes(quick: bool) -> list[int]:
    return [1, 8, 32, 128] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _waste(impl, strategy: str) -> float:
    spec = impl.load_trace_specs()[TRACE]
    trace = impl.generate_trace(spec)
    report = impl.replay(trace, strategy, spec.budget, spec.max_model_len)
    return 100.0 * report.waste


def run(impl, block_size: int) -> float:
    """The replay (given) with your PagedKV at this block size: the share of committed KV
    memory that is reserved, internal or external fragmentation."""
    return _waste(impl, f"paged-{block_size}")


def _reference():
    from course.labs.loader import load_module

    return load_module(Path(__file__).resolve().parent, "solution", "02-02")


@functools.cache
def _reservation(policy: str) -> float:
    return _waste(_reference(), policy)


BASELINES = {
    "oracle reservation (knows every length)": lambda _x: _reservation("oracle"),
    "max reservation": lambda _x: _reservation("max"),
}
