"""What the engine's parts hand each other, and what the user gets back.

Upstream keeps these in three places, which mini_vllm's single namespace folds into one module:
``vllm/outputs.py`` (:class:`RequestOutput`, :class:`CompletionOutput`: what ``LLM.generate``
returns), ``vllm/v1/outputs.py`` (:class:`ModelRunnerOutput`, :class:`LogprobsLists`,
:class:`LogprobsTensors`: what the model runner hands the scheduler) and
``vllm/v1/engine/__init__.py`` (:class:`EngineCoreOutput`: what the scheduler reports per request
each step; kept here so that ``mini_vllm.core`` never imports ``mini_vllm.engine``).

One engine step is ``schedule() -> SchedulerOutput -> runner -> ModelRunnerOutput ->
update_from_output() -> [EngineCoreOutput]`` (``SchedulerOutput`` is in
:mod:`mini_vllm.core.sched.output`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

# At run time, not only for type checkers: the engine-core process's messages decode
# EngineCoreOutput by its annotations (mini_vllm/engine/messages.py).
from mini_vllm.request import FinishReason

if TYPE_CHECKING:
    import torch

    from mini_vllm.logprobs import Logprob, PromptLogprobs

__all__ = [
    "CompletionOutput",
    "DraftTokenIds",
    "EngineCoreOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "ModelRunnerOutput",
    "RequestOutput",
]


class LogprobsLists(NamedTuple):
    """Log-probabilities of some positions as Python lists (one row per position).

    Row ``i`` of ``logprob_token_ids`` and ``logprobs`` starts with the position's own token (the
    sampled one, or the prompt's next token) and continues with the top-k tokens, most likely
    first; ``sampled_token_ranks[i]`` is that own token's rank in the vocabulary (1 = the most
    likely). A token may appear twice in a row (its own and its top-k entry): same value.

    upstream: vllm/v1/outputs.py:15 @ v0.11.0
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


class LogprobsTensors(NamedTuple):
    """:class:`LogprobsLists` as tensors: ids ``[n, k + 1]``, values ``[n, k + 1]``, ranks ``[n]``.

    upstream: vllm/v1/outputs.py:32 @ v0.11.0
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        """The same rows as lists."""
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(),
                             self.selected_token_ranks.tolist())


@dataclass
class ModelRunnerOutput:
    """What the runner returns: the tokens sampled for each scheduled request.

    ``sampled_token_ids[req_id_to_index[r]]`` is the list of tokens sampled for request ``r``
    this step: one token once the request's prompt is fully computed, and an empty list for a
    request still in (chunked) prefill.

    Log-probabilities, for requests that ask for them: ``logprobs[r]`` holds one row per token
    sampled for ``r`` this step; ``prompt_logprobs_dict[r]`` is ``(first, rows)``: the rows of
    prompt positions ``first, first + 1, ...`` computed this step (row ``j`` scores prompt token
    ``first + j``; position 0 has no row, nothing predicts it). (Upstream keeps ``logprobs`` in
    batch order and hands prompt rows over once the prefill ends; keyed by request and by
    position, a chunked or recomputed prefill needs no bookkeeping across steps.)

    upstream: vllm/v1/outputs.py:99 @ v0.11.0
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)


@dataclass
class DraftTokenIds:
    """The draft tokens a proposer guessed after a step, one list per request (maybe empty),
    which the engine core hands to the scheduler for the next step to check.

    upstream: vllm/v1/outputs.py:147 @ v0.11.0
    """

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass
class EngineCoreOutput:
    """One request's news after a step: the tokens it gained and, if it stopped, why.

    upstream: vllm/v1/engine/__init__.py:99 @ v0.11.0
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True when the request stopped this step."""
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    With ``SamplingParams.logprobs``: ``logprobs[i]`` is the dict ``token id -> Logprob`` of
    ``token_ids[i]``'s position (that token and the top-k), and ``cumulative_logprob`` the sum of
    the generated tokens' log-probabilities; both ``None`` otherwise.

    upstream: vllm/outputs.py:22 @ v0.11.0
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    """Everything the user gets back for one prompt (``n`` completions of it).

    ``metrics`` holds ``arrival_time``, ``first_token_time`` and ``finished_time`` (seconds,
    ``time.perf_counter``) of the first completion, and ``num_cached_tokens``. With
    ``SamplingParams.prompt_logprobs``, ``prompt_logprobs`` has one entry per prompt token:
    ``None`` for the first, then the dict ``token id -> Logprob`` (that token and the top-k).

    upstream: vllm/outputs.py:79 @ v0.11.0
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def text(self) -> str:
        """The first completion's text (the common ``n == 1`` case)."""
        return self.outputs[0].text
