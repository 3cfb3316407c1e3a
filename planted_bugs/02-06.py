"""Known-wrong edits to the reference that lab 02-06's tests must reject.

Each names the tier of tests that must see it (`requires`, see course/integrity/bugs.py); all of
them are checked on a machine without a GPU, where the kernels run in the CPU emulation:

* oracle: the output differs from the PyTorch oracle, or the emulation reports misused
  collectives (a GPU run of the same tests sees the first kind too);
* asan: an access outside a buffer, or an integer overflow, that leaves the output right in these
  tests (a GPU would read whatever lies there, or fault only with a larger pool);
* race: a missing barrier that happens not to change the output in the emulation's thread order;
* nvcc: visible in the compiled code;
* none: an input check.

`given=True` marks an edit of code the lab gives (the reference-only GQA-aware kernel, the cache
kernels): the lab's tests of that code are `starter_ok`, not graded, and count for it.
"""

from course.integrity.bugs import PlantedBug

CORE = "mini_vllm/csrc/attention_core.cuh"
COMMON = "mini_vllm/csrc/common.cuh"
GQA = "mini_vllm/csrc/paged_attention_gqa.cu"
NAIVE = "mini_vllm/csrc/paged_attention_naive.cu"

BUGS = [
    # Task 0, the naive kernel: the classic first-kernel mistakes.
    PlantedBug(
        name="naive-key-read-as-a-plain-row",
        description="the naive kernel reads key element d at offset d, as if keys were stored "
        "[head_size] per token, ignoring the x-split layout [head_size / x, block_size, x]",
        file=NAIVE,
        find="to_float(key[(d / X) * BLOCK_SIZE * X + d % X])",
        replace="to_float(key[d])",
        requires="oracle",
    ),
    PlantedBug(
        name="naive-softmax-with-each-threads-own-max",
        description="each thread subtracts the max of its own logits instead of the block's, "
        "so the exponentials of different threads are on different scales",
        file=NAIVE,
        find="const float e = expf(logits[t] - max_logit);",
        replace="const float e = expf(logits[t] - my_max);",
        requires="oracle",
    ),
    PlantedBug(
        name="naive-values-of-the-whole-last-block",
        description="the value loop reads every slot of the last block, so the unused slots "
        "(NaN in the tests) and logits past the sequence reach the output",
        file=NAIVE,
        find="const int tokens = min(BLOCK_SIZE, seq_len - start);",
        replace="const int tokens = BLOCK_SIZE;",
        requires="oracle",
    ),
    PlantedBug(
        name="naive-max-over-the-whole-logits-array",
        description="the naive kernel takes its max in a second pass over its slots of the "
        "whole logits array (max_seq_len entries) instead of its sequence's tokens: a shorter "
        "sequence's unwritten entries join the max (NaN in the emulation, which fmaxf drops; "
        "whatever lies there on a GPU)",
        file=NAIVE,
        find="    logits[t] = logit;\n    my_max = fmaxf(my_max, logit);\n  }\n",
        replace="    logits[t] = logit;\n  }\n"
        "  for (int t = threadIdx.x; t < p.max_seq_len; t += NUM_THREADS) {\n"
        "    my_max = fmaxf(my_max, logits[t]);\n  }\n",
        requires="oracle",
    ),
    PlantedBug(
        name="alibi-sign-flipped",
        description="the ALiBi bias uses (seq_len - 1 - t), rewarding distant tokens instead of "
        "penalising them",
        file=CORE,
        find="w.alibi_slope * static_cast<float>(token - (w.seq_len - 1))",
        replace="w.alibi_slope * static_cast<float>((w.seq_len - 1) - token)",
        requires="oracle",
    ),
    PlantedBug(
        name="softmax-over-padding",
        description="the softmax counts every slot of the last block, so the padding slots' "
        "zero logits add exp(-max) to the sum",
        file=CORE,
        find="w.num_tokens = min(end_block * BLOCK_SIZE, seq_len) - w.start_token;",
        replace="w.num_tokens = (end_block - first_block) * BLOCK_SIZE;",
        requires="oracle",
    ),
    PlantedBug(
        name="values-past-the-end-multiplied",
        description="values past the end of the sequence are multiplied by probability 0 "
        "instead of skipped, so a NaN left in an unused slot poisons the output",
        file=CORE,
        find="if (valid[e]) acc[r] += prob[e] * vals[e];",
        replace="acc[r] += prob[e] * vals[e];",
        requires="oracle",
    ),
    PlantedBug(
        name="softmax-without-subtracting-the-max",
        description="step 2 takes exp(logit) instead of exp(logit - max): the same probabilities "
        "for moderate logits, but exp overflows to inf near 600 and vanishes near -600 (task "
        "2's own test; v2's merge also goes wrong, its sums no longer match its maxes)",
        file=CORE,
        find="const float e = expf(logits[i] - max_logit);",
        replace="const float e = expf(logits[i]);",
        requires="oracle",
    ),
    PlantedBug(
        name="gqa-kv-head-modulo",
        description="query head h reads KV head h % num_kv_heads instead of h / group_size "
        "(the same for MHA, wrong for grouped-query attention)",
        file=CORE,
        find="w.kv_head = head / (p.num_heads / p.num_kv_heads);",
        replace="w.kv_head = head % p.num_kv_heads;",
        requires="oracle",
    ),
    PlantedBug(
        name="reduce-without-rescaling",
        description="the v2 merge weighs each partition by its exp sum without rescaling it "
        "to the global max",
        file="mini_vllm/csrc/partition_reduce.cuh",
        find="const float w = exp_sums[i] * expf(max_logits[i] - global_max);",
        replace="const float w = exp_sums[i];",
        requires="oracle",
    ),
    PlantedBug(
        name="gqa-kernel-rows-not-split",
        description="in the GQA-aware kernel every warp accumulates the first quarter of the "
        "head's rows; the rest of each output row is never written",
        file=GQA,
        find="const int first_row = warp * ROWS_PER_WARP;",
        replace="const int first_row = 0;",
        requires="oracle",
        given=True,
    ),
    PlantedBug(
        name="key-cache-without-x-interleave",
        description="reshape_and_cache writes each key contiguously per token ([block, token, "
        "head_size]) instead of interleaving its 16-byte chunks across the block's tokens",
        file="mini_vllm/csrc/cache_kernels.cu",
        find="(static_cast<int64_t>(d / X) * p.block_size + offset) * X + d % X",
        replace="static_cast<int64_t>(offset) * p.head_size + d",
        requires="oracle",
        given=True,
    ),
    PlantedBug(
        name="gqa-shuffle-skipped-past-the-end",
        description="the GQA-aware kernel skips the logit's shuffle for tokens past the end of "
        "the sequence, so in a partial last block some lanes of the warp shuffle and the others "
        "do not (undefined on a GPU: a hang or garbage)",
        file=GQA,
        find="      if (g < w.num_q) {  // num_q is the same for the whole block: no divergence "
        "around shuffles",
        replace="      if (g < w.num_q && valid) {",
        requires="oracle",
        given=True,
    ),
    PlantedBug(
        name="v2-last-partition-one-block-too-far",
        description="v2 computes the sequence's block count as seq_len / BLOCK_SIZE + 1, one too "
        "many when seq_len is a multiple of the block size: the last partition reads a block-"
        "table entry past the sequence's row (silently, unless it lies past the table)",
        file="mini_vllm/csrc/paged_attention_v2.cu",
        find="  const int end_block = min(first_block + BLOCKS_PER_PARTITION, "
        "div_round_up(seq_len, BLOCK_SIZE));",
        replace="  const int end_block = min(first_block + BLOCKS_PER_PARTITION, "
        "seq_len / BLOCK_SIZE + 1);",
        requires="asan",
    ),
    PlantedBug(
        name="key-offset-in-32-bits",
        description="the key's element offset in the cache is computed in int: it overflows "
        "once the block pool holds more than 2^31 elements",
        file=CORE,
        find="    const int64_t physical = w.block_table[block];\n"
        "    // Chunk c of this token's key starts at key_cache[physical, kv_head, c, "
        "token_in_block, 0].\n"
        "    const CacheT* k = key_cache + physical * p.kv_block_stride + w.kv_head * "
        "p.kv_head_stride +\n"
        "                      token_in_block * X + lane_in_group * VEC;",
        replace="    const int physical = w.block_table[block];\n"
        "    const int offset = physical * static_cast<int>(p.kv_block_stride) +\n"
        "                       w.kv_head * static_cast<int>(p.kv_head_stride) +\n"
        "                       token_in_block * X + lane_in_group * VEC;\n"
        "    const CacheT* k = key_cache + offset;",
        requires="asan",
    ),
    PlantedBug(
        name="no-barrier-before-reusing-shared-memory",
        description="accumulate_values reuses the probabilities' shared memory for the warps' "
        "partial rows without a barrier: a fast warp overwrites probabilities a slow warp may "
        "still read",
        file=CORE,
        find="  __syncthreads();  // every warp is done reading probs: reuse the buffer\n",
        replace="",
        requires="race",
    ),
    PlantedBug(
        name="softmax-one-scratch-for-both-reductions",
        description="task 2 passes red_max to block_sum as well: a fast warp writes its sum "
        "into the slot a slow warp still reads the max from (no barrier between the two "
        "reductions); the emulation's thread order happens to give the right result",
        file=CORE,
        find="  const float exp_sum = block_sum<NUM_WARPS>(my_sum, red_sum);",
        replace="  const float exp_sum = block_sum<NUM_WARPS>(my_sum, red_max);",
        requires="race",
    ),
    PlantedBug(
        name="reduce-never-stores-output",
        description="the v2 merge computes each output element but never stores it",
        file="mini_vllm/csrc/partition_reduce.cuh",
        find="out[d] = from_float<T>(acc * inv_total);",
        replace="(void)acc;",
        requires="nvcc",
    ),
    # The FP8 cache (issue 19): reference-only code (the lab's starter.cu reads model-dtype caches
    # only), rejected by the lab's starter_ok tests of the fp8 path.
    PlantedBug(
        name="fp8-scale-applied-on-write-not-on-read",
        description="reshape_and_cache stores x / scale, but the decode kernels read the fp8 "
        "bytes without multiplying them back by the scale",
        file=COMMON,
        find="    for (int i = 0; i < N; ++i) out[i] *= scale;",
        replace="    for (int i = 0; i < N; ++i) out[i] *= 1.f;",
        requires="oracle",
        given=True,
    ),
    PlantedBug(
        name="fp8-value-scale-used-for-keys",
        description="the keys of an fp8 cache are dequantized with v_scale instead of k_scale",
        file=CORE,
        find="load_cache_as_float<CacheT, VEC>(k + c * BLOCK_SIZE * X, p.k_scale, kv);",
        replace="load_cache_as_float<CacheT, VEC>(k + c * BLOCK_SIZE * X, p.v_scale, kv);",
        requires="oracle",
        given=True,
    ),
]
