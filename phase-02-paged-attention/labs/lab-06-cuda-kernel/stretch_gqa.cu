// Lab 02-06, stretch (optional, not graded): a decode kernel for grouped-query attention.
//
// Your v2 gives one thread block to every *query* head, so with 8 query heads per KV head each
// K/V block is fetched 8 times. Here one thread block serves all the query heads of a KV head
// (up to kMaxGroup of them; a larger group is split into chunks of kMaxGroup, one thread block
// each): every key or value vector, once loaded into registers, is used for every head of the
// chunk. Same inputs and outputs as v2, merged by the same reduce (the reference's
// partition_reduce.cuh, which you wrote as task 4). fp16 and bf16 only: fp32 goes to v2.
//
// You write the two loops that read the cache (stretch tasks 1 and 2). The kernel that calls
// them is given, in mini_vllm/csrc/gqa_scalar_kernel.cuh (included below your functions): the
// reference runs the same one. Read it first: it sets up GqaWork (gqa_common.cuh), stages the
// queries and does the softmax between your two steps. Mark each task done in
// STRETCH_TASK_N_DONE. The tests:
//     LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-06-cuda-kernel/test_stretch.py
// The README's "Stretch: a GQA-aware kernel" says what to aim for; after it, read the reference
// (mini_vllm/csrc/paged_attention_gqa.cu): its launch bound, and its tensor-core kernel.
#include "common.cuh"
#include "dispatch.cuh"
#include "gqa_common.cuh"  // kGqaThreads, kMaxGroup, GqaWork

#define STRETCH_TASK_1_DONE 0  // gqa_logits
#define STRETCH_TASK_2_DONE 0  // gqa_values

namespace mini_vllm {

// Stretch task 1. For every query head g < w.num_q and every token slot t of the blocks
// [w.first_block, w.end_block), store
//     logits[g][t - w.start_token] = q_smem[g] . k_t + slope[g] * (t - (w.seq_len - 1))
// (0 for slots t >= w.seq_len), and leave in my_max[g] the max of the valid logits this thread
// stored (-FLT_MAX if none), for every g < kMaxGroup. q_smem holds the chunk's queries, scaled.
// The point: load each key element once per thread block, in 16-byte vector loads, and use it for
// every head of the chunk. Keys are laid out as in task 1 (key_cache[block, kv_head, c, slot,
// 0..X)); task 1's split of a block's tokens among the lanes of a warp works here too. Keep the
// per-head sums in registers (arrays of kMaxGroup with loops over g that the compiler unrolls).
// No barrier inside: the kernel's reduction after it is the barrier.
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ __forceinline__ void gqa_logits(const PagedAttentionParams& p, const GqaWork& w,
                                           const float (*q_smem)[HEAD_SIZE], const float* slope,
                                           float (*logits)[kPartitionSize], float* my_max) {
  // TODO(stretch 1): the logits of every head of the chunk; then set STRETCH_TASK_1_DONE to 1.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) my_max[g] = -FLT_MAX;
}

// Stretch task 2. For every query head g < w.num_q and row d < HEAD_SIZE, write
//     tmp_out[((seq * num_heads + head0 + g) * p.max_num_partitions + part) * HEAD_SIZE + d]
//         = inv_sum[g] * sum_t probs[g][t - w.start_token] * v_t[d]
// over the tokens t < w.seq_len of the range, in T (p.tmp_out). Accumulate in fp32. Values are
// laid out as in task 3 (value_cache[block, kv_head, d, slot]). The point, again: load each value
// vector once and use it for every head. probs[g] holds 0 at every slot past the end of the
// sequence, but the values there may be NaN (and NaN * 0 is NaN). Hint: if each warp owns a
// quarter of the rows, the warps never need to add up their parts.
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ __forceinline__ void gqa_values(const PagedAttentionParams& p, const GqaWork& w,
                                           const float (*probs)[kPartitionSize],
                                           const float* inv_sum) {
  // TODO(stretch 2): the weighted values of every head; then set STRETCH_TASK_2_DONE to 1.
}

}  // namespace mini_vllm

// Given: paged_attention_gqa_kernel, which calls your two functions, launch_gqa and
// check_gqa_partitions.
#include "gqa_scalar_kernel.cuh"

namespace mini_vllm {

// ---- launcher (given) -------------------------------------------------------------------------

inline const char* stretch_todo() {
  if (!STRETCH_TASK_1_DONE)
    return "lab 02-06, stretch task 1: write gqa_logits in stretch_gqa.cu, then set STRETCH_TASK_1_DONE to 1 (README: Stretch)";
  if (!STRETCH_TASK_2_DONE)
    return "lab 02-06, stretch task 2: write gqa_values in stretch_gqa.cu, then set STRETCH_TASK_2_DONE to 1 (README: Stretch)";
  return nullptr;
}

Status launch_paged_attention_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  if (const char* todo = stretch_todo()) return not_implemented(todo);
  const Status cache = refuse_fp8_cache(
      p.kv_cache_dtype, "the stretch kernel reads a KV cache in the model's dtype only");
  if (cache.code != StatusCode::kOk) return cache;
  const Status partitions = check_gqa_partitions(p);
  if (partitions.code != StatusCode::kOk) return partitions;
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    using T = typename decltype(t)::type;
    if constexpr (std::is_same_v<T, float>) {
      return unsupported("the stretch kernel is for fp16 and bf16; fp32 decode runs v2");
    } else {
      return launch_gqa<T, T, decltype(h)::value, decltype(b)::value>(p, stream);
    }
  });
}

}  // namespace mini_vllm
