"""The model runner on a persistent batch: the step's inputs come from rows kept across steps.

:class:`PersistentBatchRunner` is the runner of lab 03-04 with two steps done differently:

1. **update states** applies the scheduler's diff twice: to the runner's request records
   (``super()``, as before) and to the :class:`~mini_vllm.worker.input_batch.InputBatch`: rows of
   finished and unscheduled requests are freed, new requests and those back in the batch (resumed
   after preemption, or skipped for a step) take a row, the others get their new blocks appended
   and their ``num_computed_tokens``; then the batch is condensed. A preempted request is not
   scheduled in the step that preempts it, so it has lost its row by the time it resumes: its
   old table never needs patching;
2. **prepare inputs** writes into each row the tokens it lacks (the one a decode sampled last
   step, this step's drafts), swaps rows so decodes come first, and builds ``input_ids``,
   positions, the slot mapping and the block table with array gathers over the rows.

Everything else (swapping blocks, the forward pass, sampling, drafts, log-probabilities) is the
per-step runner's. Greedy and seeded requests get the same tokens on every step (unseeded
sampling draws in batch order, and a newcomer fills a hole here where it joins the back there);
``benchmarks/persistent_batch.py`` measures what the rows save. Upstream keeps the same split:
``self.requests`` and ``self.input_batch`` side by side.

upstream: vllm/v1/worker/gpu_model_runner.py:526 @ v0.11.0
"""

from __future__ import annotations

import numpy as np
import torch

from mini_vllm.attention.metadata import (
    AttentionMetadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.worker.input_batch import InputBatch
from mini_vllm.worker.model_runner import ModelRunner

__all__ = ["PersistentBatchRunner", "batch_metadata"]


class PersistentBatchRunner(ModelRunner):
    """A :class:`~mini_vllm.worker.model_runner.ModelRunner` whose batch lives in an
    :class:`~mini_vllm.worker.input_batch.InputBatch` of ``max_num_reqs`` rows of
    ``max_model_len`` tokens (the scheduler's ``max_num_seqs`` and ``max_model_len``).

    Invariant between steps: the batch's rows ``[0, num_reqs)`` are the last step's requests in
    its order (decodes first), ``batch_req_ids`` lists them, and each row's blocks and
    ``num_computed_tokens`` equal the request record's.

    upstream: vllm/v1/worker/gpu_model_runner.py:176 @ v0.11.0
    """

    def __init__(self, *args, max_num_reqs: int, max_model_len: int, **kwargs) -> None:
        if "speculative_config" in kwargs:
            kwargs["max_model_len"] = max_model_len
        super().__init__(*args, **kwargs)
        self.input_batch = InputBatch(max_num_reqs, max_model_len, self.block_size)

    def reset_persistent_batch(self) -> None:
        """Empty the rows (after a failed step, whose diff may be half applied): the next step
        gives every request it schedules a row again, from the runner's records."""
        self.input_batch = InputBatch(self.input_batch.max_num_reqs,
                                      self.input_batch.max_model_len, self.block_size)
        self.batch_req_ids = []

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the records and to the rows (module docstring, 1).

        upstream: vllm/v1/worker/gpu_model_runner.py:526 @ v0.11.0
        """
        super()._update_states(scheduler_output)
        batch = self.input_batch
        scheduled = scheduler_output.num_scheduled_tokens
        # A request not scheduled this step (finished, preempted, or left out by the budget)
        # gives up its row; it takes one again, from its record, when it is next scheduled.
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # an id used again after an abort starts afresh
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                # Back in the batch (resumed after preemption, or skipped for a step): it is
                # added below with its whole table, the one the records hold now.
                continue
            batch.num_computed_tokens[row] = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                batch.block_table.append_row(cached.new_block_ids[i][0], row)
        for req_id in scheduler_output.scheduled_req_ids:
            if req_id in batch.req_id_to_index:
                continue
            state = self.requests[req_id]
            batch.add_request(req_id, state.token_ids, state.num_prompt_tokens,
                              state.num_computed_tokens, state.block_ids)
        batch.condense()

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Sync the rows' tokens, order the rows decodes-first and gather the step's inputs.

        Returns ``(input_ids[num_tokens], metadata)`` as the per-step runner does.

        upstream: vllm/v1/worker/gpu_model_runner.py:923 @ v0.11.0
        """
        batch = self.input_batch
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        n = batch.num_reqs
        for row in range(n):
            # The row lacks what the record gained since: the token sampled last step, a
            # drafted step's accepted tokens, this step's drafts (which end the record now; a
            # request has drafts only after it sampled, so its record is then longer).
            req_id = batch.req_ids[row]
            tokens = self.requests[req_id].token_ids
            start = int(batch.num_tokens_no_spec[row])
            if len(tokens) != batch.num_tokens[row] or start != batch.num_tokens[row]:
                batch.write_tokens(row, start, tokens[start:],
                                   num_drafts=len(drafts.get(req_id, ())))
        order = list(batch.req_ids)
        reorder_batch_to_split_decodes_and_prefills(order, scheduled)
        for row, req_id in enumerate(order):
            if batch.req_ids[row] != req_id:
                batch.swap_states(row, batch.req_id_to_index[req_id])
        self.batch_req_ids = order
        query = np.array([scheduled[r] for r in order], dtype=np.int64)
        input_ids, meta = batch_metadata(batch, order, query)
        return input_ids.to(self.device), meta


def batch_metadata(batch: InputBatch, req_ids: list[str],
                   query_lens: np.ndarray) -> tuple[torch.Tensor, AttentionMetadata]:
    """The step's ``input_ids`` and attention metadata from rows ``[0, len(req_ids))`` of
    ``batch`` (decodes first), row ``i`` computing ``query_lens[i]`` tokens after its
    ``num_computed_tokens``: every flat-token array is one gather over the rows. Raises
    ``ValueError`` when a row's blocks do not cover its step's positions.

    upstream: vllm/v1/worker/gpu_model_runner.py:923 @ v0.11.0
    """
    n = len(req_ids)
    context = batch.num_computed_tokens[:n]
    seq = context + query_lens
    short = np.flatnonzero(batch.block_table.num_blocks_per_row[:n] * batch.block_table.block_size
                           < seq)
    if short.size:
        row = int(short[0])
        raise ValueError(
            f"batch_metadata: request {req_ids[row]!r} (row {row}) needs {int(seq[row])} slots but "
            f"its block-table row holds {int(batch.block_table.num_blocks_per_row[row])} block(s) "
            f"of {batch.block_table.block_size}; its new blocks never reached the row")
    cu_query = np.cumsum(query_lens)
    total = int(cu_query[-1])
    # Flat token t: its row, and its offset inside the row's query.
    req_indices = np.repeat(np.arange(n), query_lens)
    offsets = np.arange(total) - np.repeat(cu_query - query_lens, query_lens)
    positions = context[req_indices] + offsets
    input_ids = batch.token_ids[req_indices, positions]
    slot_mapping = batch.block_table.compute_slot_mapping(req_indices, positions)
    num_decodes = int(np.count_nonzero(query_lens <= 1))
    query_list, seq_list = query_lens.tolist(), seq.tolist()
    query_start_loc = torch.zeros(n + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.from_numpy(cu_query)
    seq_start_loc = torch.zeros(n + 1, dtype=torch.int32)
    seq_start_loc[1:] = torch.from_numpy(np.cumsum(seq))
    meta = AttentionMetadata(
        req_ids=list(req_ids),
        num_reqs=n,
        num_actual_tokens=total,
        num_decodes=num_decodes,
        num_prefills=n - num_decodes,
        num_decode_tokens=sum(query_list[:num_decodes]),
        num_prefill_tokens=sum(query_list[num_decodes:]),
        query_start_loc=query_start_loc,
        seq_start_loc=seq_start_loc,
        query_lens=torch.from_numpy(query_lens.astype(np.int32)),
        seq_lens=torch.from_numpy(seq.astype(np.int32)),
        context_lens=torch.from_numpy(context.astype(np.int32)),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        block_tables=batch.block_table.tensor(n),
        max_query_len=max(query_list),
        max_seq_len=max(seq_list),
        max_prefill_seq_len=max(seq_list[num_decodes:], default=0),
        max_decode_seq_len=max(seq_list[:num_decodes], default=0),
    )
    return torch.from_numpy(input_ids), meta
