"""What the engine counts: prefix-cache lookups and hits, each step's latencies and tokens
(for ``GET /metrics``), and the totals ``python -m mini_vllm`` and the benchmarks print.

upstream: vllm/v1/metrics/stats.py
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mini_vllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["EngineStats", "IterationStats", "PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Counters of prefix-cache lookups since the last time they were taken.

    ``queries`` counts tokens looked up (a request's whole length, at each lookup) and ``hits``
    the tokens served from the cache, so ``0 <= hits <= queries``. ``reset`` records that the
    prefix cache was reset during the interval.

    upstream: vllm/v1/metrics/stats.py:16 @ v0.11.0
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries``, or 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class IterationStats:
    """What one engine step did, for the metrics: the latencies it completed and its tokens.

    ``time_to_first_tokens``: seconds from arrival to the first token, one per request that got
    its first token this step. ``inter_token_latencies``: seconds since the request's previous
    token, one per request that got a later token. ``e2e_latencies``: arrival to finish, one per
    request that finished; ``finished_reasons`` the matching reasons.

    upstream: vllm/v1/metrics/stats.py:92 @ v0.11.0
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)



@dataclass
class EngineStats:
    """What the engine did, for people (``python -m mini_vllm``) and benchmarks.

    ``kv_blocks_in_use`` is the count after the last step; ``peak_kv_blocks_in_use`` the
    largest count seen after any step. ``peak_kv_blocks_in_step`` and ``num_kv_block_steps``
    are taken inside each step, right after scheduling, before finished requests free their
    blocks: the largest count, and the sum over steps (block-steps). They see what a request
    that finishes within its step held (a beam-search step's one-token requests), which the
    after-step counts miss. ``EngineCore.step`` takes them; a step written in lab 03-04 need
    not call ``_record_blocks_in_step``, and then they read 0. The prefix-cache hit rate is
    over every lookup (tokens hit / tokens queried).

    upstream: none (vLLM reports these through vllm/v1/metrics)
    """

    num_steps: int = 0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    elapsed_s: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    peak_kv_blocks_in_use: int = 0
    peak_kv_blocks_in_step: int = 0
    num_kv_block_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    kv_cache_dtype: str = "auto"
    kv_cache_torch_dtype: str = ""
    kv_block_bytes: int = 0
    # Speculative decoding's drafts and acceptances (all zero without it).
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def peak_blocks(self) -> int:
        """The most blocks held at once: inside a step when the step counted them (a beam
        search's requests finish within their step and free everything before the step
        ends), else after a step."""
        return max(self.peak_kv_blocks_in_use, self.peak_kv_blocks_in_step)

    @property
    def generation_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def add(self, step: EngineStats) -> None:
        """Fold one call's statistics into this running total: counts add up, the peak is the
        largest, the rest (sizes, the last state) is the latest call's."""
        for f in dataclasses.fields(EngineStats):
            value = getattr(step, f.name)
            if f.name == "spec_decoding":
                value = value.plus(self.spec_decoding)
            elif f.name.startswith("peak_"):
                value = max(value, getattr(self, f.name))
            elif f.name.startswith("num_") or f.name in ("elapsed_s", "prefix_cache_queries",
                                                        "prefix_cache_hits"):
                value += getattr(self, f.name)
            setattr(self, f.name, value)

    def summary(self) -> str:
        """A few human-readable lines."""
        return "\n".join([
            f"steps: {self.num_steps}   requests: {self.num_requests}   "
            f"time: {self.elapsed_s:.2f} s",
            f"tokens: {self.num_prompt_tokens} prompt ({self.num_prompt_tokens_computed} "
            f"computed), {self.num_generated_tokens} generated, "
            f"{self.generation_tokens_per_s:.1f} generated tokens/s",
            f"KV blocks in use: {self.kv_blocks_in_use} of {self.kv_blocks_total} "
            f"(peak {self.peak_blocks} within a step)   KV cache dtype: {self.kv_cache_dtype} "
            f"({self.kv_cache_torch_dtype}, {self.kv_block_bytes} bytes per block)",
            f"prefix-cache hit rate: {100 * self.prefix_cache_hit_rate:.1f}% "
            f"({self.prefix_cache_hits} of {self.prefix_cache_queries} tokens)",
            f"preemptions: {self.num_preemptions}   blocks swapped out/in: "
            f"{self.num_blocks_swapped_out}/{self.num_blocks_swapped_in}",
            *self._spec_lines(),
        ])

    def _spec_lines(self) -> list[str]:
        spec = self.spec_decoding
        if not spec.num_drafts:
            return []
        per_pos = ", ".join(f"{rate:.2f}" for rate in spec.per_position_acceptance)
        return [f"speculative decoding: {spec.num_drafts} drafts, {spec.num_accepted_tokens} of "
                f"{spec.num_draft_tokens} draft tokens accepted "
                f"({100 * spec.acceptance_rate:.1f}%), mean acceptance length "
                f"{spec.mean_acceptance_length:.2f}, per position: {per_pos}"]
