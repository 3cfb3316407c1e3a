"""Known-wrong edits of lab 02-05 (fork and copy-on-write) that the tests must reject."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

_MGR = "mini_vllm/core/block_sharing.py"
_POOL = "mini_vllm/core/block_pool.py"

BUGS = [
    PlantedBug(
        name="cow-skipped-at-count-two",
        description="copy-on-write only when three or more tables share the block: with one "
        "parent and one child (ref_cnt exactly 2) both write into the same block",
        file=_MGR,
        find="if table[i].ref_cnt > 1]",
        replace="if table[i].ref_cnt > 2]",
    ),
    PlantedBug(
        name="cow-mapping-reversed",
        description="the copy is reported as (dst, src): the runner copies the fresh, empty "
        "block over the shared one and destroys the KV every other holder reads",
        file=_MGR,
        find="copies.append((src.block_id, dst.block_id))",
        replace="copies.append((dst.block_id, src.block_id))",
    ),
    PlantedBug(
        name="fork-without-incref",
        description="fork copies the table but adds no reference: when the parent finishes its "
        "blocks return to the free queue while the child still reads them",
        file=_MGR,
        find="self.block_pool.touch((parent_blocks,))",
        replace="pass",
    ),
    PlantedBug(
        name="fork-aliases-parent-table",
        description="the child gets the parent's list object instead of a copy, so replacing "
        "the child's shared block on write replaces the parent's too",
        file=_MGR,
        find="self.req_to_blocks[child_id] = list(parent_blocks)",
        replace="self.req_to_blocks[child_id] = parent_blocks",
    ),
    PlantedBug(
        name="cow-keeps-old-reference",
        description="after copying, the shared block keeps the writer's reference: it leaks and "
        "never returns to the free queue",
        file=_MGR,
        find="self.block_pool.free_blocks(shared_blocks)",
        replace="pass",
    ),
    PlantedBug(
        name="cow-misses-partial-block",
        description="the first written block is computed by rounding up, so the partly filled "
        "last block (the one that is shared after a fork) is never copied",
        file=_MGR,
        find="first_written = request.num_computed_tokens // self.block_size",
        replace="first_written = -(-request.num_computed_tokens // self.block_size)",
    ),
    PlantedBug(
        name="free-drops-shared-blocks",
        description="freeing a request zeroes the count of every block it holds, so finishing a "
        "child hands the parent's blocks back to the free queue",
        file=_POOL,
        find="            ref_cnt = block.ref_cnt - 1\n",
        replace="            ref_cnt = 0\n",
    ),
    PlantedBug(
        name="append-refusal-ignores-lookahead",
        description="append_slots counts the blocks for the new tokens but not for the lookahead "
        "slots: it starts copying, then allocate_slots finds too few free blocks half-way",
        file=_MGR,
        find="num_tokens_need_slot = min(num_tokens + num_lookahead_tokens, self.max_model_len)",
        replace="num_tokens_need_slot = min(num_tokens, self.max_model_len)",
    ),
    PlantedBug(
        name="append-refuses-exactly-max-model-len",
        description="append_slots refuses a step that brings the request to exactly "
        "max_model_len tokens, which fits",
        file=_MGR,
        find="if num_tokens > self.max_model_len:",
        replace="if num_tokens >= self.max_model_len:",
    ),
    PlantedBug(
        name="append-new-blocks-not-clamped",
        description="append_slots takes the new-block count without max(0, ...): a forked "
        "request that holds lookahead blocks counts -1 new blocks, so 2 copies pass the check "
        "with one block free and the copy raises half-way instead of returning None",
        file=_MGR,
        find="num_new_blocks = max(\n"
        "            0, self._get_num_blocks_to_allocate(request_id, num_tokens_need_slot, [])\n"
        "        )",
        replace="num_new_blocks = self._get_num_blocks_to_allocate(\n"
        "            request_id, num_tokens_need_slot, []\n"
        "        )",
    ),
]
