"""The engine side of log-probabilities: rows of numbers from the runner become, per position,
the dicts ``token id -> Logprob`` the user reads.

upstream: vllm/v1/engine/logprobs.py
"""

from __future__ import annotations

import itertools
from typing import Any

from mini_vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from mini_vllm.outputs import LogprobsLists


class LogprobsProcessor:
    """Collects one request's log-probabilities, step by step, in upstream's shapes.

    Invariants: ``logprobs`` has one dict per sampled row received (``None`` when the request did
    not ask); ``prompt_logprobs[p]`` is the dict of prompt position ``p`` once a row for it
    arrived (position 0 stays ``None``); a row that arrives twice (a prefill recomputed after
    preemption) replaces the first, which held the same numbers.

    upstream: vllm/v1/engine/logprobs.py:22 @ v0.11.0
    """

    def __init__(self, tokenizer: Any, num_logprobs: int | None,
                 num_prompt_logprobs: int | None, num_prompt_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = (
            None if num_prompt_logprobs is None else [None] * num_prompt_tokens)
        self._prompt_rows_seen: set[int] = set()

    def add_sampled(self, rows: LogprobsLists) -> None:
        """Append the dicts of newly sampled tokens (a row's first entry is its own token)."""
        if self.logprobs is None:
            return
        for ids, values, rank in zip(*rows):
            self.cumulative_logprob += values[0]
            self.logprobs.append(self._make_dict(ids, values, rank, self.num_logprobs))

    def add_prompt(self, first_position: int, rows: LogprobsLists) -> None:
        """Place the dicts of prompt positions ``first_position, first_position + 1, ...``."""
        if self.prompt_logprobs is None:
            return
        for j, (ids, values, rank) in enumerate(zip(*rows)):
            self.prompt_logprobs[first_position + j] = self._make_dict(
                ids, values, rank, self.num_prompt_logprobs)
            self._prompt_rows_seen.add(first_position + j)

    @property
    def num_prompt_rows_missing(self) -> int:
        """Prompt positions after the first that have no dict yet (0 when all arrived)."""
        if self.prompt_logprobs is None:
            return 0
        return max(len(self.prompt_logprobs) - 1, 0) - len(self._prompt_rows_seen)

    def _make_dict(self, ids: list[int], values: list[float], rank: int,
                   num: int | None) -> dict[int, Logprob]:
        """Own token first with its rank, then the top-k with ranks 1, 2, ...; an own token
        that is also in the top-k ends up with the top-k's entry (same value)."""
        num = len(ids) - 1 if num == -1 else num
        ranks = itertools.chain((rank,), range(1, num + 1))
        return {tid: Logprob(value, r, self._decode(tid))
                for tid, value, r in zip(ids, values, ranks)}

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])
