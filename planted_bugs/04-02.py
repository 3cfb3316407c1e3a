"""Known-wrong edits to asynchronous scheduling that lab 04-02's tests must reject: placeholders
given to every chunk or never taken back, a scheduler blind to the step in flight or one step
late at max_tokens, caps lost, blocks cached too late or for a request without any, and a busy
loop turn that waits at once, skips an empty step, waits for the wrong step or swallows a
failure."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

SCHED = "mini_vllm/core/sched/async_scheduler.py"
CORE = "mini_vllm/engine/core.py"

BUGS = [
    PlantedBug(
        name="placeholder-for-every-chunk",
        description="every scheduled request gets a placeholder, so a prompt chunk that samples "
        "nothing is planned past its end",
        file=SCHED,
        find="            if request.num_computed_tokens == request.num_tokens + "
        "request.num_output_placeholders:\n",
        replace="            if True:\n",
    ),
    PlantedBug(
        name="computed-not-advanced",
        description="the synchronous bookkeeping is skipped after scheduling: num_computed_tokens "
        "never advances",
        file=SCHED,
        find="        super()._update_after_schedule(output)\n",
        replace="        self.finished_req_ids = set()\n",
    ),
    PlantedBug(
        name="placeholders-not-counted",
        description="the count ignores placeholders, so a request whose step runs is not planned "
        "for the token it samples",
        file=SCHED,
        find="        num_new_tokens = (request.num_tokens_with_spec + "
        "request.num_output_placeholders\n",
        replace="        num_new_tokens = (request.num_tokens_with_spec + 0\n",
    ),
    PlantedBug(
        name="one-step-past-max-tokens",
        description="a request whose step in flight samples its last token is planned once more",
        file=SCHED,
        find="                >= request.max_tokens):",
        replace="                > request.max_tokens):",
    ),
    PlantedBug(
        name="threshold-dropped",
        description="the long-prefill threshold no longer caps a request",
        file=SCHED,
        find="        if 0 < threshold < num_new_tokens:\n            num_new_tokens = threshold\n",
        replace="",
    ),
    PlantedBug(
        name="model-length-off-by-one",
        description="a request in flight may be planned for the position max_model_len",
        file=SCHED,
        find="self.max_model_len - 1 - request.num_computed_tokens))",
        replace="self.max_model_len - request.num_computed_tokens))",
    ),
    PlantedBug(
        name="placeholders-never-resolved",
        description="arriving tokens do not replace placeholders, which pile up",
        file=SCHED,
        find="            request.num_output_placeholders -= num_sampled\n",
        replace="",
    ),
    PlantedBug(
        name="overflow-unchecked",
        description="a step with more tokens than placeholders goes unnoticed",
        file=SCHED,
        find="            if num_sampled > request.num_output_placeholders:\n",
        replace="            if num_sampled > request.num_output_placeholders + 1:\n",
    ),
    PlantedBug(
        name="written-blocks-not-cached",
        description="arriving tokens cache nothing, so a finishing request's last written block "
        "is lost to the prefix cache",
        file=SCHED,
        find="            if num_sampled and request.status == RequestStatus.RUNNING:\n",
        replace="            if False:\n",
    ),
    PlantedBug(
        name="preempted-request-cached",
        description="a preempted request's blocks are cached, though it holds none",
        file=SCHED,
        find="            if num_sampled and request.status == RequestStatus.RUNNING:\n",
        replace="            if num_sampled:\n",
    ),
    PlantedBug(
        name="turn-waits-at-once",
        description="the turn waits for the step it just started: one step at a time again",
        file=CORE,
        find="            if scheduler_output.total_num_scheduled_tokens > 0 and len(queue)",
        replace="            if False and scheduler_output.total_num_scheduled_tokens > 0 and "
        "len(queue)",
    ),
    PlantedBug(
        name="empty-step-not-started",
        description="a step that schedules nothing is never started, and the turn returns None",
        file=CORE,
        find="            queue.appendleft((self.execute_model_async(scheduler_output), "
        "scheduler_output))\n",
        replace="            if scheduler_output.total_num_scheduled_tokens == 0:\n"
        "                return None\n"
        "            queue.appendleft((self.execute_model_async(scheduler_output), "
        "scheduler_output))\n",
    ),
    PlantedBug(
        name="three-in-flight",
        description="the queue lets a third step start before the oldest is waited for",
        file=CORE,
        find="and len(queue) < BATCH_QUEUE_SIZE:",
        replace="and len(queue) <= BATCH_QUEUE_SIZE:",
    ),
    PlantedBug(
        name="newest-waited-for",
        description="the turn waits for the newest step instead of the oldest",
        file=CORE,
        find="        future, scheduler_output = queue.pop()\n        model_output: "
        "ModelRunnerOutput",
        replace="        future, scheduler_output = queue.popleft()\n        model_output: "
        "ModelRunnerOutput",
    ),
    PlantedBug(
        name="in-flight-dropped-when-idle",
        description="with no request left the turn returns at once, leaving a step in flight "
        "unread",
        file=CORE,
        find="        if not queue:\n            return []\n",
        replace="        if not queue or not self.scheduler.has_unfinished_requests():\n"
        "            return []\n",
    ),
    PlantedBug(
        name="failure-swallowed",
        description="a step that raised is taken as a step with no tokens",
        file=CORE,
        find="        model_output: ModelRunnerOutput = future.result()\n",
        replace="        model_output: ModelRunnerOutput = (\n"
        "            future.result() if future.exception() is None\n"
        "            else ModelRunnerOutput(req_ids=[], req_id_to_index={}, "
        "sampled_token_ids=[]))\n",
    ),
    PlantedBug(
        name="blocks-in-step-not-counted",
        description="the turn skips the per-step block statistics",
        file=CORE,
        find="            self._record_blocks_in_step()\n            queue.appendleft(",
        replace="            queue.appendleft(",
    ),
]
