"""Lab 03-04 starter: the engine step loop.

Every piece the step needs exists already: the scheduler (labs 03-01..03-03), the attention
metadata builder (lab 03-02), PagedAttention and the cache ops (phase 02), the model, the sampler.
You write the code that makes them one engine: the model runner's step (tasks 1-4) and the
engine's step (task 5). ``ModelRunnerBase`` (the KV cache tensors, swaps and copies, the attention
backend, the per-request record) and ``EngineCoreBase`` (the scheduler, the runner, requests in,
statistics) are given.

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
        """Task 4: one step, in this order:

        1. ``self._update_states(scheduler_output)``;
        2. ``self._execute_block_ops(scheduler_output)`` (swaps must land before the forward);
        3. if ``total_num_scheduled_tokens == 0``, return an empty ``ModelRunnerOutput``;
        4. ``input_ids, meta = self._prepare_inputs(...)``, then ``self._account(meta)``;
        5. ``hidden = self.model(input_ids, positions, self.kv_caches, meta, self.attn_backend)``
           with ``positions = meta.positions`` moved to ``self.device``;
        6. ``sampled = self._sample(hidden, meta)``;
        7. return ``ModelRunnerOutput(req_ids, req_id_to_index, sampled)`` in batch order.
        """
        raise NotImplementedError("lab 03-04, task 4: implement ModelRunner.execute_model")

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Task 1: apply the scheduler's diff to ``self.requests``.

        * drop every id in ``finished_req_ids``;
        * add each ``scheduled_new_reqs`` entry with ``self._new_request_state(new)``;
        * for each ``scheduled_cached_reqs`` entry ``i``: take over ``num_computed_tokens[i]``
          (the scheduler's count *before* this step); if ``resumed_from_preemption[i]`` the
          request lost its blocks, so ``new_block_ids[i][0]`` *replaces* its table; otherwise
          ``new_block_ids[i]`` (``None`` when there are none) is *appended*.
        """
        raise NotImplementedError("lab 03-04, task 1: implement ModelRunner._update_states")

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Task 2: the batch order, the flat ``input_ids`` and the attention metadata.

        * order: the requests of ``self.batch_req_ids`` that are scheduled again, in that order,
          then the other scheduled ones (``scheduler_output.scheduled_req_ids`` order); make it
          decodes-first with ``reorder_batch_to_split_decodes_and_prefills`` and store it back in
          ``self.batch_req_ids``;
        * ``meta = build_attention_metadata(order, num_scheduled_tokens, {id: computed},
          {id: block_ids}, self.block_size)``;
        * ``input_ids``: for each request in order, its ``num_scheduled_tokens`` tokens starting
          at its ``num_computed_tokens``; an int64 tensor on ``self.device``.
        """
        raise NotImplementedError("lab 03-04, task 2: implement ModelRunner._prepare_inputs")

    def _sample(self, hidden: torch.Tensor, meta: AttentionMetadata) -> list[list[int]]:
        """Task 3: one token for each request whose step reaches the end of its tokens.

        * request ``i`` samples iff ``meta.seq_lens[i] >= state.num_tokens``: a request in the
          middle of a chunked prefill samples nothing (``[]``);
        * its logits row is its *last* scheduled token: ``meta.query_start_loc[i + 1] - 1``;
          ``logits = self.model.compute_logits(hidden[rows])``;
        * ``SamplingMetadata.from_params(params, generators={row: state.generator, ...} (seeded
          only), banned_token_ids=[self._stop_token_ids(state), ...])``, then ``self.sampler``;
        * append each token to its ``state.token_ids``; return one list per request in batch
          order (``[token]`` or ``[]``).
        """
        raise NotImplementedError("lab 03-04, task 3: implement ModelRunner._sample")


class EngineCore(EngineCoreBase):
    """The scheduler and your runner (``runner_cls``) in one loop."""

    runner_cls = ModelRunner

    def step(self) -> list[EngineCoreOutput]:
        """Task 5: one engine step.

        With no unfinished request, return ``[]`` without scheduling. Otherwise:
        ``self.scheduler.schedule()`` -> ``self.model_runner.execute_model(...)`` ->
        ``self.scheduler.update_from_output(...)``; call ``self._record_stats()``; return what
        ``update_from_output`` returned.
        """
        raise NotImplementedError("lab 03-04, task 5: implement EngineCore.step")
