"""Known-wrong edits of the engine step that the tests of lab 03-04 must reject."""

from course.integrity.bugs import PlantedBug

BUGS = [
    PlantedBug(
        name="stale-num-computed-tokens",
        description="the runner never advances num_computed_tokens from the scheduler's diff, "
        "so every later step re-reads the first tokens at the first positions",
        file="mini_vllm/worker/model_runner.py",
        find="state.num_computed_tokens = cached.num_computed_tokens[i]",
        replace="state.num_computed_tokens = state.num_computed_tokens",
    ),
    PlantedBug(
        name="first-row-logits",
        description="samples from the logits of each request's first scheduled token instead "
        "of its last",
        file="mini_vllm/worker/model_runner.py",
        find="rows.append(query_start_loc[i + 1] - 1)",
        replace="rows.append(query_start_loc[i])",
    ),
    PlantedBug(
        name="sample-mid-prefill",
        description="samples a token after every chunk of a chunked prefill, not only once "
        "the whole prompt is in the cache",
        file="mini_vllm/worker/model_runner.py",
        find="""            if seq_lens[i] >= state.num_tokens:
                rows.append(query_start_loc[i + 1] - 1)""",
        replace="""            if True:
                rows.append(query_start_loc[i + 1] - 1)""",
    ),
    PlantedBug(
        name="resumed-request-keeps-old-table",
        description="a request resumed after preemption appends its new blocks to the table "
        "it lost instead of replacing it",
        file="mini_vllm/worker/model_runner.py",
        find="if cached.resumed_from_preemption[i]:",
        replace="if False:",
    ),
    PlantedBug(
        name="input-ids-from-position-zero",
        description="the batch takes each request's tokens from the start of the sequence "
        "rather than from its num_computed_tokens",
        file="mini_vllm/worker/model_runner.py",
        find="input_ids.extend(s.token_ids[start : start + scheduled[s.req_id]])",
        replace="input_ids.extend(s.token_ids[0 : scheduled[s.req_id]])",
    ),
    PlantedBug(
        name="finished-requests-never-dropped",
        description="the runner keeps the state of finished requests forever",
        file="mini_vllm/worker/model_runner.py",
        find="self.requests.pop(req_id, None)",
        replace="self.requests.get(req_id)",
    ),
    PlantedBug(
        name="swap-after-forward",
        description="blocks are swapped in after the forward pass instead of before it, so a "
        "request resumed from swap attends to stale cache blocks",
        file="mini_vllm/worker/model_runner.py",
        find="""        self._update_states(scheduler_output)
        self._execute_block_ops(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        drafts = self._stage_drafts(scheduler_output)
        input_ids, meta = self._prepare_inputs(scheduler_output)
        self._account(meta)
        hidden = self._forward(input_ids, meta)""",
        replace="""        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._execute_block_ops(scheduler_output)
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        drafts = self._stage_drafts(scheduler_output)
        input_ids, meta = self._prepare_inputs(scheduler_output)
        self._account(meta)
        hidden = self._forward(input_ids, meta)
        self._execute_block_ops(scheduler_output)""",
    ),
    PlantedBug(
        name="idle-step-schedules",
        description="step() schedules (and counts a step) even when no request is left",
        file="mini_vllm/engine/core.py",
        find="""        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()""",
        replace="""        scheduler_output = self.scheduler.schedule()""",
    ),
    PlantedBug(
        name="batch-order-from-scratch",
        description="the batch order is rebuilt from the scheduler's order every step instead "
        "of keeping the last step's, so requests move around (and the decodes-first reorder "
        "gives another batch than upstream's persistent one)",
        file="mini_vllm/worker/model_runner.py",
        find="order = [r for r in self.batch_req_ids if r in scheduled]",
        replace="order = []",
    ),
    PlantedBug(
        name="empty-step-skips-the-diff",
        description="a step that schedules no token returns at once, so the requests that "
        "finished are not forgotten and the swaps of that step are never made",
        file="mini_vllm/worker/model_runner.py",
        find="""        self._update_states(scheduler_output)
        self._execute_block_ops(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
""",
        replace="""        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        self._update_states(scheduler_output)
        self._execute_block_ops(scheduler_output)
""",
    ),
    PlantedBug(
        name="min-tokens-not-enforced",
        description="the sampler is not told which stop tokens min_tokens still bans, so a "
        "request can stop before its minimum length",
        file="mini_vllm/worker/model_runner.py",
        find="            banned_token_ids=[self._stop_token_ids(s) for s in states],\n",
        replace="",
    ),
    PlantedBug(
        name="logprobs-of-the-argmax",
        description="the log-probabilities are gathered for each row's likeliest token, not the "
        "token the sampler drew: the same under greedy decoding, wrong for any other",
        file="mini_vllm/worker/model_runner.py",
        find="self._gather_sample_logprobs(logits, states, token_tensor)",
        replace="self._gather_sample_logprobs(logits, states, logits.argmax(-1))",
    ),
    # The beam step (tasks 6 and 7).
    PlantedBug(
        name="length-penalty-on-generated-tokens",
        description="the sort key divides by the generated length only, not the whole sequence "
        "with its prompt (today's upstream rule, not v0.11.0's that the lab grades), so a beam "
        "that ended early ranks against the others by the wrong length",
        file="mini_vllm/entrypoints/beam_search.py",
        find="return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, "
        "length_penalty)",
        replace="return get_beam_search_score(beam.tokens[-len(beam.logprobs):], "
        "beam.cum_logprob, eos_token_id, length_penalty)",
    ),
    PlantedBug(
        name="aborted-beam-kept-alive",
        description="a beam whose request was aborted (no answer) stays among the live beams "
        "as it was, and can outrank the children of the others",
        file="mini_vllm/entrypoints/beam_search.py",
        find="        if answer is None:\n            continue\n",
        replace="        if answer is None:\n            candidates.append(beam)\n"
        "            continue\n",
    ),
    PlantedBug(
        name="completed-beams-dropped",
        description="the final ranking takes the live beams only: every beam that ended with "
        "EOS is lost, however well it scored",
        file="mini_vllm/entrypoints/beam_search.py",
        find="ranked = sorted([*instance.completed, *instance.beams], key=sort_key, "
        "reverse=True)",
        replace="ranked = sorted(instance.beams, key=sort_key, reverse=True)",
    ),
    PlantedBug(
        name="final-ranking-reverses-ties",
        description="the final ranking sorts worst first and reverses the list, so beams with "
        "equal scores come out in the opposite order (a completed beam behind a live one)",
        file="mini_vllm/entrypoints/beam_search.py",
        find="ranked = sorted([*instance.completed, *instance.beams], key=sort_key, "
        "reverse=True)",
        replace="ranked = sorted([*instance.completed, *instance.beams], key=sort_key)[::-1]",
    ),
    PlantedBug(
        name="duplicate-candidates-from-two-beams",
        description="a nested loop where a zip belongs: every live beam is extended by every "
        "beam's answer, so a token two beams both propose makes the same candidate twice",
        file="mini_vllm/entrypoints/beam_search.py",
        find="for beam, answer in zip(instance.beams, answers):",
        replace="for beam, answer in [(b, a) for b in instance.beams for a in answers]:",
    ),
    PlantedBug(
        name="eos-counted-as-a-token",
        description="the score counts a final EOS in the length, so completed beams are "
        "divided by one token too many",
        file="mini_vllm/entrypoints/beam_search.py",
        find="        length -= 1\n",
        replace="        pass\n",
    ),
    PlantedBug(
        name="drafts-not-staged",
        description="execute_model never stages the step's drafts, so the inputs lack them",
        file="mini_vllm/worker/model_runner.py",
        find="drafts = self._stage_drafts(scheduler_output)",
        replace="drafts = {}",
    ),
    PlantedBug(
        name="drafts-sampled-plainly",
        description="a step that checks drafts samples one token per request, as without them",
        file="mini_vllm/worker/model_runner.py",
        find="""        sampled = (self._sample_with_drafts(hidden, meta, drafts) if drafts
                   else self._sample(hidden, meta))""",
        replace="""        sampled = self._sample(hidden, meta)""",
    ),
    PlantedBug(
        name="no-draft-proposals",
        description="execute_model never asks the proposer for the next drafts",
        file="mini_vllm/worker/model_runner.py",
        find="        self._propose_drafts(meta, sampled, drafts)\n",
        replace="",
    ),
]
