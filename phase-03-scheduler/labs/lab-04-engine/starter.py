"""Lab 03-04 starter: the engine step loop.

Every piece the step needs exists already: the scheduler (labs 03-01..03-03), the attention
metadata builder (lab 03-02), PagedAttention and the cache ops (phase 02), the model, the sampler.
You write the code that makes them one engine: the model runner's step (tasks 1-4) and the
engine's step (task 5). ``ModelRunnerBase`` (the KV cache tensors, swaps and copies, the attention
backend, the per-request record) and ``EngineCoreBase`` (the scheduler, the runner, requests in,
statistics) are given.

Each docstring is a contract: what goes in, what comes out, what must hold afterwards. How to get
there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 03-04 N`` (a
question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the steps), then
``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-04-engine -q
"""

from __future__ import annotations

import torch

from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.config import SchedulerConfig
from mini_vllm.llm import EngineCoreBase
from mini_vllm.model_runner import CachedRequestState, ModelRunnerBase
from mini_vllm.sampler import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "AttentionMetadata",
    "CachedRequestData",
    "CachedRequestState",
    "EngineCore",
    "ModelRunner",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingMetadata",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "build_attention_metadata",
    "reorder_batch_to_split_decodes_and_prefills",
]


class ModelRunner(ModelRunnerBase):
    """Turns one ``SchedulerOutput`` into one sampled token per finished-prefill request.

    Given by ``ModelRunnerBase`` (read it in ``mini_vllm/model_runner.py``):
    ``self.model``, ``self.kv_caches`` (one ``(key_cache, value_cache)`` per layer),
    ``self.attn_backend``, ``self.sampler``, ``self.block_size``, ``self.device``,
    ``self.requests`` (request id -> ``CachedRequestState``), ``self.batch_req_ids`` (the batch
    order of the previous step), ``self._new_request_state(new_request_data)``,
    ``self._execute_block_ops(scheduler_output)``, ``self._account(metadata)`` and
    ``self._stop_token_ids(state)``.
    """

    @torch.no_grad()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Task 4: the runner's half of one engine step.

        Input: the step's ``SchedulerOutput``. Afterwards, whatever the step holds:

        * the runner's records follow the scheduler's diff (your ``_update_states``), also in a
          step that schedules no token (it may still finish requests or move blocks);
        * the step's block copies (``blocks_to_swap_out``, ``blocks_to_swap_in``,
          ``blocks_to_copy``) are in the cache *before* the model reads it: a request swapped
          back in attends to the KV it left with. ``self._execute_block_ops`` makes them.

        A step with ``total_num_scheduled_tokens == 0`` runs no model and returns an empty
        ``ModelRunnerOutput`` (no ids, no tokens). Otherwise the model runs once over the flat
        batch of ``_prepare_inputs``, ``self.model(input_ids, positions, self.kv_caches, meta,
        self.attn_backend)`` with ``positions = meta.positions`` on ``self.device`` (it writes
        the step's K/V into the paged cache and returns one hidden row per token), the step is
        counted with ``self._account(meta)``, and the output is ``ModelRunnerOutput(req_ids,
        req_id_to_index, sampled)`` with the requests in batch order (``meta.req_ids``),
        ``req_id_to_index[r]`` the position of ``r`` in it and ``sampled`` what ``_sample``
        returned.
        """
        raise NotImplementedError(
            "lab 03-04, task 4: implement ModelRunner.execute_model "
            "(hint: python -m course hint 03-04 4)"
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Task 1: make ``self.requests`` (id -> ``CachedRequestState``) follow the scheduler.

        Afterwards:

        * no id of ``finished_req_ids`` is in ``self.requests`` (an id the runner never saw is
          ignored);
        * each ``scheduled_new_reqs`` entry has a fresh record, ``self._new_request_state(new)``
          (prompt, block table, prefix-cache hit, its own generator when seeded);
        * for each ``scheduled_cached_reqs`` entry ``i`` (a request the runner knows):
          ``num_computed_tokens`` is ``num_computed_tokens[i]``, the scheduler's count *before*
          this step; if ``resumed_from_preemption[i]``, the request lost its blocks when it was
          preempted and its table is now exactly ``new_block_ids[i][0]`` (the whole new table;
          an empty one when that is None); otherwise ``new_block_ids[i][0]`` (when not None) is
          appended to its table. Its tokens are left alone: the runner appended its samples
          itself.
        """
        raise NotImplementedError(
            "lab 03-04, task 1: implement ModelRunner._update_states "
            "(hint: python -m course hint 03-04 1)"
        )

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Task 2: the step's batch order, its flat ``input_ids`` and its attention metadata.

        Input: the step's ``SchedulerOutput`` (the records already updated by task 1).

        The batch order: the scheduled requests that were in the previous step's batch
        (``self.batch_req_ids``) keep their relative order and come first, the others follow in
        ``scheduler_output.scheduled_req_ids`` order; then
        ``reorder_batch_to_split_decodes_and_prefills(order, num_scheduled_tokens)`` makes it
        decodes-first (in place, with few moves). Afterwards ``self.batch_req_ids`` is that
        order (exactly the scheduled requests).

        Output ``(input_ids, meta)``: ``meta = build_attention_metadata(order,
        num_scheduled_tokens, {id: num_computed_tokens}, {id: block_ids}, self.block_size)``
        from the records; ``input_ids`` (int64, on ``self.device``) holds, request after request
        in batch order, request ``r``'s ``num_scheduled_tokens[r]`` tokens starting at its
        ``num_computed_tokens`` (a whole prompt, a chunk of it, or one token).
        """
        raise NotImplementedError(
            "lab 03-04, task 2: implement ModelRunner._prepare_inputs "
            "(hint: python -m course hint 03-04 2)"
        )

    def _sample(self, hidden: torch.Tensor, meta: AttentionMetadata) -> list[list[int]]:
        """Task 3: one token for each request whose step reaches the end of its tokens.

        Input: the model's hidden states, one row per token of the flat batch, and the step's
        metadata. Request ``i`` of ``meta.req_ids`` samples iff its step reaches the end of
        its tokens (``meta.seq_lens[i] >= state.num_tokens``); a request in the middle of a
        chunked prefill samples nothing. A sampling request's token comes from the logits of
        its *last* scheduled token (``self.model.compute_logits`` of that hidden row), drawn by
        ``self.sampler`` with ``SamplingMetadata.from_params``: its own ``SamplingParams``, its
        ``state.generator`` when it has one (so a seeded request draws the same tokens in any
        batch), and ``self._stop_token_ids(state)`` banned (the stop tokens that ``min_tokens``
        still holds back). The rows of requests that do not sample are never sampled.

        Output: one list per request, in batch order: ``[token]`` or ``[]``. Afterwards each
        sampled token is appended to its request's ``state.token_ids``.
        """
        raise NotImplementedError(
            "lab 03-04, task 3: implement ModelRunner._sample (hint: python -m course hint 03-04 3)"
        )


class EngineCore(EngineCoreBase):
    """The scheduler and your runner (``runner_cls``) in one loop."""

    runner_cls = ModelRunner

    def step(self) -> list[EngineCoreOutput]:
        """Task 5: one engine step: schedule, run the model, take the sampled tokens back.

        With no unfinished request (``self.scheduler.has_unfinished_requests()``) it returns
        ``[]`` and does nothing else: no schedule (the scheduler's step count stays), no model.
        Otherwise exactly one ``self.scheduler.schedule()``, one
        ``self.model_runner.execute_model`` of its output and one
        ``self.scheduler.update_from_output`` of both, then ``self._record_stats()`` (the
        prefix-cache and block counters that ``python -m mini_vllm`` prints). Returns what
        ``update_from_output`` returned: the news of every request that gained tokens.
        """
        raise NotImplementedError(
            "lab 03-04, task 5: implement EngineCore.step (hint: python -m course hint 03-04 5)"
        )
