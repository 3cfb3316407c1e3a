"""Known-wrong edits of the lab 02-02 reference that its tests must reject."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

SOLUTION = "phase-02-paged-attention/labs/lab-02-fragmentation/solution.py"

BUGS = [
    PlantedBug(
        name="pow2-rounds-down",
        description="the power-of-two reservation rounds the final length down, so a request "
        "can outgrow its reservation",
        file="mini_vllm/core/sched/reservation.py",
        find="return min(1 << (final_len - 1).bit_length(), max_model_len)",
        replace="return min(1 << (final_len.bit_length() - 1), max_model_len)",
    ),
    PlantedBug(
        name="free-forgets-the-left-neighbour",
        description="freeing a range never merges it with the hole before it, so free memory "
        "splinters into holes too small to use",
        file=SOLUTION,
        find="if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:",
        replace="if False:",
    ),
    PlantedBug(
        name="last-fit",
        description="allocate picks the highest hole that fits instead of the lowest",
        file=SOLUTION,
        find="for i, (start, hole) in enumerate(self.holes):",
        replace="for i, (start, hole) in reversed(list(enumerate(self.holes))):",
    ),
    PlantedBug(
        name="internal-counted-as-reserved",
        description="slots the request will never fill are counted as reserved for the future",
        file=SOLUTION,
        find="used_eventually = min(allocated, final_len)",
        replace="used_eventually = allocated",
    ),
    PlantedBug(
        name="paging-block-one-token-early",
        description="paging takes a new block one token before the last block is full",
        file=SOLUTION,
        find="if req.num_tokens % self.block_size != 0:",
        replace="if (req.num_tokens + 1) % self.block_size != 0:",
    ),
    PlantedBug(
        name="preempt-the-oldest",
        description="out of blocks, paging preempts the oldest running request instead of the "
        "newest",
        file=SOLUTION,
        find="victim = running.pop()",
        replace="victim = running.pop(0)",
    ),
    PlantedBug(
        name="release-head-first",
        description="paging returns a request's blocks first block first",
        file=SOLUTION,
        find="self.pool.free_blocks(reversed(self.tables.pop(req.rid)))",
        replace="self.pool.free_blocks(self.tables.pop(req.rid))",
    ),
    PlantedBug(
        name="hole-must-be-larger",
        description="first fit skips a hole of exactly the requested size, so memory that fits "
        "is reported as fragmented (a mutation survivor of the old tests)",
        file=SOLUTION,
        find="if hole >= size:",
        replace="if hole > size:",
    ),
    PlantedBug(
        name="paging-admission-off-by-one",
        description="paging refuses a prompt whose blocks are exactly the free ones (a mutation "
        "survivor of the old tests)",
        file=SOLUTION,
        find="if num_blocks > self.pool.get_num_free_blocks():",
        replace="if num_blocks >= self.pool.get_num_free_blocks():",
    ),
]
