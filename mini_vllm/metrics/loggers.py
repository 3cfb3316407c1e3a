"""The engine's metrics in Prometheus' text format, for ``GET /metrics``.

Names follow upstream's (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``,
...), so a dashboard or a ``vllm bench`` run made for vLLM reads them unchanged; the histogram
buckets are finer at the low end, because a CPU engine with a tiny model steps in milliseconds.
The text is written here (about 60 lines) rather than by ``prometheus_client``: the format is
simple, and seeing it is part of the lesson.

upstream: vllm/v1/metrics/loggers.py:153 @ v0.11.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mini_vllm.metrics.stats import IterationStats
from mini_vllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["EngineLoad", "PrometheusStatLogger", "CONTENT_TYPE"]

# The content type of Prometheus' text exposition format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class EngineLoad:
    """The engine's state after a step: its queues, its KV cache, its cumulative counters.

    ``kv_cache_usage`` is the fraction of usable blocks (the null block excluded) that some
    request holds, in ``[0, 1]``. The counters only grow.

    upstream: vllm/v1/metrics/stats.py:30 @ v0.11.0
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks_in_use: int = 0
    num_kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding's counters; None when the engine does not speculate (then, as
    # upstream, no spec_decode metric is exported).
    spec_decoding: SpecDecodingStats | None = None


def _labels(pairs: dict[str, str]) -> str:
    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    return "+Inf" if value == math.inf else repr(float(value))


class _Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = (*buckets, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out = [f"{name}_bucket{_labels({'le': _number(b), **labels})} {c}"
               for b, c in zip(self.bounds, self.counts)]
        out.append(f"{name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.counts[-1]}")
        return out


class PrometheusStatLogger:
    """Keeps the engine's gauges, counters and latency histograms; renders them as text.

    ``record`` is called by the engine loop after every step (and when it goes idle); ``render``
    by ``GET /metrics``. Every sample carries the ``model_name`` label.

    upstream: vllm/v1/metrics/loggers.py:153 @ v0.11.0
    """

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.load = EngineLoad()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)

    def record(self, load: EngineLoad, stats: IterationStats | None) -> None:
        """Take the engine's state after a step and the latencies the step completed.

        upstream: vllm/v1/metrics/loggers.py:525 @ v0.11.0
        """
        self.load = load
        if stats is None:
            return
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for value, reason in zip(stats.e2e_latencies, stats.finished_reasons):
            self.e2e.observe(value)
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self) -> str:
        """Every metric in the text exposition format (``CONTENT_TYPE``), ending in a newline."""
        load, labels, lines = self.load, self.labels, []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        def gauge(name: str, help_text: str, value: float) -> None:
            metric(name, "gauge", help_text, [f"{name}{_labels(labels)} {_number(value)}"])

        def counter(name: str, help_text: str, value: float) -> None:
            metric(name, "counter", help_text, [f"{name}_total{_labels(labels)} {_number(value)}"])

        gauge("vllm:num_requests_running", "Requests in the running batch.", load.num_running_reqs)
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (or swapped out).",
              load.num_waiting_reqs)
        gauge("vllm:kv_cache_usage_perc", "Fraction of usable KV blocks held by requests (1 = "
              "full).", load.kv_cache_usage)
        gauge("mini_vllm:kv_blocks_in_use", "KV blocks held by requests (the null block "
              "excluded).", load.num_kv_blocks_in_use)
        gauge("mini_vllm:kv_blocks_total", "Usable KV blocks (the null block excluded).",
              load.num_kv_blocks_total)
        counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                load.prefix_cache_queries)
        counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                load.prefix_cache_hits)
        gauge("mini_vllm:prefix_cache_hit_rate", "Prefix-cache hits / queries since the server "
              "started (0 before any query).",
              load.prefix_cache_hits / load.prefix_cache_queries if load.prefix_cache_queries
              else 0.0)
        counter("vllm:num_preemptions", "Requests preempted.", load.num_preemptions)
        counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.",
                self.prompt_tokens)
        counter("vllm:generation_tokens", "Tokens generated.", self.generation_tokens)
        spec = load.spec_decoding
        if spec is not None:
            counter("vllm:spec_decode_num_drafts", "Drafts checked (one per request and step "
                    "that checked draft tokens).", spec.num_drafts)
            counter("vllm:spec_decode_num_draft_tokens", "Draft tokens checked.",
                    spec.num_draft_tokens)
            counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                    spec.num_accepted_tokens)
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            metric(name, "counter", "Draft tokens accepted, by position in the draft.", [
                f"{name}_total{_labels({**labels, 'position': str(i)})} {_number(n)}"
                for i, n in enumerate(spec.accepted_per_pos)
            ])
        metric("vllm:request_success", "counter", "Requests finished, by reason.", [
            f"vllm:request_success_total{_labels({**labels, 'finished_reason': r})} {n}.0"
            for r, n in sorted(self.finished.items())
        ])
        for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Arrival to first token."),
            ("vllm:inter_token_latency_seconds", self.itl, "Time between a request's tokens."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Arrival to finish."),
        ):
            metric(name, "histogram", help_text, hist.lines(name, labels))
        return "\n".join(lines) + "\n"
