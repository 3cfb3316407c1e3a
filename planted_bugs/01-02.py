"""Known-wrong edits of the lab 01-02 reference that the tests must reject."""

from __future__ import annotations

from course.bugs import PlantedBug

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
]
