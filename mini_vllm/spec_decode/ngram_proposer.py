"""The n-gram proposer (prompt lookup): guess the next tokens by finding the sequence's own ending
earlier in its context, and proposing what followed it there.

Input-grounded work (editing code, summarising a given text, answering from a document) repeats
spans of its context, so the tokens that followed the last occurrence of the current suffix are
often the tokens that come next. The proposal costs no model at all; the target model then checks
every proposed token in one forward pass (:mod:`mini_vllm.sample.rejection_sampler`).

The rule, for a sequence ``t`` of ``T`` tokens:

* take the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` such that the suffix
  ``t[T-n:]`` also occurs earlier, starting at some ``j`` with ``j + n <= T - 1`` (it may overlap
  the suffix, never be it);
* of those occurrences, take the earliest ``j``;
* propose ``t[j+n : j+n+k]``: at most ``k = num_speculative_tokens`` tokens, never past the
  sequence's end, and never so many that ``T + k`` exceeds ``max_model_len``;
* no such ``n``, or ``T < prompt_lookup_min``: propose nothing.

upstream: vllm/v1/spec_decode/ngram_proposer.py (upstream finds the same match in O(T) with a
KMP-style pass over the reversed tokens, compiled with numba; this scan is O(T * n) and plain)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramProposer", "propose_ngram_tokens"]


def propose_ngram_tokens(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                         max_model_len: int) -> list[int]:
    """The draft tokens the rule in the module docstring gives for ``tokens`` (maybe none).

    upstream: vllm/v1/spec_decode/ngram_proposer.py:192 @ v0.11.0
    """
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    tokens = list(tokens)
    # An earlier occurrence of a suffix of length n starts at j <= T - 1 - n, so n <= T - 1.
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for j in range(total - n):
            if tokens[j:j + n] == suffix:
                start = j + n
                return tokens[start:start + k]
    return []


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per request by prompt lookup.

    Invariant: every proposal is a continuation the sequence already contains: the tokens it
    returns followed, somewhere earlier in the sequence, the same ``n``-token ending the
    sequence has now (``prompt_lookup_min <= n <= prompt_lookup_max``).

    upstream: vllm/v1/spec_decode/ngram_proposer.py:11 @ v0.11.0
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int, max_model_len: int) -> None:
        for name, value in (("prompt_lookup_min", prompt_lookup_min),
                            ("prompt_lookup_max", prompt_lookup_max),
                            ("num_speculative_tokens", num_speculative_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NgramProposer: {name} must be an int >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"NgramProposer: prompt_lookup_min ({prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """One list of draft tokens per request (prompt and output tokens so far); an empty list
        where the lookup finds nothing."""
        return [propose_ngram_tokens(ids, self.min_n, self.max_n, self.k, self.max_model_len)
                for ids in token_ids]
