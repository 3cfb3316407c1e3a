"""Known-wrong edits of the lab 01-02 reference that the tests must reject.

Each is a mistake people make when they first write an online softmax;
`python -m course check 01-02` applies them one at a time.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

_OS = "mini_vllm/attention/online_softmax.py"

BUGS = [
    PlantedBug(
        name="update-forgets-to-rescale-accumulator",
        description="a block with a larger maximum rescales the sum but not the accumulator, "
        "so earlier values keep weights relative to the old maximum",
        file=_OS,
        find="acc = state.acc * alpha[..., None] + p @ values.to(state.acc.dtype)",
        replace="acc = state.acc + p @ values.to(state.acc.dtype)",
    ),
    PlantedBug(
        name="merge-forgets-to-rescale",
        description="merge weights a partial by its own sum without exp(max - new_max), as if "
        "both sums were relative to the same maximum",
        file=_OS,
        find="weight_a = a.exp_sum * torch.exp(a.max_logit - ref)",
        replace="weight_a = a.exp_sum",
    ),
    PlantedBug(
        name="reduce-forgets-to-rescale",
        description="the v2-style reduce sums the partials' exp_sums without rescaling them to "
        "the global maximum",
        file=_OS,
        find="rescaled = exp_sum * torch.exp(max_logit - ref[..., None])",
        replace="rescaled = exp_sum",
    ),
    PlantedBug(
        name="exp-without-max",
        description="the block's probabilities are exp(scores) instead of exp(scores - max): "
        "inconsistent with the rescaling, and inf for logits near 1e4",
        file=_OS,
        find="p = torch.exp(scores - ref[..., None])",
        replace="p = torch.exp(scores)",
    ),
    PlantedBug(
        name="nan-for-masked-rows",
        description="the running max is used even when it is -inf, so a fully masked block "
        "computes exp(-inf - -inf) = nan",
        file=_OS,
        find="    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)",
        replace="    return m",
    ),
    PlantedBug(
        name="block-relative-to-its-own-maximum",
        description="each block's exponentials are taken relative to the block's own maximum "
        "while the state keeps the running one: wrong whenever a later block's maximum is "
        "smaller than an earlier one",
        file=_OS,
        find="p = torch.exp(scores - ref[..., None])",
        replace="p = torch.exp(scores - _finite_or_zero(scores.amax(dim=-1))[..., None])",
    ),
    PlantedBug(
        name="finalize-divides-by-a-zero-sum",
        description="finalize divides by exp_sum without a guard: a row that saw no key gives "
        "0 / 0 = NaN instead of 0",
        file=_OS,
        find="    denom = torch.where(state.exp_sum > 0, state.exp_sum, "
        "torch.ones_like(state.exp_sum))",
        replace="    denom = state.exp_sum",
    ),
    PlantedBug(
        name="reduce-uses-one-maximum-for-all-rows",
        description="the reduce takes the maximum over every partial of every row (amax without "
        "dim): the weights come out right but the returned max_logit and exp_sum do not belong "
        "to any row",
        file=_OS,
        find="global_max = max_logit.amax(dim=-1)",
        replace="global_max = max_logit.amax()",
    ),
    PlantedBug(
        name="blockwise-holds-all-scores",
        description="blockwise_attention computes every score before the first block and then "
        "slices it: the right numbers, but the memory of ref_attention, which the online softmax "
        "exists to avoid",
        file=_OS,
        find="    for start, end in blocks:\n"
        "        scores, values = _block_scores("
        "query, key, value, start, end, scale, alibi_slopes, causal)\n"
        "        state = online_update(state, scores, values)",
        replace="    every = _block_scores("
        "query, key, value, 0, key.shape[0], scale, alibi_slopes, causal)\n"
        "    for start, end in blocks:\n"
        "        state = online_update(state, every[0][..., start:end], every[1][:, start:end])",
    ),
]
