"""Verify draft tokens against the target model, keeping the target's own distribution.

A proposer guessed ``k`` tokens ``d_1..d_k`` for a request; one forward pass of the target model
over them gives its probabilities ``p_1..p_k`` at those positions (and ``p_{k+1}`` after the
last, from which the caller samples the *bonus* token). Position by position:

* **greedy** requests accept ``d_i`` while it is the target's argmax; at the first that is not,
  they emit the argmax instead and stop;
* **random** requests accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` (``q_i``
  the proposer's distribution; a proposer without one, like the n-gram lookup, proposed ``d_i``
  with certainty: ``q_i(d_i) = 1``); at the first rejection they emit a *recovered* token drawn
  from ``normalise(max(0, p_i - q_i))`` and stop;
* a request that accepted all ``k`` emits the bonus token as well.

So a step emits between 1 and ``k + 1`` tokens per request, and (the point of the construction,
Leviathan et al. 2023, arxiv.org/abs/2211.17192) each emitted token is distributed exactly as
the target alone would have sampled it: accepting ``d`` has probability
``q(d) min(1, p(d)/q(d)) = min(q(d), p(d))``, and the recovered draw adds ``p(x) - min(q(x), p(x))``
to every ``x``.

upstream: vllm/v1/sample/rejection_sampler.py
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "accepts", "recovered_distribution"]

# Marks the unused places of a row of the output (after a rejection), as upstream's output does.
PLACEHOLDER_TOKEN_ID = -1


def accepts(target_prob: float, draft_prob: float, uniform: float) -> bool:
    """Whether a draft token proposed with probability ``draft_prob``, which the target gives
    ``target_prob``, is accepted by the draw ``uniform`` (in ``[0, 1)``). A draft probability of
    0 (which a proposer should never produce) rejects rather than divide by zero, as upstream.

    upstream: vllm/v1/sample/rejection_sampler.py:486 @ v0.11.0
    """
    return draft_prob > 0 and target_prob / draft_prob >= uniform


def recovered_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                           draft_token: int) -> torch.Tensor:
    """The distribution a rejected position's token is drawn from: ``max(0, p - q)``,
    normalised. Without draft probabilities (``q`` one-hot at ``draft_token``) that is ``p`` with
    the draft token removed. If nothing is left (``p == q`` up to rounding, where a rejection
    cannot happen in exact arithmetic), ``p`` itself.

    upstream: vllm/v1/sample/rejection_sampler.py:392 @ v0.11.0
    """
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else target_probs / target_probs.sum()


class RejectionSampler:
    """Turns each request's draft tokens into the tokens it emits this step.

    Input layout, as upstream's: ``target_probs`` and ``draft_probs`` hold one row per draft
    token, requests one after another (``sum(len(d) for d in draft_token_ids)`` rows).
    Output: a ``[num_requests, max_k + 1]`` tensor, each row the emitted tokens followed by
    :data:`PLACEHOLDER_TOKEN_ID`; :meth:`parse_output` gives the lists.

    Randomness comes from each request's ``torch.Generator`` (``None``: the global one), one
    uniform draw per draft position taken before any decision, so a seeded request emits the
    same tokens whatever else is in the batch.

    upstream: vllm/v1/sample/rejection_sampler.py:23 @ v0.11.0
    """

    def __call__(self, draft_token_ids: Sequence[Sequence[int]], target_probs: torch.Tensor,
                 bonus_token_ids: Sequence[int], is_greedy: Sequence[bool], *,
                 draft_probs: torch.Tensor | None = None,
                 generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
        num_rows = sum(len(d) for d in draft_token_ids)
        if target_probs.dim() != 2 or target_probs.shape[0] != num_rows:
            raise ValueError(f"RejectionSampler: target_probs must have one row per draft token "
                             f"({num_rows}), got shape {tuple(target_probs.shape)}")
        if draft_probs is not None and draft_probs.shape != target_probs.shape:
            raise ValueError("RejectionSampler: draft_probs must have target_probs' shape, got "
                             f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
        if not len(bonus_token_ids) == len(is_greedy) == len(draft_token_ids):
            raise ValueError("RejectionSampler: one bonus token and one is_greedy flag per "
                             "request")
        generators = generators if generators is not None else [None] * len(draft_token_ids)
        max_k = max((len(d) for d in draft_token_ids), default=0)
        out = torch.full((len(draft_token_ids), max_k + 1), PLACEHOLDER_TOKEN_ID,
                         dtype=torch.long)
        row = 0
        for i, drafts in enumerate(draft_token_ids):
            p = target_probs[row:row + len(drafts)].float()
            q = None if draft_probs is None else draft_probs[row:row + len(drafts)].float()
            row += len(drafts)
            emitted, all_accepted = (self._greedy(drafts, p) if is_greedy[i]
                                     else self._random(drafts, p, q, generators[i]))
            if all_accepted:
                emitted.append(int(bonus_token_ids[i]))
            out[i, :len(emitted)] = torch.tensor(emitted, dtype=torch.long)
        return out

    @staticmethod
    def _greedy(drafts: Sequence[int], p: torch.Tensor) -> tuple[list[int], bool]:
        """One greedy request: emit each draft while it is its row's argmax; at the first that
        is not, emit the argmax and stop. Returns the emitted tokens and whether every draft
        was accepted (then the bonus follows).

        upstream: vllm/v1/sample/rejection_sampler.py:438 @ v0.11.0 (one program per request)
        """
        emitted = []
        for pos, draft in enumerate(drafts):
            best = int(p[pos].argmax())
            emitted.append(best)
            if best != draft:
                return emitted, False
        return emitted, True

    @staticmethod
    def _random(drafts: Sequence[int], p: torch.Tensor, q: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[list[int], bool]:
        """One random request: one uniform per draft, all drawn first; accept draft ``i`` when
        :func:`accepts` says so, and at the first rejection emit a token drawn from
        :func:`recovered_distribution` and stop. Returns what ``_greedy`` returns.

        upstream: vllm/v1/sample/rejection_sampler.py:135 @ v0.11.0 (uniforms for every draft
        first, then the random kernel)
        """
        uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64)
        emitted = []
        for pos, draft in enumerate(drafts):
            draft_prob = 1.0 if q is None else float(q[pos, draft])
            if accepts(float(p[pos, draft]), draft_prob, float(uniforms[pos])):
                emitted.append(int(draft))
                continue
            residual = recovered_distribution(p[pos], None if q is None else q[pos], draft)
            emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
            return emitted, False
        return emitted, True

    @staticmethod
    def parse_output(output: torch.Tensor) -> list[list[int]]:
        """Each request's emitted tokens (the row without its placeholders)."""
        return [[int(t) for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output]
