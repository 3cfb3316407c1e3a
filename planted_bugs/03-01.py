"""Known-wrong edits to the reference scheduler that lab 03-01's tests must reject.

The first seven are the classic mistakes the lab was written against; the rest are realistic
mistakes that mutation testing (mutation/03-01.toml) found the old tests let through.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

FILE = "mini_vllm/core/sched/scheduler.py"

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
    PlantedBug(
        name="nothing-to-do-stops-the-walk",
        description="a running request with nothing to do in this step (its token has not come "
        "back yet) ends the running loop, so the requests behind it get nothing",
        file=FILE,
        find="""                req_index += 1
                continue""",
        replace="""                break""",
    ),
    PlantedBug(
        name="stop-token-before-length-cap",
        description="check_stop tests EOS and stop tokens before the length cap, so a request "
        "whose last allowed token is EOS finishes 'stop' instead of 'length'",
        file=FILE,
        find=(
            "    if request.num_tokens >= max_model_len or "
            "request.num_output_tokens >= request.max_tokens:\n"
            "        request.status = RequestStatus.FINISHED_LENGTH_CAPPED\n"
            "        return True\n"
            "    params = request.sampling_params\n"
            "    last_token_id = request.output_token_ids[-1]\n"
        ),
        replace=(
            "    params = request.sampling_params\n"
            "    last_token_id = request.output_token_ids[-1]\n"
            "    if last_token_id in params.stop_token_ids or (\n"
            "        not params.ignore_eos and last_token_id == request.eos_token_id\n"
            "    ):\n"
            "        pass  # checked below, before the length cap\n"
            "    elif request.num_tokens >= max_model_len or "
            "request.num_output_tokens >= request.max_tokens:\n"
            "        request.status = RequestStatus.FINISHED_LENGTH_CAPPED\n"
            "        return True\n"
        ),
    ),
    PlantedBug(
        name="swapped-not-counted",
        description="get_num_unfinished_requests forgets the swapped queue, so the engine stops "
        "while requests are parked on the CPU",
        file=FILE,
        find="return len(self.waiting) + len(self.running) + len(self.swapped)",
        replace="return len(self.waiting) + len(self.running)",
    ),
    PlantedBug(
        name="exact-fit-refused",
        description="add_request refuses a request that needs exactly the usable blocks",
        file=FILE,
        find="if cdiv(longest, self.block_size) > usable:",
        replace="if cdiv(longest, self.block_size) >= usable:",
    ),
    PlantedBug(
        name="cached-count-overwritten",
        description="num_cached_tokens is set again on every admission, so a re-admitted "
        "request reports the hit of its re-admission, not of its first",
        file=FILE,
        find="if request.num_cached_tokens < 0:",
        replace="if True:",
    ),
    PlantedBug(
        name="stopped-request-removed-from-running-only",
        description="update_from_output looks for a stopped request only in running: one that "
        "was preempted (or swapped out) after it was scheduled stays queued forever",
        file=FILE,
        find="""            if request in self.running:
                self.running.remove(request)
            elif request in self.swapped:
                self.swapped.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._free_request(request)""",
        replace="""            if request in self.running:
                self.running.remove(request)
            self._free_request(request)""",
    ),
    PlantedBug(
        name="one-id-read-as-characters",
        description="finish_requests iterates over a single id given as a string, so "
        "finish_requests('12') finishes requests '1' and '2'",
        file=FILE,
        find="ids = (request_ids,) if isinstance(request_ids, str) else set(request_ids)",
        replace="ids = set(request_ids)",
    ),
    PlantedBug(
        name="drafts-not-budgeted",
        description="_num_new_tokens counts only num_tokens, so a request's draft tokens are "
        "never scheduled and speculative decoding never runs",
        file=FILE,
        find="num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens",
        replace="num_new_tokens = request.num_tokens - request.num_computed_tokens",
    ),
    PlantedBug(
        name="rejected-drafts-kept",
        description="update_from_output never rolls back the rejected drafts, so their KV "
        "(computed from wrong tokens) counts as computed",
        file=FILE,
        find="""            if drafts:
                self._roll_back_rejected(request, len(drafts), len(new_token_ids) - 1)
""",
        replace="",
    ),
]
