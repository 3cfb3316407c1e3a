"""What speculative decoding achieved: drafts proposed and checked, and tokens accepted.

A *draft* is one request's proposal checked in one step (``k`` tokens). If the target accepts
``a`` of them, the step emits ``a + 1`` tokens for that request (the accepted ones and one the
target chose itself), so the mean acceptance length ``1 + accepted / drafts`` is how many tokens
one forward pass yields per request. ``accepted_per_pos[i] / drafted_per_pos[i]`` is how often
the ``i``-th draft position survives; it falls with ``i``, since a token is only checked when
every one before it was accepted.

upstream: vllm/v1/spec_decode/metrics.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecDecodingStats"]


@dataclass
class SpecDecodingStats:
    """Counts since the engine started (or since a caller's snapshot; see :meth:`minus`).

    Invariants: ``num_accepted_tokens <= num_draft_tokens``; ``num_accepted_tokens ==
    sum(accepted_per_pos)``, ``num_draft_tokens == sum(drafted_per_pos)``, and
    ``accepted_per_pos[i] <= drafted_per_pos[i]`` (the lists grow with the longest draft seen,
    where upstream sizes them by ``num_speculative_tokens`` up front).

    upstream: vllm/v1/spec_decode/metrics.py:18 @ v0.11.0
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one checked draft of ``num_draft_tokens`` tokens, of which the first
        ``num_accepted_tokens`` were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"SpecDecodingStats: {num_accepted_tokens} accepted of "
                             f"{num_draft_tokens} drafted is impossible")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        grow = num_draft_tokens - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(num_draft_tokens):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted_tokens):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens checked (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per checked draft: ``1 + accepted / drafts`` (1.0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """``accepted_per_pos[i] / drafted_per_pos[i]`` for every position drafted so far."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos), list(self.drafted_per_pos))

    def minus(self, before: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted since the snapshot ``before`` (a :meth:`copy` taken earlier)."""
        return self._combine(before, -1)

    def plus(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Both counts together (two runs' totals)."""
        return self._combine(other, 1)

    def _combine(self, other: SpecDecodingStats, sign: int) -> SpecDecodingStats:
        def per_pos(mine: list[int], theirs: list[int]) -> list[int]:
            n = max(len(mine), len(theirs))
            mine, theirs = mine + [0] * (n - len(mine)), theirs + [0] * (n - len(theirs))
            return [a + sign * b for a, b in zip(mine, theirs)]
        return SpecDecodingStats(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            per_pos(self.accepted_per_pos, other.accepted_per_pos),
            per_pos(self.drafted_per_pos, other.drafted_per_pos))
