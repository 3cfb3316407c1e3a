"""Known-wrong edits of the lab 03-06 reference (mini_vllm/core/sched/reservation.py and the load
generator, mini_vllm/benchmarks/serve.py) that its tests must reject."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

RESERVATION = "mini_vllm/core/sched/reservation.py"
SERVE = "mini_vllm/benchmarks/serve.py"

BUGS = [
    PlantedBug(
        name="lookahead-is-the-whole-reservation",
        description="admission_lookahead returns the whole reservation instead of what is left "
        "beyond the step's tokens, so a request claims its prompt twice",
        file=RESERVATION,
        find="return max(0, reserved - num_tokens_after_step)",
        replace="return reserved",
    ),
    PlantedBug(
        name="final-length-capped-one-short",
        description="the final length is capped one token below max_model_len, so a request "
        "whose max_tokens runs past the model reserves one slot too few",
        file=RESERVATION,
        find="output_len = max(1, min(max_tokens, max_model_len - prompt_len))",
        replace="output_len = max(1, min(max_tokens, max_model_len - prompt_len - 1))",
    ),
    PlantedBug(
        name="gamma-scale-ignores-burstiness",
        description="the gamma gaps have scale 1/rate whatever the shape, so a bursty load "
        "sends at burstiness x the rate asked for",
        file=SERVE,
        find="now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))",
        replace="now += rng.gammavariate(burstiness, 1.0 / rate)",
    ),
    PlantedBug(
        name="throughput-counts-failed-requests",
        description="request throughput counts the failed requests as served",
        file=SERVE,
        find='"request_throughput": len(done) / duration,',
        replace='"request_throughput": len(results) / duration,',
    ),
    PlantedBug(
        name="itl-includes-the-first-token-wait",
        description="each stream's inter-token latencies start with its time to first token, "
        "so ITL mixes the wait for the first token with the gaps between tokens",
        file=SERVE,
        find='("itl", [x for r in done for x in r.itls]),',
        replace='("itl", [x for r in done for x in [r.ttft, *r.itls]]),',
    ),
    PlantedBug(
        name="percentile-one-rank-high",
        description="the nearest-rank percentile takes the value one rank above",
        file=SERVE,
        find='out[f"p{p:g}"] = ordered[nearest_rank(p, len(ordered)) - 1]',
        replace='out[f"p{p:g}"] = ordered[min(len(ordered) - 1, nearest_rank(p, len(ordered)))]',
    ),
    PlantedBug(
        name="percentile-rank-through-a-float",
        description="the nearest rank is ceil(p / 100 * n) in floating point, which lands one "
        "rank high where p * n / 100 is a whole number the float misses (p28 of 25 values)",
        file=SERVE,
        find="return max(1, (a * n + b - 1) // b)",
        replace="return max(1, math.ceil(p / 100 * n))",
    ),
    PlantedBug(
        name="slo-met-strictly-below",
        description="a request that meets an SLO with equality is not counted as good",
        file=SERVE,
        find="if all(getattr(r, name) <= limit for name, limit in (goodput or {}).items())]",
        replace="if all(getattr(r, name) < limit for name, limit in (goodput or {}).items())]",
    ),
    PlantedBug(
        name="sustained-rate-not-interpolated",
        description="the sustained rate is the last rate below the threshold, not the crossing",
        file=SERVE,
        find="return r0 + (threshold - l0) * (r1 - r0) / (l1 - l0)",
        replace="return r0",
    ),
]
