"""What the scheduler hands the model runner each step, and what the runner hands back.

One engine step is ``schedule() -> SchedulerOutput -> runner -> ModelRunnerOutput ->
update_from_output()``. The scheduler output is a *diff*: a request scheduled for the first time
travels in full (``NewRequestData``: its prompt and block ids), a request the runner already knows
travels as a few numbers (``CachedRequestData``: new block ids and its computed-token count). The
runner keeps its own copy of every live request and applies the diff.

Invariants of a ``SchedulerOutput`` (the scheduler's tests check them every step):

* ``total_num_scheduled_tokens == sum(num_scheduled_tokens.values())`` and every value is >= 1;
* every request in ``num_scheduled_tokens`` appears exactly once, either in
  ``scheduled_new_reqs`` or in ``scheduled_cached_reqs``;
* ``num_computed_tokens`` in both is the count *before* this step's tokens: the runner computes
  positions ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.

mini_vllm additions for V0-style swapping (empty unless ``preemption_mode == "swap"``):
``blocks_to_swap_out`` (GPU block -> CPU block) and ``blocks_to_swap_in`` (CPU block -> GPU
block); the runner performs the swap-outs, then the swap-ins, before the forward pass. V1 never
copies blocks (no copy-on-write), so ``blocks_to_copy`` stays empty; it is kept so a V0 reader
finds the field where it expects it.

upstream: vllm/v1/core/sched/output.py:122 @ v0.11.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from mini_vllm.request import FinishReason, LoRARequest, Request
    from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
]


@dataclass
class NewRequestData:
    """A request scheduled for the first time: everything the runner must cache about it.

    ``block_ids`` is the request's whole block table (one KV-cache group, so a 1-tuple), and
    ``num_computed_tokens`` counts the prefix-cache hit: those tokens already have KV.

    upstream: vllm/v1/core/sched/output.py:27 @ v0.11.0
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        """Snapshot ``request`` as it is scheduled (``num_computed_tokens`` before the step).

        upstream: vllm/v1/core/sched/output.py:40 @ v0.11.0
        """
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
        )


@dataclass
class CachedRequestData:
    """The requests the runner already knows, as parallel lists (one entry per request).

    ``new_block_ids[i]`` is appended to request ``i``'s block table, except when
    ``resumed_from_preemption[i]``: the request lost its blocks when it was preempted, and the
    runner must *replace* its table with ``new_block_ids[i]`` (and, after a recompute preemption,
    forget the tokens it had computed). ``None`` means "no new blocks this step".
    ``new_token_ids`` is only filled by upstream under pipeline parallelism; mini_vllm leaves
    it empty, as upstream does without PP: the runner remembers the tokens it sampled.

    upstream: vllm/v1/core/sched/output.py:92 @ v0.11.0
    """

    req_ids: list[str]
    resumed_from_preemption: list[bool]
    new_token_ids: list[list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        """How many cached requests this step schedules."""
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        """No cached requests.

        upstream: vllm/v1/core/sched/output.py:110 @ v0.11.0
        """
        return cls(
            req_ids=[], resumed_from_preemption=[], new_token_ids=[], new_block_ids=[],
            num_computed_tokens=[],
        )


@dataclass
class SchedulerOutput:
    """One step's decisions; see the module docstring for the invariants.

    ``finished_req_ids`` are the requests that finished *between* the previous step and this one
    (the runner drops their state). ``preempted_req_ids`` are the requests preempted while this
    step was being scheduled (upstream keeps them only in a local list; mini_vllm reports them
    so that traces and the notebook can show them).

    upstream: vllm/v1/core/sched/output.py:122 @ v0.11.0
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    preempted_req_ids: list[str] = field(default_factory=list)
    # V0-style swapping (mini_vllm addition; see the module docstring).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def scheduled_req_ids(self) -> list[str]:
        """Every scheduled request id: new requests first, then cached ones (output order)."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(
            self.scheduled_cached_reqs.req_ids
        )


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
