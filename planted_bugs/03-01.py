"""Known-wrong edits to the reference scheduler that lab 03-01's tests must reject."""

from __future__ import annotations

from course.bugs import PlantedBug

FILE = "mini_vllm/scheduler.py"

BUGS = [
    PlantedBug(
        name="victim-from-wrong-end",
        description="preemption takes the oldest running request (the head) instead of the newest",
        file=FILE,
        find="victim = self.running.pop()",
        replace="victim = self.running.pop(0)",
    ),
    PlantedBug(
        name="budget-not-decremented",
        description="running requests do not consume the token budget",
        file=FILE,
        find="step.token_budget -= num_new_tokens\n            req_index += 1",
        replace="req_index += 1",
    ),
    PlantedBug(
        name="admit-after-preemption",
        description="waiting requests are admitted even in a step that had to preempt",
        file=FILE,
        find="if not step.preempted_reqs and not self.swapped:",
        replace="if not self.swapped:",
    ),
    PlantedBug(
        name="max-tokens-off-by-one",
        description="the length cap lets a request generate max_tokens + 1 tokens",
        file=FILE,
        find="request.num_output_tokens >= request.max_tokens",
        replace="request.num_output_tokens > request.max_tokens",
    ),
    PlantedBug(
        name="finished-not-freed",
        description="a finished request keeps its KV blocks",
        file=FILE,
        find="        self.kv_cache_manager.free(request)\n        if self.swap_space is not None:",
        replace="        if self.swap_space is not None:",
    ),
    PlantedBug(
        name="preempted-to-tail",
        description="a preempted request goes to the back of the waiting queue, not the head",
        file=FILE,
        find="self.waiting.appendleft(request)",
        replace="self.waiting.append(request)",
    ),
    PlantedBug(
        name="no-prefix-hit",
        description="admission ignores the prefix-cache hit and recomputes the whole prompt",
        file=FILE,
        find="num_new_tokens = request.num_tokens - num_computed_tokens",
        replace="num_computed_tokens, new_computed_blocks = 0, None\n"
        "            num_new_tokens = request.num_tokens - num_computed_tokens",
    ),
]
