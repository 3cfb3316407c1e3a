"""The persistent input batch: the live requests' state in preallocated rows, kept across steps.

A decode step changes little: each request gains one token and sometimes a block, a few finish, a
few arrive. The per-step runner rebuilds every input from Python lists anyway; the persistent
batch keeps a row per scheduled request in preallocated arrays and applies only the diff:

* :meth:`InputBatch.add_request` writes a new (or resumed) request into the lowest free row;
* :meth:`InputBatch.remove_request` frees a row, leaving a hole;
* :meth:`InputBatch.condense` moves the last rows into the holes, so rows ``[0, num_reqs)`` are
  the batch;
* :meth:`InputBatch.swap_states` exchanges two rows (the decodes-first order).

The step's inputs are then array gathers over those rows (``token_ids[row, position]``, the
block table's slots), not loops over Python lists.

upstream: vllm/v1/worker/gpu_input_batch.py:79 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mini_vllm.worker.block_table import BlockTable

__all__ = ["InputBatch", "InputBatchBase"]


class InputBatchBase:
    """``max_num_reqs`` rows of request state, each row up to ``max_model_len`` tokens: the
    arrays and their plain writes; :class:`InputBatch` adds the rows' bookkeeping.

    Invariants: ``req_ids[i]`` is row ``i``'s request (``None``: a hole) and
    ``req_id_to_index[r] == i`` exactly when ``req_ids[i] == r``; ``len(req_ids)`` is one past
    the last row in use. Row ``i`` holds its request's tokens in ``token_ids[i, :num_tokens[i]]``
    (prompt, outputs, then this step's drafts), of which the first ``num_tokens_no_spec[i]`` are
    not drafts; ``num_computed_tokens[i]`` counts those whose KV is cached before the step; the
    block table's row ``i`` is its block table. After :meth:`condense` there is no hole.

    upstream: vllm/v1/worker/gpu_input_batch.py:79 @ v0.11.0
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_model_len", max_model_len),
                            ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InputBatch: {name} must be an int >= 1, got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size)

    @property
    def num_reqs(self) -> int:
        """Rows in use (holes not counted)."""
        return len(self.req_id_to_index)

    def write_tokens(self, row: int, start: int, tokens: Sequence[int], *,
                     num_drafts: int = 0) -> None:
        """Write ``tokens`` into row ``row`` from position ``start``; they end the row, the last
        ``num_drafts`` of them are drafts. Raises ``ValueError`` past ``max_model_len``.

        upstream: vllm/v1/worker/gpu_input_batch.py:333 @ v0.11.0 (the token_ids_cpu writes)
        """
        end = start + len(tokens)
        if end > self.max_model_len:
            raise ValueError(f"InputBatch: row {row} would hold {end} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.token_ids[row, start:end] = tokens
        self.num_tokens[row] = end
        self.num_tokens_no_spec[row] = end - num_drafts


class InputBatch(InputBatchBase):
    """The persistent batch: requests take, free, move and swap rows (module docstring).

    upstream: vllm/v1/worker/gpu_input_batch.py:79 @ v0.11.0
    """

    def add_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                    num_computed_tokens: int, block_ids: Sequence[int]) -> int:
        """Write a request into the lowest free row (a hole, else the row after the last) and
        return the row. Raises ``ValueError``, writing nothing, when ``req_id`` already has a
        row, every row is taken, or its tokens or blocks do not fit a row.

        upstream: vllm/v1/worker/gpu_input_batch.py:310 @ v0.11.0
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"InputBatch: request {req_id!r} already has row "
                             f"{self.req_id_to_index[req_id]}; remove it first")
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(f"InputBatch: request {req_id!r} has {n} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        if len(block_ids) > self.block_table.max_num_blocks_per_req:
            raise ValueError(f"InputBatch: request {req_id!r} has {len(block_ids)} blocks, more "
                             f"than a row's {self.block_table.max_num_blocks_per_req}")
        row = next((i for i, r in enumerate(self.req_ids) if r is None), len(self.req_ids))
        if row >= self.max_num_reqs:
            raise ValueError(f"InputBatch: all {self.max_num_reqs} rows are taken; cannot add "
                             f"request {req_id!r}")
        if row == len(self.req_ids):
            self.req_ids.append(req_id)
        else:
            self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = self.num_tokens_no_spec[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table.add_row(block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free ``req_id``'s row, leaving a hole, and return it; ``None`` for a request without a
        row (one that finished before it was ever scheduled here, or is already gone).

        upstream: vllm/v1/worker/gpu_input_batch.py:448 @ v0.11.0
        """
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
        return row

    def swap_states(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b``, every array and the block table with them.

        upstream: vllm/v1/worker/gpu_input_batch.py:500 @ v0.11.0
        """
        if a == b:
            return
        ra, rb = self.req_ids[a], self.req_ids[b]
        self.req_ids[a], self.req_ids[b] = rb, ra
        if ra is not None:
            self.req_id_to_index[ra] = b
        if rb is not None:
            self.req_id_to_index[rb] = a
        # Only the longer row's tokens are worth moving.
        width = int(max(self.num_tokens[a], self.num_tokens[b]))
        self.token_ids[[a, b], :width] = self.token_ids[[b, a], :width]
        for array in (self.num_tokens, self.num_tokens_no_spec, self.num_prompt_tokens,
                      self.num_computed_tokens):
            array[[a, b]] = array[[b, a]]
        self.block_table.swap_row(a, b)

    def condense(self) -> None:
        """Fill the holes with the last rows, lowest hole first, so that rows
        ``[0, num_reqs)`` are the batch; the order of the rows that stay put is kept.

        upstream: vllm/v1/worker/gpu_input_batch.py:580 @ v0.11.0
        """
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        for hole in holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            if hole >= len(self.req_ids):
                break  # the holes left were at the end, and are gone
            last = len(self.req_ids) - 1
            req_id = self.req_ids.pop()
            self.req_ids[hole] = req_id
            self.req_id_to_index[req_id] = hole
            n = int(self.num_tokens[last])
            self.token_ids[hole, :n] = self.token_ids[last, :n]
            for array in (self.num_tokens, self.num_tokens_no_spec, self.num_prompt_tokens,
                          self.num_computed_tokens):
                array[hole] = array[last]
            self.block_table.move_row(last, hole)
