"""Prefix-cache statistics: how many prompt tokens were looked up in the cache, and how many hit.

upstream: vllm/v1/metrics/stats.py:16 @ v0.11.0
"""

from __future__ import annotations

from dataclasses import dataclass


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
