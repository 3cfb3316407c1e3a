"""Known-wrong edits to the reference swap space and swap-mode scheduler that lab 03-03's tests
must reject. The first six are the classic mistakes the lab was written against; the rest are
realistic mistakes its old tests let through (found with mutation testing and with the task-by-task
tests)."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

SWAP = "mini_vllm/core/swap.py"
SCHED = "mini_vllm/core/sched/scheduler.py"

BUGS = [
    PlantedBug(
        name="swap-mapping-reversed",
        description="swap_in returns (gpu, cpu) pairs, so the runner copies in the wrong direction",
        file=SWAP,
        find="mapping = [(c.block_id, g) for c, g in zip(cpu_blocks, gpu_block_ids)]",
        replace="mapping = [(g, c.block_id) for c, g in zip(cpu_blocks, gpu_block_ids)]",
    ),
    PlantedBug(
        name="swap-in-scrambles-order",
        description="swap_in pairs the CPU blocks with the GPU blocks in reverse order",
        file=SWAP,
        find="for c, g in zip(cpu_blocks, gpu_block_ids)]",
        replace="for c, g in zip(reversed(cpu_blocks), gpu_block_ids)]",
    ),
    PlantedBug(
        name="cpu-blocks-not-freed",
        description="swap_in forgets to return the CPU blocks to the CPU pool",
        file=SWAP,
        find="        self.block_pool.free_blocks(cpu_blocks)\n        return mapping",
        replace="        return mapping",
    ),
    PlantedBug(
        name="swap-out-drops-partial-block",
        description="only full blocks are swapped out; the partially filled last block is lost",
        file=SCHED,
        find="num_blocks = cdiv(request.num_computed_tokens, self.block_size)\n"
        "        gpu_block_ids",
        replace="num_blocks = request.num_computed_tokens // self.block_size\n"
        "        gpu_block_ids",
    ),
    PlantedBug(
        name="swap-in-ignores-budget",
        description="a swapped-in request does not consume the token budget",
        file=SCHED,
        find="step.num_scheduled_tokens[request.request_id] = num_new_tokens\n"
        "            step.token_budget -= num_new_tokens\n\n    def _schedule_waiting",
        replace="step.num_scheduled_tokens[request.request_id] = num_new_tokens\n\n"
        "    def _schedule_waiting",
    ),
    PlantedBug(
        name="swap-resets-progress",
        description="a swapped-out request forgets its computed tokens, like a recompute",
        file=SCHED,
        find="        request.status = RequestStatus.SWAPPED\n",
        replace="        request.status = RequestStatus.SWAPPED\n"
        "        request.num_computed_tokens = 0\n",
    ),
    PlantedBug(
        name="swap-in-into-the-last-blocks",
        description="a resumed request's parked KV is copied into the last blocks of its new "
        "table (the ones just allocated for the new tokens) instead of the first",
        file=SCHED,
        find="swap_in(request.request_id, gpu_block_ids[:num_swapped])",
        replace="swap_in(request.request_id, gpu_block_ids[-num_swapped:])",
    ),
    PlantedBug(
        name="resumed-as-running",
        description="a request swapped back in is reported as a running request, so the runner "
        "appends its new table to the old one instead of replacing it",
        file=SCHED,
        find="""            self.running.append(request)
            step.scheduled_resumed_reqs.append(request)""",
        replace="""            self.running.append(request)
            step.scheduled_running_reqs.append(request)""",
    ),
    PlantedBug(
        name="resume-ignores-seats",
        description="swapped requests come back even when max_num_seqs requests already run",
        file=SCHED,
        find="""        while self.swapped and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
""",
        replace="""        while self.swapped and step.token_budget > 0:
""",
    ),
    PlantedBug(
        name="swap-victim-jumps-the-queue",
        description="a swapped-out victim goes to the front of `swapped`, ahead of requests "
        "that were parked before it",
        file=SCHED,
        find="""        request.status = RequestStatus.SWAPPED
        self.swapped.append(request)""",
        replace="""        request.status = RequestStatus.SWAPPED
        self.swapped.appendleft(request)""",
    ),
    PlantedBug(
        name="swap-out-whole-table",
        description="the whole block table is swapped out, not only the blocks that hold "
        "computed tokens: blocks reserved ahead (lookahead slots) travel too and take CPU blocks",
        file=SCHED,
        find="gpu_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]"
        "[:num_blocks]",
        replace="gpu_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]",
    ),
]
