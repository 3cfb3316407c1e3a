// Lab 02-06, stretch (optional, not graded): a decode kernel for grouped-query attention.
//
// Your v2 gives one thread block to every *query* head, so with 8 query heads per KV head each
// K/V block is fetched 8 times. Here one thread block serves all the query heads of a KV head
// (up to kMaxGroup of them; a larger group is split into chunks of kMaxGroup, one thread block
// each): every key or value vector, once loaded into registers, is used for every head of the
// chunk. Same inputs and outputs as v2, merged by the same reduce (the reference's
// partition_reduce.cuh, which you wrote as task 4). fp16 and bf16 only: fp32 goes to v2.
//
// You write the two loops that read the cache (stretch tasks 1 and 2); the setup, the softmax
// between them and the launcher are given. Mark each done in STRETCH_TASK_N_DONE. The tests:
//     LAB_IMPL=starter pytest phase-02-paged-attention/labs/lab-06-cuda-kernel/test_stretch.py
// The README's "Stretch: a GQA-aware kernel" says what to aim for; after it, read the reference
// (mini_vllm/csrc/paged_attention_gqa.cu): its launch bound, and its tensor-core kernel.
#include "common.cuh"
#include "dispatch.cuh"
#include "partition_reduce.cuh"

#define STRETCH_TASK_1_DONE 0  // gqa_logits
#define STRETCH_TASK_2_DONE 0  // gqa_values

namespace mini_vllm {

constexpr int kGqaThreads = 128;  // 4 warps
constexpr int kMaxGroup = 8;      // query heads computed by one thread block

// What one thread block works on: query heads [head0, head0 + num_q) of KV head kv_head, over
// the KV blocks [first_block, end_block) of sequence seq (partition part).
struct GqaWork {
  int kv_head;
  int head0;
  int num_q;        // query heads of this chunk, at most kMaxGroup
  int seq;
  int part;
  int seq_len;
  int first_block;
  int end_block;
  int start_token;  // first_block * BLOCK_SIZE: logits[g][i] is token start_token + i
  int num_tokens;   // tokens of the range that exist
  const int* block_table;
};

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

// Given: one thread block per (chunk of query heads of a KV head, sequence, partition).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_gqa_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  GqaWork w;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
  w.kv_head = blockIdx.x / chunks_per_kv_head;
  w.head0 = w.kv_head * group_size + (blockIdx.x % chunks_per_kv_head) * kMaxGroup;
  w.num_q = min(kMaxGroup, (w.kv_head + 1) * group_size - w.head0);
  w.seq = blockIdx.y;
  w.part = blockIdx.z;
  w.seq_len = clamped_seq_len(p, w.seq);
  const int blocks_per_partition = partition_size_of(p) / BLOCK_SIZE;
  w.first_block = w.part * blocks_per_partition;
  if (w.first_block * BLOCK_SIZE >= w.seq_len) return;
  w.end_block = min(w.first_block + blocks_per_partition, div_round_up(w.seq_len, BLOCK_SIZE));
  w.start_token = w.first_block * BLOCK_SIZE;
  w.num_tokens = min(w.end_block * BLOCK_SIZE, w.seq_len) - w.start_token;
  w.block_table = p.block_tables + static_cast<int64_t>(w.seq) * p.max_num_blocks_per_seq;

  MINI_VLLM_SHARED(float, q_smem, [kMaxGroup][HEAD_SIZE]);
  // float4 storage, so that a 16-byte aligned run of probabilities can be read in one load.
  MINI_VLLM_SHARED(float4, logits_storage, [kMaxGroup][kPartitionSize / 4]);
  auto* logits = reinterpret_cast<float(*)[kPartitionSize]>(&logits_storage[0][0]);
  MINI_VLLM_SHARED(float, red_max, [kMaxGroup][NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [kMaxGroup][NUM_WARPS]);

  // The chunk's queries, scaled once (rows past num_q are zero and never used).
  const T* query = static_cast<const T*>(p.query);
  for (int i = tid; i < kMaxGroup * HEAD_SIZE; i += NUM_THREADS) {
    const int g = i / HEAD_SIZE;
    const int d = i % HEAD_SIZE;
    q_smem[g][d] = g < w.num_q ? to_float(query[w.seq * p.q_stride +
                                                static_cast<int64_t>(w.head0 + g) * HEAD_SIZE +
                                                d]) * p.scale
                               : 0.f;
  }
  float slope[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    slope[g] = (p.alibi_slopes != nullptr && g < w.num_q) ? p.alibi_slopes[w.head0 + g] : 0.f;
  }
  __syncthreads();

  float my_max[kMaxGroup];
  gqa_logits<T, T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, q_smem, slope, logits, my_max);

  // One max per head; each head has its own scratch row, so one barrier serves them all.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    const float m = warp_max(my_max[g]);
    if (lane == 0) red_max[g][warp] = m;
  }
  __syncthreads();
  float max_logit[kMaxGroup];
  float exp_sum[kMaxGroup];
  float inv_sum[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    max_logit[g] = red_max[g][0];
#pragma unroll
    for (int i = 1; i < NUM_WARPS; ++i) max_logit[g] = fmaxf(max_logit[g], red_max[g][i]);
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    float s = 0.f;
    if (g < w.num_q) {
      for (int i = tid; i < w.num_tokens; i += NUM_THREADS) {
        const float e = expf(logits[g][i] - max_logit[g]);
        logits[g][i] = e;
        s += e;
      }
    }
    s = group_sum<kWarpSize>(s);
    if (lane == 0) red_sum[g][warp] = s;
  }
  __syncthreads();  // publishes the sums and the exponentials
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    exp_sum[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NUM_WARPS; ++i) exp_sum[g] += red_sum[g][i];
    inv_sum[g] = exp_sum[g] > 0.f ? 1.f / exp_sum[g] : 0.f;
  }

  gqa_values<T, T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, logits, inv_sum);

  if (tid == 0) {
    const int64_t out_row0 = static_cast<int64_t>(w.seq) * p.num_heads + w.head0;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < w.num_q) {
        const int64_t idx = (out_row0 + g) * p.max_num_partitions + w.part;
        p.max_logits[idx] = max_logit[g];
        p.exp_sums[idx] = exp_sum[g];
      }
    }
  }
}

// ---- launcher (given) -------------------------------------------------------------------------

inline const char* stretch_todo() {
  if (!STRETCH_TASK_1_DONE)
    return "lab 02-06, stretch task 1: write gqa_logits in stretch_gqa.cu, then set STRETCH_TASK_1_DONE to 1 (README: Stretch)";
  if (!STRETCH_TASK_2_DONE)
    return "lab 02-06, stretch task 2: write gqa_values in stretch_gqa.cu, then set STRETCH_TASK_2_DONE to 1 (README: Stretch)";
  return nullptr;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_kv_heads * div_round_up(group_size, kMaxGroup), p.num_seqs,
                  div_round_up(p.max_seq_len, partition_size_of(p)));
  const auto kernel = paged_attention_gqa_kernel<T, HEAD_SIZE, BLOCK_SIZE, kGqaThreads>;
  MINI_VLLM_LAUNCH(kernel, grid, kGqaThreads, 0, stream)(p);
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  return launch_partition_reduce<T, HEAD_SIZE, kGqaThreads>(p, stream);
}

Status launch_paged_attention_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  if (const char* todo = stretch_todo()) return not_implemented(todo);
  const Status cache = refuse_fp8_cache(
      p.kv_cache_dtype, "the stretch kernel reads a KV cache in the model's dtype only");
  if (cache.code != StatusCode::kOk) return cache;
  const int size = partition_size_of(p);
  if (size < kMinPartitionSize || size > kPartitionSize || (size & (size - 1)) != 0 ||
      div_round_up(p.max_seq_len, size) > p.max_num_partitions) {
    return unsupported("partition_size must be a power of two from 64 to 512, within the "
                       "partition buffers");
  }
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    using T = typename decltype(t)::type;
    if constexpr (std::is_same_v<T, float>) {
      return unsupported("the stretch kernel is for fp16 and bf16; fp32 decode runs v2");
    } else {
      return launch_gqa<T, decltype(h)::value, decltype(b)::value>(p, stream);
    }
  });
}

}  // namespace mini_vllm
