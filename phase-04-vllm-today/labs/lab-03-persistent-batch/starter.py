"""Lab 04-03 starter: the persistent batch.

Lab 03-04's runner rebuilds the whole batch every step: the order, every request's input tokens,
positions and block table, from Python lists. Between two decode steps almost nothing changed:
each request gained a token and sometimes a block, a few left, a few arrived. vLLM's runner keeps
the batch in preallocated rows that live across steps and applies only the scheduler's diff. You
write that batch and the runner's two steps that use it:

* tasks 1 and 2, ``InputBatch``: a request takes the lowest free row and gives it back (task 1);
  rows swap, and the last rows fill the holes (task 2);
* task 3, ``BlockTable``: the rows' block ids, updated by appends, whole-row writes, moves and
  swaps, and the slot of every token in one gather;
* tasks 4 and 5, ``PersistentBatchRunner``: apply the scheduler's diff to the rows (task 4),
  then order them decodes-first and gather the step's inputs (task 5).

Given (read them in ``mini_vllm``): ``InputBatchBase`` (``worker/input_batch.py``: the arrays,
``num_reqs``, ``write_tokens``), ``BlockTableBase`` (``worker/block_table.py``: the arrays and
the step's ``tensor``), ``batch_metadata`` (``worker/persistent_runner.py``: the step's inputs
from the rows, once they are in order). The class right after the base in each file is the
reference answer: do not read it before you have tried.

Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-03 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), ``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-04-vllm-today/labs/lab-03-persistent-batch -q
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch  # noqa: F401  (task 5: the step's input_ids go to self.device)

from mini_vllm.attention.metadata import reorder_batch_to_split_decodes_and_prefills  # noqa: F401
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.worker.block_table import BlockTableBase
from mini_vllm.worker.input_batch import InputBatchBase
from mini_vllm.worker.model_runner import ModelRunner
from mini_vllm.worker.persistent_runner import batch_metadata  # noqa: F401  (task 5)

__all__ = ["BlockTable", "InputBatch", "PersistentBatchRunner"]

# ---------------------------------------------------------------------------- tasks 1 and 2


class InputBatch(InputBatchBase):
    """Request state in ``max_num_reqs`` preallocated rows, kept across steps.

    Given by the base: ``req_ids`` (row -> request id, ``None`` for a hole; its length is one
    past the last row in use), ``req_id_to_index`` (request id -> row), the per-row arrays
    ``token_ids[row, :num_tokens[row]]``, ``num_tokens``, ``num_tokens_no_spec``,
    ``num_prompt_tokens``, ``num_computed_tokens``, the ``block_table`` (a ``BlockTable``, one
    row per batch row), ``num_reqs`` and ``write_tokens``.
    """

    def add_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                    num_computed_tokens: int, block_ids: Sequence[int]) -> int:
        """Task 1: write a request into the lowest free row and return the row.

        The lowest free row is the lowest hole of ``req_ids``, else the row after the last
        (``req_ids`` grows by one). The row gets the request's id in both maps, its tokens in
        ``token_ids[row, :len(token_ids)]``, ``num_tokens`` and ``num_tokens_no_spec`` equal to
        ``len(token_ids)``, its prompt and computed counts, and its blocks as the whole of the
        block table's row (``self.block_table.add_row``).

        Raises ``ValueError`` and changes nothing when ``req_id`` already has a row, when every
        one of ``max_num_reqs`` rows is taken, when the tokens exceed ``max_model_len``, or
        when the blocks exceed ``self.block_table.max_num_blocks_per_req``.
        """
        raise NotImplementedError(
            "lab 04-03, task 1: implement InputBatch.add_request "
            "(hint: python -m course hint 04-03 1)"
        )

    def remove_request(self, req_id: str) -> int | None:
        """Task 1: free ``req_id``'s row and return it; ``None`` if it has no row.

        The row becomes a hole (``req_ids[row] = None``; the list keeps its length) and the id
        leaves ``req_id_to_index``. Nothing else changes: the row's arrays are stale until a
        request takes it. Under async scheduling a step may name a finished request the batch
        never held: that is not an error.
        """
        raise NotImplementedError(
            "lab 04-03, task 1: implement InputBatch.remove_request "
            "(hint: python -m course hint 04-03 1)"
        )

    def swap_states(self, a: int, b: int) -> None:
        """Task 2: exchange rows ``a`` and ``b``.

        Both maps (``req_ids`` and ``req_id_to_index``; a row may be a hole), the tokens of both
        rows (at least the first ``max(num_tokens[a], num_tokens[b])`` columns), the four count
        arrays and the block table's rows (``self.block_table.swap_row``).
        """
        raise NotImplementedError(
            "lab 04-03, task 2: implement InputBatch.swap_states "
            "(hint: python -m course hint 04-03 2)"
        )

    def condense(self) -> None:
        """Task 2: fill the holes with the last rows, so that rows ``[0, num_reqs)`` are the
        batch and ``req_ids`` has no ``None`` (and no trailing hole).

        Take the holes lowest first; into each, move the last row in use (its id in both maps,
        its first ``num_tokens`` tokens, its four counts, its block-table row with
        ``self.block_table.move_row``), until no hole lies below the last row in use. Rows
        that are not moved keep their place: the order of the batch changes only where a hole
        was.
        """
        raise NotImplementedError(
            "lab 04-03, task 2: implement InputBatch.condense "
            "(hint: python -m course hint 04-03 2)"
        )


# ---------------------------------------------------------------------------- task 3


class BlockTable(BlockTableBase):
    """Block ids of the batch's rows.

    Given by the base: ``block_table`` (an int32 array ``[max_num_reqs,
    max_num_blocks_per_req]``), ``num_blocks_per_row`` (int32, per row), ``block_size``,
    ``max_num_blocks_per_req`` and ``tensor(num_reqs)``. Row ``i``'s table is its first
    ``num_blocks_per_row[i]`` entries; the rest is stale.
    """

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Task 3: write ``block_ids`` after the blocks of row ``row`` (a request's new blocks).

        Raises ``ValueError``, writing nothing, when the row would hold more than
        ``max_num_blocks_per_req`` blocks. Appending nothing changes nothing.
        """
        raise NotImplementedError(
            "lab 04-03, task 3: implement BlockTable.append_row "
            "(hint: python -m course hint 04-03 3)"
        )

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Task 3: make ``block_ids`` the whole table of row ``row`` (a new or resumed request),
        whatever the row held; ``ValueError``, changing nothing, when they do not fit a row."""
        raise NotImplementedError(
            "lab 04-03, task 3: implement BlockTable.add_row "
            "(hint: python -m course hint 04-03 3)"
        )

    def move_row(self, src: int, tgt: int) -> None:
        """Task 3: copy row ``src``'s table (its blocks and its count) into row ``tgt``."""
        raise NotImplementedError(
            "lab 04-03, task 3: implement BlockTable.move_row "
            "(hint: python -m course hint 04-03 3)"
        )

    def swap_row(self, a: int, b: int) -> None:
        """Task 3: exchange the tables of rows ``a`` and ``b`` (blocks and counts)."""
        raise NotImplementedError(
            "lab 04-03, task 3: implement BlockTable.swap_row "
            "(hint: python -m course hint 04-03 3)"
        )

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Task 3: the cache slot of each flat token, as an int64 array.

        Token ``t`` is at position ``positions[t]`` of the request in row ``req_indices[t]``:
        its slot is ``block * block_size + positions[t] % block_size``, where ``block`` is
        that row's ``positions[t] // block_size``-th block. One gather over the arrays, no
        Python loop over tokens (a prefill chunk has thousands).
        """
        raise NotImplementedError(
            "lab 04-03, task 3: implement BlockTable.compute_slot_mapping "
            "(hint: python -m course hint 04-03 3)"
        )


# ---------------------------------------------------------------------------- tasks 4 and 5


class PersistentBatchRunner(ModelRunner):
    """Lab 03-04's runner with its batch in an ``InputBatch`` of ``max_num_reqs`` rows.

    Given by the base (lab 03-04): ``self.requests`` (each request's record: ``token_ids``,
    ``num_prompt_tokens``, ``block_ids``, ``num_computed_tokens``, kept by ``_update_states``),
    ``self.batch_req_ids``, ``self.device``, ``self.block_size``. Between steps, rows
    ``[0, num_reqs)`` are the last step's requests in its order.
    """

    def __init__(self, *args, max_num_reqs: int, max_model_len: int, **kwargs) -> None:
        if "speculative_config" in kwargs:
            kwargs["max_model_len"] = max_model_len
        super().__init__(*args, **kwargs)
        self.input_batch = InputBatch(max_num_reqs, max_model_len, self.block_size)

    def reset_persistent_batch(self) -> None:
        """Empty the rows (after a failed step): the next step gives every request it schedules
        a row again, from the records."""
        self.input_batch = InputBatch(self.input_batch.max_num_reqs,
                                      self.input_batch.max_model_len, self.block_size)
        self.batch_req_ids = []

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Task 4: apply the scheduler's diff to the records and to the rows.

        1. ``super()._update_states(scheduler_output)``: the records, as lab 03-04 keeps them.
        2. Free the row of every request that this step does not schedule (not in
           ``num_scheduled_tokens``: finished, preempted, or left out; it takes a row again when
           it is next scheduled), and of every id in ``scheduled_new_reqs`` (an id used again
           after an abort starts afresh). Ids in ``finished_req_ids`` may have no row.
        3. Each request of ``scheduled_cached_reqs`` that still has a row: its row's
           ``num_computed_tokens`` from the output, and its ``new_block_ids`` (when not
           ``None``: group 0, ``new_block_ids[i][0]``) appended to its block-table row.
        4. Every scheduled request (``scheduled_req_ids``, in order) without a row takes one,
           from its record: tokens, prompt count, computed count, whole block table. (A request
           resumed after preemption is one: the step that preempted it did not schedule it.)
        5. ``condense()``.
        """
        raise NotImplementedError(
            "lab 04-03, task 4: implement PersistentBatchRunner._update_states "
            "(hint: python -m course hint 04-03 4)"
        )

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Task 5: bring the rows' tokens up to date, order the rows decodes-first, gather.

        1. For each row ``[0, num_reqs)``: its record's ``token_ids`` may be ahead of the row (the
           token lab 03-04's ``_sample`` appended last step) and end in this step's drafts
           (``scheduled_spec_decode_tokens[req_id]``, appended to the record before this call).
           Positions from ``start = num_tokens_no_spec[row]`` on are stale (last step's drafts
           may have been rejected): whenever the row is not already equal to the record, write
           the record's tokens from there, ``write_tokens(row, start, tokens[start:],
           num_drafts=len(scheduled_spec_decode_tokens.get(req_id, ())))``.
        2. Order: ``reorder_batch_to_split_decodes_and_prefills`` on a copy of the rows' ids,
           then ``swap_states`` until each row holds its id; ``self.batch_req_ids`` is the order.
        3. ``input_ids, meta = batch_metadata(batch, order, query_lens)`` with ``query_lens`` an
           int64 array of each row's ``num_scheduled_tokens``; return
           ``(input_ids.to(self.device), meta)``.
        """
        raise NotImplementedError(
            "lab 04-03, task 5: implement PersistentBatchRunner._prepare_inputs "
            "(hint: python -m course hint 04-03 5)"
        )
