"""Lab 03-06 reference: re-exports the reservation policy's admission and the load generator.

The code lives once, in ``mini_vllm`` (``reservation.py`` and ``benchmarks/``).
"""

from __future__ import annotations

from mini_vllm.benchmarks.datasets import SampleRequest, sharegpt_like_requests
from mini_vllm.benchmarks.serve import (
    RequestResult,
    arrival_times,
    calculate_metrics,
    run_in_process,
    run_trace,
    sustained_rate,
)
from mini_vllm.core.sched.reservation import admission_lookahead, reservation_size

__all__ = [
    "RequestResult",
    "SampleRequest",
    "admission_lookahead",
    "arrival_times",
    "calculate_metrics",
    "reservation_size",
    "run_in_process",
    "run_trace",
    "sharegpt_like_requests",
    "sustained_rate",
]
