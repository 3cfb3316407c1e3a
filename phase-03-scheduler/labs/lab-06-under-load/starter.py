"""Lab 03-06: under load. You write the reservation policy's admission, the arrivals of a load
generator, and the measurement: what each client saw, summed up as the serving metrics.

Run ``LAB_IMPL=starter python -m pytest phase-03-scheduler/labs/lab-06-under-load -q``.

Given (complete, from mini_vllm): ``reservation_size`` (lab 02-02's policies), the ShareGPT-shaped
trace (``sharegpt_like_requests``, ``SampleRequest``), a client's record (``RequestResult``,
with ``ttft``, ``tpot``, ``itls``, ``e2el`` and ``num_output_tokens``) and the open-loop
drivers (``run_trace``, ``run_in_process``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mini_vllm.benchmarks.datasets import SampleRequest, sharegpt_like_requests
from mini_vllm.benchmarks.serve import RequestResult, run_in_process, run_trace
from mini_vllm.core.sched.reservation import reservation_size

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


def admission_lookahead(
    policy: str, prompt_len: int, max_tokens: int, num_tokens_after_step: int, max_model_len: int
) -> int:
    """Slots beyond this step's tokens that a request claims when it is admitted.

    The scheduler calls it once per admission and claims
    ``num_tokens_after_step + admission_lookahead(...)`` slots (rounded up to blocks).

    * ``"paged"``: 0 (blocks come one at a time as the request grows).
    * ``"max"``, ``"pow2"``, ``"oracle"``: the request's whole ``reservation_size(policy,
      prompt_len, output_len, max_model_len)`` minus the ``num_tokens_after_step`` slots the
      step takes anyway, and never below 0. The final length is ``prompt_len + max_tokens``
      capped at ``max_model_len``: ``output_len = max(1, min(max_tokens, max_model_len -
      prompt_len))``.

    Example: prompt 5, max_tokens 4, 6 slots taken by this step, max_model_len 32: paged 0,
    oracle 3, pow2 10, max 26.
    """
    raise NotImplementedError(
        "lab 03-06, task 1: implement admission_lookahead (hint: python -m course hint 03-06 1)"
    )


def arrival_times(
    num_requests: int, rate: float, *, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times (seconds from the start, non-decreasing) of ``num_requests`` requests.

    The gaps between consecutive requests (and before the first) are independent, with mean
    ``1 / rate``: exponential when ``burstiness == 1`` (a Poisson process), gamma with shape
    ``burstiness`` and the same mean otherwise (``random.Random(seed).gammavariate``: its
    mean is shape x scale). ``rate == math.inf`` sends everything at time 0 (the burst).
    The same arguments always give the same times. ``ValueError`` (naming both values) for
    ``rate <= 0`` or ``burstiness <= 0``.
    """
    raise NotImplementedError(
        "lab 03-06, task 2: implement arrival_times (hint: python -m course hint 03-06 2)"
    )


def calculate_metrics(results: Sequence[RequestResult], duration: float,
                      goodput: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (90, 99)) -> dict[str, Any]:
    """The run's metrics over the completed requests (``error is None``).

    Keys: ``completed``, ``failed``, ``duration_s``, ``total_input_tokens`` (prompt lengths),
    ``total_output_tokens``, ``request_throughput``, ``output_throughput``,
    ``total_token_throughput`` (all per second of ``duration``), ``request_goodput``
    (completed requests meeting every SLO of ``goodput``, per second; ``None`` without
    ``goodput``), ``normalized_latency`` (the mean over requests of ``e2el /
    num_output_tokens``; ``None`` when nothing completed), and ``ttft``, ``tpot``, ``itl``
    (every gap of every request), ``e2el``: each a dict with ``mean``, ``median`` and
    ``p<p>`` for each percentile, or ``{}`` without values. A percentile is the nearest rank:
    the smallest value with at least p% of the values at or below it, i.e. the value of rank
    ``ceil(p * n / 100)`` among the ``n`` sorted values (rank 1 for ``p = 0``; p28 of 25 values
    is the 7th, p56 the 14th). Compute that rank exactly, in integers (``p`` may be a decimal
    such as 99.9): a float product rounds across the boundary (``28 / 100 * 25`` is
    7.000000000000001). Keys are written ``p90``, ``p99.9`` (``f"p{p:g}"``).

    ``goodput`` maps ``"ttft"``, ``"tpot"``, ``"e2el"`` to limits in seconds (a request meets
    one when its value is ``<=`` the limit). ``ValueError`` for ``duration <= 0`` or another
    SLO name.
    """
    raise NotImplementedError(
        "lab 03-06, task 3: implement calculate_metrics (hint: python -m course hint 03-06 3)"
    )


def sustained_rate(points: Sequence[dict[str, float]], threshold: float) -> float | None:
    """The request rate a setting sustains at ``threshold`` normalised latency (s/token).

    ``points`` are dicts with ``"rate"`` and ``"normalized_latency"``, in increasing rate. The
    answer is where the curve *first* reaches ``threshold`` (``>=``), linear between the two
    measured rates around it; the highest rate when it never does; ``None`` when the first
    point is already at or above it, or there are no points.
    """
    raise NotImplementedError(
        "lab 03-06, task 4: implement sustained_rate (hint: python -m course hint 03-06 4)"
    )
