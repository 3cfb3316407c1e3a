"""What the scheduler hands the model runner each step.

One engine step is ``schedule() -> SchedulerOutput -> runner -> ModelRunnerOutput ->
update_from_output()`` (the runner's side is in :mod:`mini_vllm.outputs`). The scheduler output is
a *diff*: a request scheduled for the first time travels in full (``NewRequestData``: its prompt
and block ids), a request the runner already knows travels as a few numbers (``CachedRequestData``:
new block ids and its computed-token count). The runner keeps its own copy of every live request
and applies the diff.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:

    from mini_vllm.request import LoRARequest, Request
    from mini_vllm.sampling_params import SamplingParams

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]


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
    # Speculative decoding: the draft tokens scheduled for checking, by request; they are the
    # last len(drafts) of the request's num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # What a KV connector's worker side moves in this step (lab 04-06); None without one.
    kv_connector_metadata: Any = None

    @property
    def scheduled_req_ids(self) -> list[str]:
        """Every scheduled request id: new requests first, then cached ones (output order)."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(
            self.scheduled_cached_reqs.req_ids
        )


