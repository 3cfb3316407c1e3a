"""Log-probabilities as the user sees them: per position, a dict ``token id -> Logprob``.

The runner computes rows of numbers (:class:`mini_vllm.outputs.LogprobsLists`); a
:class:`~mini_vllm.engine.logprobs.LogprobsProcessor` per request turns them into upstream's
shapes: ``logprobs`` is one dict per generated token, ``prompt_logprobs`` one per prompt token
with ``None`` first (nothing predicts the first token), and ``cumulative_logprob`` sums the
generated tokens' own values.

upstream: vllm/logprobs.py:11 @ v0.11.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]


@dataclass
class Logprob:
    """One token's log-probability at one position, its rank in the vocabulary (1 = most
    likely) and its text (``None`` without a tokenizer).

    upstream: vllm/logprobs.py:11 @ v0.11.0
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list["dict[int, Logprob] | None"]
SampleLogprobs = list["dict[int, Logprob]"]


