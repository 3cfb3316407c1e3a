"""Graded tests of lab 03-06: reservation at admission, arrivals, the serving metrics.

Groups, each using only its task:
  1. task 1: admission_lookahead's values, then the reference scheduler admitting with yours
     under a 16-block budget (each policy admits exactly what its reservation leaves room for,
     and a reserving request never needs another block)
  2. task 2: arrivals: seeded, the mean gap 1/rate, exponential (Poisson) or gamma gaps, burst
  3. task 3: the metrics of hand-made results whose answers are known
  4. task 4: the sustained rate at a threshold
No timing is asserted: only what the numbers must be given the timestamps.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction

import pytest

from course.labs.loader import load_lab
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.sched import reservation
from mini_vllm.core.sched import scheduler as scheduler_module
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)

# ------------------------------------------------------------------------------ task 1

BLOCK, USABLE, MAX_LEN = 4, 16, 32
# Prompt 5, max_tokens 4 (final 9) under 16 blocks of 4: what each policy claims and admits.
CLAIMS = {"paged": (2, 8), "oracle": (3, 5), "pow2": (4, 4), "max": (8, 2)}


@pytest.mark.parametrize("policy,prompt,max_tokens,after_step,want", [
    ("paged", 5, 4, 6, 0),
    ("oracle", 5, 4, 6, 3),
    ("pow2", 5, 4, 6, 10),
    ("max", 5, 4, 6, 26),
    ("oracle", 5, 4, 5, 4),      # a step that takes only the prompt
    ("pow2", 9, 8, 9, 23),       # final 17 -> 32, not 16
    ("pow2", 8, 8, 16, 0),       # final 16 is a power of two: exactly it, nothing beyond
    ("oracle", 5, 10_000, 5, 27),  # max_tokens beyond the model: final length capped at 32
    ("pow2", 20, 100, 20, 12),   # capped at max_model_len, not 128
    ("max", 30, 50, 31, 1),
    ("oracle", 5, 1, 5, 1),      # one token to make: the final length is 6, not 7
])
def test_admission_lookahead(policy, prompt, max_tokens, after_step, want):
    got = lab.admission_lookahead(policy, prompt, max_tokens, after_step, MAX_LEN)
    assert got == want, (
        f"admission_lookahead({policy!r}, prompt {prompt}, max_tokens {max_tokens}, "
        f"{after_step} slots this step, max_model_len {MAX_LEN}) is {want}, got {got}")


def test_admission_lookahead_is_never_negative():
    # A chunk that already covers the reservation leaves nothing to claim ahead.
    assert lab.admission_lookahead("oracle", 5, 2, 8, MAX_LEN) == 0, (
        f"oracle, prompt 5, max_tokens 2, 8 slots this step: the step covers the 7-slot "
        f"reservation, so the lookahead is 0 (never negative), got "
        f"{lab.admission_lookahead('oracle', 5, 2, 8, MAX_LEN)}")


def make_scheduler(policy, monkeypatch):
    monkeypatch.setattr(reservation, "admission_lookahead", lab.admission_lookahead)
    return scheduler_module.Scheduler(SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=MAX_LEN, block_size=BLOCK,
        num_gpu_blocks=USABLE + 1, enable_prefix_caching=False, kv_reservation=policy))


def add(scheduler, n, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        scheduler.add_request(Request(f"r{i}", [7] * 5, params, eos_token_id=None))


def held(scheduler):
    manager = scheduler.kv_cache_manager
    return {r.request_id: len(manager.get_block_ids(r.request_id)[0]) for r in scheduler.running}


@pytest.mark.parametrize("policy", list(CLAIMS))
def test_the_engine_admits_what_each_reservation_leaves_room_for(policy, monkeypatch):
    scheduler = make_scheduler(policy, monkeypatch)
    add(scheduler, 10)
    scheduler.schedule()
    blocks, fits = CLAIMS[policy]
    assert held(scheduler) == {f"r{i}": blocks for i in range(fits)}, (
        f"kv_reservation={policy!r}: 16 free blocks of 4 should admit r0..r{fits - 1} "
        f"({blocks} blocks each: prompt 5, max_tokens 4), got {held(scheduler)}")


@pytest.mark.parametrize("policy", ["oracle", "pow2", "max"])
def test_a_reserving_request_runs_to_the_end_without_another_block(policy, monkeypatch):
    scheduler = make_scheduler(policy, monkeypatch)
    add(scheduler, 6)
    blocks = CLAIMS[policy][0]
    for _ in range(200):  # six short requests finish in a few dozen steps; a stall fails, not hangs
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        for rid, n in held(scheduler).items():
            assert n == blocks, f"{rid} holds {n} blocks mid-run, its reservation is {blocks}"
        scheduler.update_from_output(out, ModelRunnerOutput(
            ids, {r: i for i, r in enumerate(ids)}, [[1] for _ in ids]))
    else:
        pytest.fail(f"kv_reservation={policy!r}: six requests of 4 tokens each were still "
                    "unfinished after 200 steps; does schedule() admit waiting requests and "
                    "update_from_output() finish them?")
    assert scheduler.stats.num_preemptions == 0, (
        f"kv_reservation={policy!r}: {scheduler.stats.num_preemptions} preemptions; a request "
        f"that reserved its final length never needs another block")
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == USABLE, (
        f"kv_reservation={policy!r}: after every request finished all {USABLE} blocks should be "
        f"free, got {scheduler.kv_cache_manager.block_pool.get_num_free_blocks()}")


# ------------------------------------------------------------------------------ task 2


def gaps(times):
    return [b - a for a, b in zip([0.0, *times], times)]


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    times = lab.arrival_times(4000, 5.0, seed=3)
    assert len(times) == 4000 and times == sorted(times) and times[0] > 0, (
        f"arrival_times(4000, 5.0, seed=3) should give 4000 non-decreasing times after 0, got "
        f"{len(times)} times, first {times[:1]}, sorted: {times == sorted(times)}")
    assert times == lab.arrival_times(4000, 5.0, seed=3), (
        "two calls with seed=3 gave different times: draw the gaps from a random.Random(seed) "
        "of their own")
    assert times != lab.arrival_times(4000, 5.0, seed=4), (
        "seeds 3 and 4 gave the same times: the seed must drive the gaps")
    g = gaps(times)
    # 4000 exponential gaps of mean 0.2: the sample mean is within 5%, and so is the spread
    # (an exponential's standard deviation equals its mean) within 10%.
    assert statistics.fmean(g) == pytest.approx(0.2, rel=0.05), (
        f"at 5 requests/s the mean gap is 1/rate = 0.2 s (within 5%), got "
        f"{statistics.fmean(g):.4f}")
    assert statistics.pstdev(g) == pytest.approx(0.2, rel=0.1), (
        f"Poisson gaps are exponential: their spread equals the mean 0.2 s (within 10%), got "
        f"{statistics.pstdev(g):.4f}")


def test_burstiness_keeps_the_mean_and_changes_the_spread():
    for shape in (0.25, 4.0):
        g = gaps(lab.arrival_times(4000, 5.0, burstiness=shape, seed=1))
        assert statistics.fmean(g) == pytest.approx(0.2, rel=0.1), shape
        # A gamma of shape k has standard deviation mean / sqrt(k).
        assert statistics.pstdev(g) == pytest.approx(0.2 / math.sqrt(shape), rel=0.15), shape


def test_the_burst_sends_everything_at_once_and_bad_rates_are_refused():
    assert lab.arrival_times(5, math.inf) == [0.0] * 5, (
        f"rate inf is the burst: five times of 0.0, got {lab.arrival_times(5, math.inf)}")
    fast = lab.arrival_times(5, 1e6)
    assert fast[-1] < 0.01, (
        f"at a million requests per second the fifth is sent at {fast[-1]} s: the times start "
        "from 0 (the first is its own gap after the start)")
    assert len(lab.arrival_times(3, 0.5)) == 3, "a rate below one request per second is valid"
    assert lab.arrival_times(5, 2.0) == lab.arrival_times(5, 2.0, seed=0), (
        "without a seed the times are those of seed=0 (the signature's default)")
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (2.0, 0.0)):
        with pytest.raises(ValueError) as err:
            lab.arrival_times(3, rate, burstiness=burstiness)
        assert str(rate) in str(err.value) and str(burstiness) in str(err.value), (
            f"the ValueError for rate {rate}, burstiness {burstiness} should name both, got "
            f"{str(err.value)[:120]!r}")


# ------------------------------------------------------------------------------ task 3


def result(sent, chunks, prompt_len=10, error=None):
    return lab.RequestResult(prompt_len, sum(n for _, n in chunks), sent, list(chunks), error)


# r0: sent at 0, tokens at 1 (one), 2 (two), 4 (one): TTFT 1, e2el 4, TPOT 3/3, ITLs 1, 2.
# r1: sent at 1, one token at 3: TTFT 2, e2el 2, TPOT 0.  r2 failed.
RESULTS = [((0.0, [(1.0, 1), (2.0, 2), (4.0, 1)]), {}), ((1.0, [(3.0, 1)]), {"prompt_len": 6}),
           ((2.0, []), {"error": "boom"})]


def results():
    return [result(*args, **kw) for args, kw in RESULTS]


def test_inter_token_latencies_are_the_gaps_after_the_first_token():
    """ITLs are the gaps between one stream's chunks, never its wait for the first token: here
    the first token takes 5 s, the next chunks 1 s and 2 s (in RESULTS both lists hold 1 and 2,
    so mixing them up goes unseen there)."""
    m = lab.calculate_metrics([result(0.0, [(5.0, 1), (6.0, 1), (8.0, 1)])], duration=10.0,
                              percentiles=(50, 100))
    assert m["ttft"]["mean"] == pytest.approx(5.0), (
        f"a stream sent at 0 with its first token at 5 s has TTFT 5 s, got {m['ttft']['mean']}")
    assert m["itl"] == pytest.approx({"mean": 1.5, "median": 1.5, "p50": 1.0, "p100": 2.0}), (
        f"ITL {m['itl']}: the gaps are 1 s and 2 s; the 5 s before the first token is the "
        "TTFT, not an inter-token latency")


def test_counts_and_throughputs_use_completed_requests_only():
    m = lab.calculate_metrics(results(), duration=5.0)
    assert (m["completed"], m["failed"], m["duration_s"]) == (2, 1, 5.0), (
        f"(completed, failed, duration_s) should be (2, 1, 5.0): r2 has an error; got "
        f"{(m['completed'], m['failed'], m['duration_s'])}")
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (16, 5), (
        f"input and output tokens of the 2 completed requests are (10 + 6, 4 + 1) = (16, 5), "
        f"got {(m['total_input_tokens'], m['total_output_tokens'])}")
    assert m["request_throughput"] == pytest.approx(2 / 5), (
        f"request_throughput: 2 completed in 5 s is 0.4/s (the failed one does not count), "
        f"got {m['request_throughput']}")
    assert m["output_throughput"] == pytest.approx(5 / 5), (
        f"output_throughput: 5 tokens in 5 s is 1.0/s, got {m['output_throughput']}")
    assert m["total_token_throughput"] == pytest.approx(21 / 5), (
        f"total_token_throughput: (16 + 5) tokens in 5 s is 4.2/s, got "
        f"{m['total_token_throughput']}")
    assert m["request_goodput"] is None, (
        f"without goodput SLOs request_goodput is None, got {m['request_goodput']}")


def test_latencies_and_their_percentiles():
    m = lab.calculate_metrics(results(), duration=5.0, percentiles=(50, 90, 99.9))
    assert m["ttft"] == pytest.approx({"mean": 1.5, "median": 1.5, "p50": 1.0, "p90": 2.0,
                                       "p99.9": 2.0}), (
        f"TTFTs 1 s (r0) and 2 s (r1): mean 1.5, median 1.5, p50 1.0, p90 2.0, p99.9 2.0; "
        f"got {m['ttft']}")
    assert m["tpot"]["mean"] == pytest.approx(0.5) and m["tpot"]["p50"] == pytest.approx(0.0), (
        f"TPOTs are r0's (4 - 1) / 3 = 1.0 and r1's 0 (one token): mean 0.5, p50 0.0, "
        f"got {m['tpot']}")
    assert m["itl"] == pytest.approx({"mean": 1.5, "median": 1.5, "p50": 1.0, "p90": 2.0,
                                      "p99.9": 2.0}), (
        f"ITLs are r0's gaps 1 s and 2 s (r1 has one chunk, r2 failed): mean 1.5, p50 1.0, "
        f"p90 2.0; got {m['itl']}")
    assert m["e2el"]["median"] == pytest.approx(3.0) and m["e2el"]["p50"] == pytest.approx(2.0), (
        f"end-to-end latencies 4 s and 2 s: median 3.0, p50 (nearest rank) 2.0, "
        f"got {m['e2el']}")
    # Normalised latency: the mean of e2el / tokens = (4/4 + 2/1) / 2.
    assert m["normalized_latency"] == pytest.approx(1.5), (
        f"normalized_latency is the mean of e2el / output tokens, (4/4 + 2/1) / 2 = 1.5, "
        f"got {m['normalized_latency']}")


def ranked(n):
    """``n`` results whose TTFTs are 1, 2, ..., n seconds (given largest first): the k-th
    smallest TTFT is k, so a percentile's value is its rank."""
    return [result(0.0, [(float(k), 1)]) for k in range(n, 0, -1)]


def rank_by_definition(p, n):
    """The nearest rank read straight from its definition: the first of the n sorted values with
    at least p% of the values at or below it (r / n >= p / 100, in exact fractions)."""
    return next(r for r in range(1, n + 1) if Fraction(r, n) >= Fraction(str(p)) / 100)


def test_percentiles_are_the_nearest_rank_exactly_at_the_boundaries():
    # 28% and 56% of 25 values are exactly 7 and 14 values: p28 is the 7th, p56 the 14th (a
    # float's ceil(28 / 100 * 25) is 8, one rank high).
    ttft = lab.calculate_metrics(ranked(25), 1.0, percentiles=(0, 4, 28, 56, 100))["ttft"]
    want = {"p0": 1.0, "p4": 1.0, "p28": 7.0, "p56": 14.0, "p100": 25.0}
    got = {key: ttft.get(key) for key in want}
    assert got == want, (
        f"percentiles of the values 1..25 are {got}, expected {want}: take the value of rank "
        "ceil(p * n / 100) (at least 1), computed in integers, e.g. (p * n + 99) // 100")


def test_percentiles_match_the_definition_for_many_sizes():
    percentiles = (0, 1, 5, 10, 12.5, 25, 28, 33, 50, 56, 57, 75, 90, 95, 99, 99.9, 100)
    for n in (1, 2, 3, 7, 10, 25, 40, 50, 99, 100, 101, 1000):
        ttft = lab.calculate_metrics(ranked(n), 1.0, percentiles=percentiles)["ttft"]
        for p in percentiles:
            want = float(rank_by_definition(p, n))
            assert ttft.get(f"p{p:g}") == want, (
                f"p{p:g} of the values 1..{n} is {ttft.get(f'p{p:g}')}, but the smallest value "
                f"with at least {p:g}% of them at or below it is {want:g}: compute the rank "
                "ceil(p * n / 100) exactly (no float product)")


def test_goodput_counts_requests_meeting_every_slo():
    assert lab.calculate_metrics(results(), 5.0, {"ttft": 1.5})["request_goodput"] == \
        pytest.approx(1 / 5), (  # r0 only
            f"goodput for TTFT <= 1.5 s: only r0 (1 s) meets it, 1 / 5 s = 0.2, got "
            f"{lab.calculate_metrics(results(), 5.0, {'ttft': 1.5})['request_goodput']}")
    assert lab.calculate_metrics(results(), 5.0, {"ttft": 2.0})["request_goodput"] == \
        pytest.approx(2 / 5), (  # a limit is met with equality
            f"goodput for TTFT <= 2.0 s: r1's TTFT of exactly 2 s meets it too (<=), so 2 / 5 s = "
            f"0.4, got {lab.calculate_metrics(results(), 5.0, {'ttft': 2.0})['request_goodput']}")
    # r0 misses the TPOT limit, r1 the end-to-end one.
    assert lab.calculate_metrics(results(), 5.0, {"tpot": 0.5, "e2el": 1.5})[
        "request_goodput"] == 0.0, (
            "goodput needs every SLO met: r0 misses TPOT <= 0.5 (its TPOT is 1.0) and r1 "
            "e2el <= 1.5 (its e2el is 2 s), so 0.0")


def test_nothing_completed_and_bad_input():
    m = lab.calculate_metrics([result(0.0, [], error="x")], 1.0)
    assert m["completed"] == 0 and m["normalized_latency"] is None and m["ttft"] == {}, (
        f"with only a failed request: completed 0, normalized_latency None, ttft {{}} expected, "
        f"got {m.get('completed')}, {m.get('normalized_latency')}, {m.get('ttft')}")
    with pytest.raises(ValueError, match="latency"):
        lab.calculate_metrics(results(), 5.0, {"latency": 1.0})
    with pytest.raises(ValueError):
        lab.calculate_metrics(results(), 0.0)


# ------------------------------------------------------------------------------ task 4

POINTS = [{"rate": 1, "normalized_latency": 0.02}, {"rate": 2, "normalized_latency": 0.03},
          {"rate": 4, "normalized_latency": 0.07}, {"rate": 8, "normalized_latency": 0.01}]


def test_sustained_rate_interpolates_the_first_crossing():
    # 0.04 lies a quarter of the way from 0.03 (rate 2) to 0.07 (rate 4).
    assert lab.sustained_rate(POINTS, 0.04) == pytest.approx(2.5), (
        f"0.04 lies a quarter of the way from 0.03 (rate 2) to 0.07 (rate 4): rate 2.5, "
        f"got {lab.sustained_rate(POINTS, 0.04)}")
    assert lab.sustained_rate(POINTS, 0.03) == pytest.approx(2.0), (
        f"0.03 is first reached exactly at rate 2: 2.0, got {lab.sustained_rate(POINTS, 0.03)}")
    assert lab.sustained_rate(POINTS, 0.025) == pytest.approx(1.5), (
        f"0.025 lies halfway from 0.02 (rate 1) to 0.03 (rate 2): rate 1.5, "
        f"got {lab.sustained_rate(POINTS, 0.025)}")


def test_sustained_rate_edges():
    assert lab.sustained_rate(POINTS[:2], 0.5) == 2, (  # never reached: the highest rate
        f"0.5 is never reached: the highest measured rate, 2, got "
        f"{lab.sustained_rate(POINTS[:2], 0.5)}")
    assert lab.sustained_rate(POINTS, 0.02) is None, (  # the first point is already there
        f"the first point (0.02 at rate 1) already reaches 0.02: None, got "
        f"{lab.sustained_rate(POINTS, 0.02)}")
    assert lab.sustained_rate([], 0.04) is None, (
        f"no points sustain nothing: None, got {lab.sustained_rate([], 0.04)}")
