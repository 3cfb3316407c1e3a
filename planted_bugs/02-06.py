"""Known-wrong edits to the reference that lab 02-06's tests must reject.

Most of them change what a kernel computes, so only a GPU run can reject them (requires="cuda").
The last two are rejected everywhere: one leaves a kernel without its output store (the nvcc
test sees a kernel that writes nothing), one lets v2 accept partition buffers too small for
max_seq_len (the input-check test), which on a GPU would be an out-of-bounds write.
"""

from course.bugs import PlantedBug

CORE = "mini_vllm/csrc/attention_core.cuh"

BUGS = [
    PlantedBug(
        name="alibi-sign-flipped",
        description="the ALiBi bias uses (seq_len - 1 - t), rewarding distant tokens instead of "
        "penalising them",
        file=CORE,
        find="w.alibi_slope * static_cast<float>(token - (w.seq_len - 1))",
        replace="w.alibi_slope * static_cast<float>((w.seq_len - 1) - token)",
        requires="cuda",
    ),
    PlantedBug(
        name="softmax-over-padding",
        description="the softmax counts every slot of the last block, so the padding slots' "
        "zero logits add exp(-max) to the sum",
        file=CORE,
        find="w.num_tokens = min(end_block * BLOCK_SIZE, seq_len) - w.start_token;",
        replace="w.num_tokens = (end_block - first_block) * BLOCK_SIZE;",
        requires="cuda",
    ),
    PlantedBug(
        name="values-past-the-end-multiplied",
        description="values past the end of the sequence are multiplied by probability 0 "
        "instead of skipped, so a NaN left in an unused slot poisons the output",
        file=CORE,
        find="if (valid[e]) acc[r] += prob[e] * vals[e];",
        replace="acc[r] += prob[e] * vals[e];",
        requires="cuda",
    ),
    PlantedBug(
        name="gqa-kv-head-modulo",
        description="query head h reads KV head h % num_kv_heads instead of h / group_size "
        "(the same for MHA, wrong for grouped-query attention)",
        file=CORE,
        find="w.kv_head = head / (p.num_heads / p.num_kv_heads);",
        replace="w.kv_head = head % p.num_kv_heads;",
        requires="cuda",
    ),
    PlantedBug(
        name="reduce-without-rescaling",
        description="the v2 merge weighs each partition by its exp sum without rescaling it "
        "to the global max",
        file="mini_vllm/csrc/partition_reduce.cuh",
        find="const float w = exp_sums[i] * expf(max_logits[i] - global_max);",
        replace="const float w = exp_sums[i];",
        requires="cuda",
    ),
    PlantedBug(
        name="gqa-kernel-rows-not-split",
        description="in the GQA-aware kernel every warp accumulates the first quarter of the "
        "head's rows; the rest of each output row is never written",
        file="mini_vllm/csrc/paged_attention_gqa.cu",
        find="const int first_row = warp * ROWS_PER_WARP;",
        replace="const int first_row = 0;",
        requires="cuda",
    ),
    PlantedBug(
        name="key-cache-without-x-interleave",
        description="reshape_and_cache writes each key contiguously per token ([block, token, "
        "head_size]) instead of interleaving its 16-byte chunks across the block's tokens",
        file="mini_vllm/csrc/cache_kernels.cu",
        find="(static_cast<int64_t>(d / X) * p.block_size + offset) * X + d % X",
        replace="static_cast<int64_t>(offset) * p.head_size + d",
        requires="cuda",
    ),
    PlantedBug(
        name="reduce-never-stores-output",
        description="the v2 merge computes each output element but never stores it",
        file="mini_vllm/csrc/partition_reduce.cuh",
        find="out[d] = from_float<T>(acc * inv_total);",
        replace="(void)acc;",
    ),
    PlantedBug(
        name="small-partition-buffers-accepted",
        description="v2 accepts exp_sums / max_logits / tmp_out with fewer partitions than "
        "max_seq_len needs, and its kernels would write past them",
        file="mini_vllm/csrc/ops.py",
        find="if t.dtype != dtype or tuple(t.shape) != shape or width < parts or",
        replace="if t.dtype != dtype or tuple(t.shape) != shape or",
    ),
]
