"""Known-wrong edits to the persistent batch that lab 04-03's tests must reject: rows taken from
the top instead of the lowest hole, state left behind or half moved, holes condensed in the wrong
order or not at all, a block table that forgets a count or drops the size, and a runner that keeps
rows it should free, misses a diff, trusts a stale row or leaves the batch out of order."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

BATCH = "mini_vllm/worker/input_batch.py"
TABLE = "mini_vllm/worker/block_table.py"
RUNNER = "mini_vllm/worker/persistent_runner.py"

BUGS = [
    PlantedBug(
        name="new-rows-at-the-end",
        description="a new request never takes a hole: rows run out while holes are free",
        file=BATCH,
        find="        row = next((i for i, r in enumerate(self.req_ids) if r is None), "
        "len(self.req_ids))\n",
        replace="        row = len(self.req_ids)\n",
    ),
    PlantedBug(
        name="no-spec-count-not-set",
        description="a new row's num_tokens_no_spec keeps the previous owner's count",
        file=BATCH,
        find="        self.num_tokens[row] = self.num_tokens_no_spec[row] = n\n",
        replace="        self.num_tokens[row] = n\n",
    ),
    PlantedBug(
        name="full-batch-overwrites",
        description="a full batch is not refused: the request lands past the last row",
        file=BATCH,
        find="        if row >= self.max_num_reqs:\n",
        replace="        if row > self.max_num_reqs:\n",
    ),
    PlantedBug(
        name="removed-id-stays-mapped",
        description="a removed request stays in req_id_to_index",
        file=BATCH,
        find="        row = self.req_id_to_index.pop(req_id, None)\n",
        replace="        row = self.req_id_to_index.get(req_id)\n",
    ),
    PlantedBug(
        name="swap-leaves-counts",
        description="swapping rows moves the tokens but not num_computed_tokens",
        file=BATCH,
        find="        for array in (self.num_tokens, self.num_tokens_no_spec, "
        "self.num_prompt_tokens,\n                      self.num_computed_tokens):\n"
        "            array[[a, b]] = array[[b, a]]\n",
        replace="        for array in (self.num_tokens, self.num_tokens_no_spec, "
        "self.num_prompt_tokens):\n            array[[a, b]] = array[[b, a]]\n",
    ),
    PlantedBug(
        name="swap-keeps-block-rows",
        description="swapping rows leaves the block table as it was",
        file=BATCH,
        find="        self.block_table.swap_row(a, b)\n",
        replace="",
    ),
    PlantedBug(
        name="swap-short-width",
        description="a swap moves only the shorter row's width of tokens",
        file=BATCH,
        find="        width = int(max(self.num_tokens[a], self.num_tokens[b]))\n",
        replace="        width = int(min(self.num_tokens[a], self.num_tokens[b]))\n",
    ),
    PlantedBug(
        name="condense-forgets-the-index",
        description="a moved row's request still maps to its old row",
        file=BATCH,
        find="            self.req_id_to_index[req_id] = hole\n",
        replace="",
    ),
    PlantedBug(
        name="condense-leaves-blocks",
        description="condensing moves a row's tokens but not its block table",
        file=BATCH,
        find="            self.block_table.move_row(last, hole)\n",
        replace="",
    ),
    PlantedBug(
        name="condense-keeps-trailing-holes",
        description="holes at the end of the batch stay in req_ids",
        file=BATCH,
        find="            while self.req_ids and self.req_ids[-1] is None:\n"
        "                self.req_ids.pop()\n",
        replace="",
    ),
    PlantedBug(
        name="append-overwrites",
        description="appended blocks overwrite the row's first blocks",
        file=TABLE,
        find="        start = int(self.num_blocks_per_row[row])\n",
        replace="        start = 0\n",
    ),
    PlantedBug(
        name="add-row-appends",
        description="a resumed request's blocks are appended to its stale table",
        file=TABLE,
        find="        self.num_blocks_per_row[row] = 0\n        self.append_row(block_ids, row)\n",
        replace="        self.append_row(block_ids, row)\n",
    ),
    PlantedBug(
        name="move-row-no-count",
        description="a moved row keeps the target's old block count",
        file=TABLE,
        find="        self.num_blocks_per_row[tgt] = n\n",
        replace="",
    ),
    PlantedBug(
        name="swap-row-no-counts",
        description="swapping rows exchanges their blocks but not their counts",
        file=TABLE,
        find="        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]\n",
        replace="",
    ),
    PlantedBug(
        name="slot-without-offset",
        description="a token's slot is its block's first slot",
        file=TABLE,
        find="        return block_numbers.astype(np.int64) * self.block_size + positions % "
        "self.block_size\n",
        replace="        return block_numbers.astype(np.int64) * self.block_size\n",
    ),
    PlantedBug(
        name="unscheduled-keep-rows",
        description="a request left out of a step keeps its row, so the batch holds requests "
        "that compute nothing",
        file=RUNNER,
        find="        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:\n"
        "            batch.remove_request(req_id)\n",
        replace="",
    ),
    PlantedBug(
        name="new-id-keeps-old-row",
        description="an id used again keeps the old request's row",
        file=RUNNER,
        find="            batch.remove_request(new.req_id)  # an id used again after an abort "
        "starts afresh\n",
        replace="            pass\n",
    ),
    PlantedBug(
        name="only-new-requests-added",
        description="only new requests take rows: one resumed after preemption, or back after "
        "a step left out, has none",
        file=RUNNER,
        find="        for req_id in scheduler_output.scheduled_req_ids:\n",
        replace="        for req_id in [n.req_id for n in scheduler_output.scheduled_new_reqs]:\n",
    ),
    PlantedBug(
        name="computed-not-updated",
        description="a row's num_computed_tokens is never updated after it is added",
        file=RUNNER,
        find="            batch.num_computed_tokens[row] = cached.num_computed_tokens[i]\n",
        replace="",
    ),
    PlantedBug(
        name="new-blocks-dropped",
        description="a running request's new blocks never reach its row",
        file=RUNNER,
        find="            if cached.new_block_ids[i] is not None:\n"
        "                batch.block_table.append_row(cached.new_block_ids[i][0], row)\n",
        replace="",
    ),
    PlantedBug(
        name="no-condense",
        description="the batch is never condensed, so holes reach the step's inputs",
        file=RUNNER,
        find="        batch.condense()\n",
        replace="",
    ),
    PlantedBug(
        name="sampled-token-not-synced",
        description="a row never gets the token its request sampled",
        file=RUNNER,
        find="            if len(tokens) != batch.num_tokens[row] or start != "
        "batch.num_tokens[row]:\n",
        replace="            if False:\n",
    ),
    PlantedBug(
        name="rejected-drafts-trusted",
        description="a row whose drafts were rejected keeps them when the record is as long",
        file=RUNNER,
        find="            if len(tokens) != batch.num_tokens[row] or start != "
        "batch.num_tokens[row]:\n",
        replace="            if len(tokens) != batch.num_tokens[row]:\n",
    ),
    PlantedBug(
        name="no-reorder",
        description="the rows are never ordered decodes-first",
        file=RUNNER,
        find="        reorder_batch_to_split_decodes_and_prefills(order, scheduled)\n",
        replace="",
    ),
]
