"""How many draft tokens to check for a request: as many as pay for the rows they add.

Checking ``j`` drafts adds ``j`` rows to the next forward pass. If each draft survives, given
that the ones before it did, with probability ``a``, the step emits on average
``1 + a + a^2 + ... + a^j`` tokens for the request instead of 1. Whether that is a gain depends
on what the extra rows cost: on a GPU almost nothing until the batch is large; on a CPU a row of
fp32 weights is real arithmetic, and a quantized kernel may take one row on a fast path that two
rows leave. So the policy measures both as the engine runs:

* ``a`` per request, from its own recent drafts (a decayed count, so a request that moves from
  copying its input to writing something new stops drafting within a few steps; the decay also
  runs on steps without drafts, so an estimate drifts back towards its prior and the request
  tries again later);
* the seconds of a decode step by the number of rows it computes (a running average per count).

and picks the ``j`` that maximises tokens per second for the batch, treating the other requests
as one row each: ``(B - 1 + tokens(j)) / (seconds(B + j) + j * draft_seconds)``, where
``draft_seconds`` is what one pass of a draft model costs (measured the same way; 0 for an n-gram
lookup, which runs no model). Until a step without drafts has been
measured for the batch's size, nothing is drafted (that cost is what drafts must beat); after
that, a row count not yet measured is taken to cost what the largest measured count below it
costs, so longer drafts get tried once, and their real cost decides from then on. The step
without drafts is measured again every ``REMEASURE`` steps: a slow measurement of it (the
machine busy for a moment) would otherwise make drafting look cheap for good, since a batch
that drafts never runs the step that would correct it. A measurement that old is replaced,
not averaged.

upstream: none (vLLM checks every draft its proposer returns; its knob for drafts that stop paying
is ``num_speculative_tokens_per_batch_size``, a draft length chosen by batch size)
"""

from __future__ import annotations

__all__ = ["DraftPolicy"]

# The weight of history in each update: after one step, an old observation counts this much.
DECAY = 0.7
# The prior acceptance, worth one observation: a new request drafts (optimism buys a measurement).
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 1.0
# The weight of a new step-time measurement in the running average.
COST_WEIGHT = 0.2
# A step without drafts is measured again after this many steps of others.
REMEASURE = 32


class DraftPolicy:
    """Chooses each request's draft length from measured acceptance and measured step costs.

    Invariant: :meth:`num_drafts` returns an int in ``[0, max_drafts]``: 0 while no step of
    the batch's size has been measured, ``max_drafts`` for a request with no history once only
    that step has been.
    """

    def __init__(self, max_drafts: int) -> None:
        if not isinstance(max_drafts, int) or max_drafts < 1:
            raise ValueError(f"DraftPolicy: max_drafts must be an int >= 1, got {max_drafts!r}")
        self.max_drafts = max_drafts
        self._accepted: dict[str, float] = {}
        self._checked: dict[str, float] = {}
        self._seconds: dict[int, float] = {}
        self._age: dict[int, int] = {}  # steps since each row count was last measured
        self.draft_seconds = 0.0

    def acceptance(self, req_id: str) -> float:
        """The estimated probability that a draft token of ``req_id`` is accepted, given that
        the ones before it were."""
        accepted, checked = self._accepted.get(req_id, 0.0), self._checked.get(req_id, 0.0)
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (checked + PRIOR_WEIGHT)

    def observe_draft(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """``num_accepted`` of ``num_drafts`` checked drafts were accepted. Every accepted token
        and the first rejected one (if any) are observations; the drafts after it were never
        judged."""
        checked = min(num_accepted + 1, num_drafts)
        self._accepted[req_id] = self._accepted.get(req_id, 0.0) + num_accepted
        self._checked[req_id] = self._checked.get(req_id, 0.0) + checked

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode step of ``num_rows`` rows (one per request plus its drafts) took
        ``seconds``; every request's history decays by one step."""
        old = self._seconds.get(num_rows)
        stale = self._age.get(num_rows, 0) >= REMEASURE
        self._seconds[num_rows] = (seconds if old is None or stale
                                   else (1 - COST_WEIGHT) * old + COST_WEIGHT * seconds)
        for rows in self._age:
            self._age[rows] += 1
        self._age[num_rows] = 0
        for counts in (self._accepted, self._checked):
            for req_id in counts:
                counts[req_id] *= DECAY

    def observe_draft_cost(self, num_passes: int, seconds: float) -> None:
        """A draft model proposed in ``num_passes`` forward passes that took ``seconds``."""
        if num_passes < 1:
            return
        per_pass = seconds / num_passes
        self.draft_seconds = (per_pass if not self.draft_seconds
                              else (1 - COST_WEIGHT) * self.draft_seconds + COST_WEIGHT * per_pass)

    def seconds(self, num_rows: int) -> float | None:
        """The estimated seconds of a step of ``num_rows`` rows (``None`` before any is
        measured): measured, or the largest measured count below it."""
        below = [n for n in self._seconds if n <= num_rows]
        return self._seconds[max(below)] if below else None

    def num_drafts(self, req_id: str, batch_rows: int) -> int:
        """How many drafts ``req_id`` should have checked in a step whose batch has
        ``batch_rows`` requests (see the module docstring)."""
        if self.seconds(batch_rows) is None or self._age.get(batch_rows, 0) >= REMEASURE:
            return 0  # measure a step without drafts (again): the cost every draft must beat
        alpha = self.acceptance(req_id)
        best, best_rate = 0, None
        for j in range(self.max_drafts + 1):
            seconds = self.seconds(batch_rows + j)
            tokens = sum(alpha ** i for i in range(j + 1))
            rate = (batch_rows - 1 + tokens) / (seconds + j * self.draft_seconds)
            if best_rate is None or rate > best_rate:
                best, best_rate = j, rate
        return best

    def retain(self, req_ids: set[str]) -> None:
        """Forget every request not in ``req_ids`` (finished)."""
        for counts in (self._accepted, self._checked):
            for req_id in [r for r in counts if r not in req_ids]:
                del counts[req_id]
