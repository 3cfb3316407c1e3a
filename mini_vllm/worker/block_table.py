"""The persistent block table: every live request's block ids in one preallocated array.

The per-step runner (:class:`~mini_vllm.worker.model_runner.ModelRunner`) stacks every request's
Python list of block ids into a fresh tensor each step. Here the table lives across steps, one
row per batch row of the :class:`~mini_vllm.worker.input_batch.InputBatch`, and a step changes
only what changed: the blocks a request gained (:meth:`BlockTable.append_row`), a row a new or
resumed request takes (:meth:`BlockTable.add_row`), rows moved or swapped when the batch is
condensed or reordered. The slot of each of the step's tokens is then one vectorised gather
(:meth:`BlockTable.compute_slot_mapping`).

upstream: vllm/v1/worker/block_table.py:16 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockTable", "BlockTableBase"]


class BlockTableBase:
    """Block ids of ``max_num_reqs`` rows, at most ``max_num_blocks_per_req`` each: the arrays
    and the step's tensor; :class:`BlockTable` adds the updates.

    Invariants: ``num_blocks_per_row[i]`` entries of row ``i`` are its request's block table, in
    order; entries past them are stale and never read. A row's owner is the input batch's
    business: this class only stores.

    upstream: vllm/v1/worker/block_table.py:16 @ v0.11.0
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        for name, value in (("max_num_reqs", max_num_reqs),
                            ("max_num_blocks_per_req", max_num_blocks_per_req),
                            ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockTable: {name} must be an int >= 1, got {value!r}")
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def tensor(self, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows as the step's int32 ``block_tables`` tensor, as wide as
        the longest of them (a copy: the step's metadata must not change under a later step).

        upstream: vllm/v1/worker/block_table.py:115 @ v0.11.0
        """
        cols = int(self.num_blocks_per_row[:num_reqs].max(initial=0))
        return torch.from_numpy(self.block_table[:num_reqs, :cols].copy())


class BlockTable(BlockTableBase):
    """The persistent block table, updated by diffs (see the module docstring).

    upstream: vllm/v1/worker/block_table.py:16 @ v0.11.0
    """

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Write ``block_ids`` after the blocks row ``row`` holds (a request's new blocks).

        Raises ``ValueError`` (and writes nothing) when the row would exceed its capacity.

        upstream: vllm/v1/worker/block_table.py:49 @ v0.11.0
        """
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"BlockTable: row {row} would hold {end} blocks, more than its "
                f"{self.max_num_blocks_per_req}; the request is longer than max_model_len")
        self.block_table[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Make ``block_ids`` the whole table of row ``row`` (a new or resumed request).

        upstream: vllm/v1/worker/block_table.py:61 @ v0.11.0
        """
        if len(block_ids) > self.max_num_blocks_per_req:
            raise ValueError(
                f"BlockTable: row {row} would hold {len(block_ids)} blocks, more than its "
                f"{self.max_num_blocks_per_req}; the request is longer than max_model_len")
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src``'s blocks into row ``tgt`` (condensing: ``src`` is left stale).

        upstream: vllm/v1/worker/block_table.py:65 @ v0.11.0
        """
        n = int(self.num_blocks_per_row[src])
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (reordering the batch decodes-first).

        upstream: vllm/v1/worker/block_table.py:71 @ v0.11.0
        """
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self.block_table[[a, b]] = self.block_table[[b, a]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each flat token (int64): ``table[row, pos // bs] * bs + pos % bs``.

        ``req_indices[t]`` is token ``t``'s batch row, ``positions[t]`` its position in its
        sequence; the row must hold a block for that position.

        upstream: vllm/v1/worker/block_table.py:76 @ v0.11.0
        """
        block_numbers = self.block_table[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
