"""Predict, then measure: where each curve bends.

`python -m course measure 03-06 --plot load.png` runs the engine (the shipped tiny model) under a
KV budget of 64 blocks of 8 tokens, with your admission_lookahead deciding what a request
claims, your arrival_times sending a ShareGPT-shaped trace (x requests per second, Poisson) and
your calculate_metrics turning what the clients saw into the normalised latency (seconds per
output token) of paged memory, oracle reservation and reservation at the maximum length.
Answer the README's "Predict, then measure" questions before you look.

Times are wall-clock on your machine: read where the curves bend, not the last digit. Near a
bend a queue amplifies any hiccup of the machine, so the same point can differ severalfold
between two runs: each point runs ROUNDS times, and the table gives the median and the range.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

TITLE = "Normalised latency against request rate, KV memory the bottleneck"
X_LABEL = "request rate (requests per second, Poisson)"
Y_LABEL = "normalised latency (s per output token)"
POLICIES = ("paged", "oracle", "max")
NUM_REQUESTS, SCALE, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS = 24, 0.125, 256, 8, 65
ROUNDS, SPREAD = 2, True


def sizes(quick: bool) -> list[int]:
    """Rates from below the first bend (reserving the maximum bends near 3.4 req/s) to where
    the reservations have all bent and paged memory has not (the README's figure)."""
    return [4, 16] if quick else [2, 4, 8, 16]


def seconds(rate: int) -> float:
    """One run of the three policies at `rate` on a quiet 2-core machine: the trace's arrivals
    (NUM_REQUESTS / rate each) plus about 12 s of decoding, most of it the reservation at the
    maximum length, which serves two requests at a time."""
    return len(POLICIES) * NUM_REQUESTS / rate + 12


@functools.cache
def _requests():
    from mini_vllm.benchmarks.datasets import sharegpt_like_requests

    return tuple(sharegpt_like_requests(NUM_REQUESTS, scale=SCALE, max_model_len=MAX_MODEL_LEN))


@contextlib.contextmanager
def _admission(impl):
    """The scheduler admits with impl's admission_lookahead while the block runs."""
    from mini_vllm.core.sched import reservation  # the scheduler looks the function up here

    saved = reservation.admission_lookahead
    reservation.admission_lookahead = impl.admission_lookahead
    try:
        yield
    finally:
        reservation.admission_lookahead = saved


def _latency(impl, policy: str, rate: int) -> float:
    from mini_vllm.engine.async_llm import AsyncLLM
    from mini_vllm.entrypoints.llm import LLM

    requests = list(_requests())
    times = impl.arrival_times(len(requests), float(rate), seed=0)
    llm = LLM(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
              enable_prefix_caching=False, num_threads=1, kv_reservation=policy)
    engine = AsyncLLM(llm, multiprocessing=False)  # the admission patch is this process's
    try:
        with _admission(impl):
            results, duration = asyncio.run(impl.run_in_process(engine, requests, times))
    finally:
        engine.shutdown()
    return impl.calculate_metrics(results, duration)["normalized_latency"]


def run(impl, rate: int) -> dict[str, float | None]:
    """Your pieces: one normalised latency per policy at this rate."""
    return {policy: _latency(impl, policy, rate) for policy in POLICIES}
