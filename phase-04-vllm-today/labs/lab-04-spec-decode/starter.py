"""Lab 04-04 starter: speculative decoding.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors. How
to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 04-04
N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

You write the three places where speculation is decided: what to guess (the n-gram proposer),
what to keep of a guess (the rejection sampler), and how the scheduler carries guesses from one
step to the next. Everything else is given: ``NgramProposer`` (one call of your function per
request), the rejection sampler's batch layout (``RejectionSampler.__call__``), and, in
``mini_vllm``, the runner that computes the drafts' rows in one forward pass, hands the target's
probabilities to the rejection sampler and asks the proposer for the next drafts
(``mini_vllm/worker/model_runner.py``). The scheduler of lab 03-01 is the base class: it already
counts drafts in the token budget and calls your ``_roll_back_rejected`` after a step.

Run the tests against this file with::

    LAB_IMPL=starter pytest phase-04-vllm-today/labs/lab-04-spec-decode -q
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.core.sched.scheduler import Scheduler as _BaseScheduler
from mini_vllm.core.sched.scheduler import _Step
from mini_vllm.outputs import DraftTokenIds
from mini_vllm.request import Request

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "NgramProposer",
    "RejectionSampler",
    "Scheduler",
    "accepts",
    "propose_ngram_tokens",
    "recovered_distribution",
]

# Marks the unused places of a row of the rejection sampler's output (after a rejection).
PLACEHOLDER_TOKEN_ID = -1


# ---------------------------------------------------------------------------- the proposer


def propose_ngram_tokens(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                         max_model_len: int) -> list[int]:
    """The draft tokens prompt lookup proposes after ``tokens`` (a request's prompt and output
    so far, ``T`` tokens).

    Find the longest ``n`` in ``[min_n, max_n]`` such that the sequence's last ``n`` tokens,
    ``tokens[T-n:]``, also occur earlier: starting at some ``j`` with ``j + n <= T - 1`` (the
    occurrence may overlap the suffix, but must not be the suffix itself). Among the occurrences
    of that longest ``n``, take the earliest ``j``, and return the tokens that followed it,
    ``tokens[j+n : j+n+k]``: at most ``k`` of them, fewer where the sequence ends, and never so
    many that ``T`` plus their number exceeds ``max_model_len``. Return ``[]`` when no ``n``
    matches, when ``T < min_n``, or when ``max_model_len`` leaves no room. Pure: ``tokens`` is
    not changed. Cost: O(T * max_n) is fine.

    Example: tokens ``[1, 2, 3, 4, 1, 2, 3]``, ``min_n=1``, ``max_n=3``, ``k=2``: the suffix
    ``[1, 2, 3]`` occurs at ``j=0``, so the proposal is ``[4, 1]``.
    """
    raise NotImplementedError(
        "lab 04-04, task 1: implement propose_ngram_tokens "
        "(hint: python -m course hint 04-04 1)"
    )


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per request by prompt lookup
    (your :func:`propose_ngram_tokens`, once per request). (Complete.)"""

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
        """One list of draft tokens per request; an empty list where the lookup finds nothing."""
        return [propose_ngram_tokens(ids, self.min_n, self.max_n, self.k, self.max_model_len)
                for ids in token_ids]


# ---------------------------------------------------------------------------- the rejection sampler


def accepts(target_prob: float, draft_prob: float, uniform: float) -> bool:
    """Whether a draft token is accepted: the proposer drew it with probability ``draft_prob``,
    the target gives it ``target_prob``, and ``uniform`` is a draw from ``[0, 1)``.

    Accept with probability ``min(1, target_prob / draft_prob)``, decided by ``uniform`` (so
    that equal inputs always decide alike). A ``draft_prob`` of 0 (a proposer should never
    propose a token it gives no probability) rejects, rather than divide by zero.
    """
    raise NotImplementedError(
        "lab 04-04, task 2: implement accepts (hint: python -m course hint 04-04 2)"
    )


def recovered_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                           draft_token: int) -> torch.Tensor:
    """The distribution a rejected position's token is drawn from, over the vocabulary.

    ``target_probs`` and ``draft_probs`` are ``[vocab]`` rows (the target's and the
    proposer's distributions at the rejected position); ``draft_probs`` is ``None`` for a
    proposer that proposed ``draft_token`` with certainty (a one-hot row). Return
    ``max(0, target - draft)`` normalised to sum to 1, a new tensor (the inputs stay as they
    are). When nothing is left (the two rows are equal up to rounding, where exact arithmetic
    would never have rejected), return ``target_probs`` normalised.
    """
    raise NotImplementedError(
        "lab 04-04, task 3: implement recovered_distribution "
        "(hint: python -m course hint 04-04 3)"
    )


class RejectionSampler:
    """Turns each request's draft tokens into the tokens it emits this step.

    ``target_probs`` (and ``draft_probs``) hold one row per draft token, requests one after
    another; the output is a ``[num_requests, max_k + 1]`` tensor, each row the emitted tokens
    then :data:`PLACEHOLDER_TOKEN_ID`; :meth:`parse_output` gives the lists. Randomness comes
    from each request's ``torch.Generator`` (``None``: the global one). ``__call__`` and
    ``parse_output`` are complete; you write the two ways of judging one request's drafts.
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
        """Judge one greedy request's drafts: ``p[i]`` is the target's row after draft ``i``'s
        predecessors (``p`` has ``len(drafts)`` rows).

        Walk the drafts in order. While a draft is the argmax of its row, emit it. At the first
        draft that is not, emit the argmax instead and stop. Return ``(emitted, all_accepted)``:
        the emitted tokens (between 1 and ``len(drafts)``; none for no drafts) and whether every
        draft was accepted (then ``__call__`` appends the bonus token).
        """
        raise NotImplementedError(
            "lab 04-04, task 4: implement RejectionSampler._greedy "
            "(hint: python -m course hint 04-04 4)"
        )

    @staticmethod
    def _random(drafts: Sequence[int], p: torch.Tensor, q: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[list[int], bool]:
        """Judge one random request's drafts so that each emitted token is distributed as the
        target alone would have sampled it.

        ``p[i]`` / ``q[i]``: the target's and the proposer's rows at draft ``i`` (``q`` is
        ``None`` for a proposer without probabilities, which proposed each draft with
        certainty: ``q[i]`` is one-hot). First draw ``len(drafts)`` uniforms at once with
        ``torch.rand(len(drafts), generator=generator, dtype=torch.float64)`` (one per position,
        all drawn before any decision, so the stream of draws does not depend on the outcome).
        Then, in order: accept draft ``i`` when :func:`accepts` says so with uniform ``i``, and
        emit it; at the first rejection, emit one token drawn with
        ``torch.multinomial(row, 1, generator=generator)`` from :func:`recovered_distribution`
        and stop. Return ``(emitted, all_accepted)`` as ``_greedy`` does.
        """
        raise NotImplementedError(
            "lab 04-04, task 5: implement RejectionSampler._random "
            "(hint: python -m course hint 04-04 5)"
        )

    @staticmethod
    def parse_output(output: torch.Tensor) -> list[list[int]]:
        """Each request's emitted tokens (the row without its placeholders)."""
        return [[int(t) for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output]


# ---------------------------------------------------------------------------- the scheduler


class Scheduler(_BaseScheduler):
    """Lab 03-01's scheduler with speculative decoding's bookkeeping.

    The base class already counts a request's ``spec_token_ids`` among the tokens it lacks
    (``_num_new_tokens``: they come out of the step's budget and get KV slots like any token),
    calls ``_take_spec_tokens`` when it packages a step, and calls ``_roll_back_rejected``
    from ``update_from_output`` for every request whose drafts were checked.
    """

    def _take_spec_tokens(self, step: _Step) -> dict[str, list[int]]:
        """The drafts each request scheduled in ``step`` checks: ``{request id: drafts}``.

        Called while the step is packaged, before ``num_computed_tokens`` advances. A request
        scheduled ``n`` tokens (``step.num_scheduled_tokens``) reaches ``num_computed_tokens +
        n``; whatever of that lies past ``num_tokens`` are drafts: the first that many of its
        ``spec_token_ids`` (the budget or ``max_model_len`` may have cut the rest). Requests
        whose tokens reach no draft are not in the result. Afterwards every scheduled request's
        ``spec_token_ids`` is empty (the proposer sends fresh ones after the step); requests
        not scheduled keep theirs.
        """
        raise NotImplementedError(
            "lab 04-04, task 6: implement Scheduler._take_spec_tokens "
            "(hint: python -m course hint 04-04 6)"
        )

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Give requests the drafts the proposer guessed after a step, for the next step.

        ``draft_token_ids.req_ids[i]`` gets ``draft_token_ids.draft_token_ids[i]`` as its
        ``spec_token_ids`` (a list of its own: later changes to the input must not reach it).
        Skipped, leaving the request as it is: an id the scheduler does not know (finished or
        aborted meanwhile), a request that is not ``RUNNING``, and a request whose KV does not
        yet cover all but its last token (``num_computed_tokens < num_tokens - 1``: it is in
        the middle of its prompt, and drafts follow the last token only).
        """
        raise NotImplementedError(
            "lab 04-04, task 7: implement Scheduler.update_draft_token_ids "
            "(hint: python -m course hint 04-04 7)"
        )

    def _roll_back_rejected(self, request: Request, num_draft_tokens: int,
                            num_accepted: int) -> None:
        """After a step that checked ``num_draft_tokens`` drafts of ``request`` and accepted the
        first ``num_accepted``: the rejected ones were scheduled (their KV was computed, from
        the wrong tokens), so ``num_computed_tokens`` steps back over them, and the next step
        computes those positions again. A request preempted meanwhile has
        ``num_computed_tokens == 0``: nothing to roll back. Either way, count the draft in
        ``self.spec_decoding_stats`` (``observe_draft``).
        """
        raise NotImplementedError(
            "lab 04-04, task 8: implement Scheduler._roll_back_rejected "
            "(hint: python -m course hint 04-04 8)"
        )
