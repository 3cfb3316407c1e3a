"""Beam search as v1 vLLM runs it: on top of ordinary one-token requests.

``LLM.beam_search`` keeps, per prompt, a :class:`BeamSearchInstance`: the live beams and the
completed ones. Each step it submits every live beam (prompt + tokens so far) as a request for one
token with ``2 * beam_width`` log-probabilities; prefix caching lets the beams share the KV of
their common full blocks, where V0 forked block tables with copy-on-write. With the answers,
:func:`expand_beams` does the step itself:

* every live beam proposes each token of its answer's log-probability dict (its top
  ``2 * beam_width`` and the sampled token) as a candidate, with the beam's cumulative
  log-probability plus the token's;
* a candidate that ends in EOS (unless ``ignore_eos``) is complete: it leaves the search and waits
  in ``completed`` for the final ranking;
* the others are ranked by :func:`get_beam_search_score` and the best ``beam_width`` become the
  next live beams.

After ``max_tokens`` steps (or when no beam is live), :func:`finish_beams` ranks the completed and
the live beams together and keeps the best ``beam_width``.

The score is ``cumulative_logprob / length ** length_penalty`` where ``length`` counts *every*
token of the sequence, the prompt's included, less a final EOS (as upstream, whose score follows
Hugging Face's). Ties keep the order in which candidates were made (Python's sort is stable):
beam by beam, and within a beam in the order of its dict.

upstream: vllm/beam_search.py:15 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mini_vllm.logprobs import Logprob

__all__ = [
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "create_sort_beams_key_function",
    "expand_beams",
    "finish_beams",
    "get_beam_search_score",
]


@dataclass
class BeamSearchSequence:
    """One beam: its ``tokens`` (the prompt's first), one log-probability dict per generated
    token, and the sum of the generated tokens' log-probabilities. ``text`` is filled (the
    decoded ``tokens``, prompt included, as upstream) when the beam is returned.

    upstream: vllm/beam_search.py:15 @ v0.11.0
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first.

    ``beam_history`` (a mini_vllm addition): the tokens of the live beams after each step, in
    rank order, so that a measurement can replay the beam tree the search really grew.

    upstream: vllm/beam_search.py:34 @ v0.11.0
    """

    sequences: list[BeamSearchSequence]
    beam_history: list[list[list[int]]] = field(default_factory=list)


class BeamSearchInstance:
    """The search state of one prompt: ``beams`` (live, best first) and ``completed``.

    Starts with one live beam, the prompt, with no generated token.

    upstream: vllm/beam_search.py:42 @ v0.11.0
    """

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence(list(prompt_tokens), [])]
        self.completed: list[BeamSearchSequence] = []
        self.history: list[list[list[int]]] = []


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: int | None, length_penalty: float = 1.0) -> float:
    """``cumulative_logprob / length ** length_penalty``; ``length`` is ``len(tokens)`` (prompt
    included) less one when the last token is EOS.

    upstream: vllm/beam_search.py:62 @ v0.11.0
    """
    length = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        length -= 1
    return cumulative_logprob / (length ** length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    """The key that ranks beams by :func:`get_beam_search_score` (sort descending).

    upstream: vllm/beam_search.py:81 @ v0.11.0
    """

    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def expand_beams(
    instance: BeamSearchInstance,
    answers: Sequence[dict[int, Logprob] | None],
    beam_width: int,
    eos_token_id: int | None,
    ignore_eos: bool,
    sort_key: Callable[[BeamSearchSequence], float],
) -> None:
    """One step of the search for one prompt (see the module docstring).

    ``answers[i]`` is the log-probability dict of live beam ``i``'s next position, or ``None``
    when its request returned none (it was aborted): that beam is dropped. Afterwards
    ``instance.beams`` holds at most ``beam_width`` beams, each one token longer than its parent,
    best first; complete candidates were appended to ``instance.completed``.

    upstream: vllm/entrypoints/llm.py:666 @ v0.11.0
    """
    if len(answers) != len(instance.beams):
        raise ValueError(f"expand_beams: {len(instance.beams)} live beams but "
                         f"{len(answers)} answers; give one answer per beam")
    candidates: list[BeamSearchSequence] = []
    for beam, answer in zip(instance.beams, answers):
        if answer is None:
            continue
        for token_id, logprob in answer.items():
            child = BeamSearchSequence(tokens=[*beam.tokens, token_id],
                                       logprobs=[*beam.logprobs, answer],
                                       cum_logprob=beam.cum_logprob + logprob.logprob)
            if token_id == eos_token_id and not ignore_eos:
                instance.completed.append(child)
            else:
                candidates.append(child)
    instance.beams = sorted(candidates, key=sort_key, reverse=True)[:beam_width]
    instance.history.append([list(b.tokens) for b in instance.beams])


def finish_beams(instance: BeamSearchInstance, beam_width: int,
                 sort_key: Callable[[BeamSearchSequence], float]) -> BeamSearchOutput:
    """The best ``beam_width`` of the completed and the still-live beams, best first.

    upstream: vllm/entrypoints/llm.py:704 @ v0.11.0
    """
    ranked = sorted([*instance.completed, *instance.beams], key=sort_key, reverse=True)
    return BeamSearchOutput(sequences=ranked[:beam_width], beam_history=instance.history)
