"""Known-wrong edits to the reference's speculative decoding that lab 04-04's tests must reject:
the classic mistakes of a rejection sampler (accepting on p >= q, recovering from p instead of
p - q, the bonus token dropped or added after a rejection), of the scheduler's drafts (drafts
never spent, rejected KV left computed) and of prompt lookup."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

PROPOSER = "mini_vllm/spec_decode/ngram_proposer.py"
SAMPLER = "mini_vllm/sample/rejection_sampler.py"
SCHEDULER = "mini_vllm/core/sched/scheduler.py"

BUGS = [
    PlantedBug(
        name="latest-occurrence",
        description="the proposer continues the latest earlier occurrence of the suffix, not the "
        "earliest",
        file=PROPOSER,
        find="for j in range(total - n):",
        replace="for j in reversed(range(total - n)):",
    ),
    PlantedBug(
        name="shortest-match-first",
        description="the proposer tries the shortest suffix length first",
        file=PROPOSER,
        find="for n in range(min(max_n, total - 1), min_n - 1, -1):",
        replace="for n in range(min_n, min(max_n, total - 1) + 1):",
    ),
    PlantedBug(
        name="proposal-past-max-model-len",
        description="the proposal ignores max_model_len",
        file=PROPOSER,
        find="k = min(k, max_model_len - total)",
        replace="k = k",
    ),
    PlantedBug(
        name="accept-on-p-ge-q",
        description="a draft is accepted when p >= q, never with probability p / q",
        file=SAMPLER,
        find="return draft_prob > 0 and target_prob / draft_prob >= uniform",
        replace="return draft_prob > 0 and target_prob >= draft_prob",
    ),
    PlantedBug(
        name="recovered-from-p",
        description="a rejected position's token is drawn from p, not from max(0, p - q)",
        file=SAMPLER,
        find="residual = (target_probs - draft_probs).clamp_min(0.0)",
        replace="residual = target_probs.clone()",
    ),
    PlantedBug(
        name="recovered-keeps-the-draft",
        description="without draft probabilities, the rejected draft token stays in the "
        "recovered distribution",
        file=SAMPLER,
        find="residual[draft_token] = 0.0",
        replace="pass",
    ),
    PlantedBug(
        name="bonus-after-rejection",
        description="a request whose draft was rejected still gets the bonus token",
        file=SAMPLER,
        find="""generator=generator)))
            return emitted, False""",
        replace="""generator=generator)))
            return emitted, True""",
    ),
    PlantedBug(
        name="bonus-dropped",
        description="a random request that accepted every draft gets no bonus token",
        file=SAMPLER,
        find="""            return emitted, False
        return emitted, True

    @staticmethod
    def parse_output""",
        replace="""            return emitted, False
        return emitted, False

    @staticmethod
    def parse_output""",
    ),
    PlantedBug(
        name="greedy-emits-the-draft",
        description="greedy verification emits the rejected draft instead of the argmax",
        file=SAMPLER,
        find="""            best = int(p[pos].argmax())
            emitted.append(best)""",
        replace="""            best = int(p[pos].argmax())
            emitted.append(int(draft))""",
    ),
    PlantedBug(
        name="uniforms-drawn-lazily",
        description="the random verification draws each uniform when it reaches its position, "
        "so the draws after a rejection shift",
        file=SAMPLER,
        find="if accepts(float(p[pos, draft]), draft_prob, float(uniforms[pos])):",
        replace="if accepts(float(p[pos, draft]), draft_prob, float(torch.rand(1, "
        "generator=generator, dtype=torch.float64))):",
    ),
    PlantedBug(
        name="drafts-for-prefill",
        description="requests in the middle of their prompt take drafts",
        file=SCHEDULER,
        find="""            if (request is None or request.status != RequestStatus.RUNNING
                    or request.num_computed_tokens < request.num_tokens - 1):""",
        replace="""            if request is None or request.status != RequestStatus.RUNNING:""",
    ),
    PlantedBug(
        name="drafts-not-spent",
        description="scheduled drafts stay in spec_token_ids, so the next step checks them again",
        file=SCHEDULER,
        find="""                spec[rid] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []""",
        replace="""                spec[rid] = request.spec_token_ids[:num_spec]""",
    ),
    PlantedBug(
        name="unscheduled-drafts-named",
        description="the output names every draft of a request, also those the budget cut",
        file=SCHEDULER,
        find="spec[rid] = request.spec_token_ids[:num_spec]",
        replace="spec[rid] = list(request.spec_token_ids)",
    ),
    PlantedBug(
        name="rejected-kv-kept",
        description="rejected drafts are not rolled back: their KV, computed from wrong tokens, "
        "counts as computed",
        file=SCHEDULER,
        find="request.num_computed_tokens -= num_draft_tokens - num_accepted",
        replace="pass",
    ),
    PlantedBug(
        name="rollback-by-accepted",
        description="the rollback steps back over the accepted drafts instead of the rejected",
        file=SCHEDULER,
        find="request.num_computed_tokens -= num_draft_tokens - num_accepted",
        replace="request.num_computed_tokens -= num_accepted",
    ),
]
