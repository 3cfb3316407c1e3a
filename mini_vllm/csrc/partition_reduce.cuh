// Phase 2 of the partitioned kernels (v2 and the GQA-aware kernel): merge per-partition results.
//
// Partition p of a sequence produced m_p (its max logit), s_p (sum of exp(logit - m_p)) and o_p
// (its own softmax-weighted values, already divided by s_p). With M = max_p m_p, the partition's
// share of the global softmax mass is w_p = s_p * exp(m_p - M), and
//     out = sum_p w_p * o_p / sum_p w_p.
// One thread block per (query head, sequence); grid (num_heads, num_seqs).
//
// upstream: csrc/attention/attention_kernels.cuh:562 @ v0.11.0
#pragma once

#include "common.cuh"

namespace mini_vllm {

template <typename T, int HEAD_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    partition_reduce_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int tid = threadIdx.x;
  // Only the partitions that hold tokens were written by phase 1; the rest are never read.
  const int num_parts = div_round_up(clamped_seq_len(p, seq), partition_size_of(p));

  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* max_logits = p.max_logits + row * p.max_num_partitions;
  const float* exp_sums = p.exp_sums + row * p.max_num_partitions;
  const T* tmp_out = static_cast<const T*>(p.tmp_out) + row * p.max_num_partitions * HEAD_SIZE;
  T* out = static_cast<T*>(p.out) + row * HEAD_SIZE;

  MINI_VLLM_DYNAMIC_SHARED(float, weights);  // [num_parts]
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);

  float my_max = -FLT_MAX;
  for (int i = tid; i < num_parts; i += NUM_THREADS) my_max = fmaxf(my_max, max_logits[i]);
  const float global_max = block_max<NUM_WARPS>(my_max, red_max);

  float my_total = 0.f;
  for (int i = tid; i < num_parts; i += NUM_THREADS) {
    const float w = exp_sums[i] * expf(max_logits[i] - global_max);
    weights[i] = w;
    my_total += w;
  }
  const float total = block_sum<NUM_WARPS>(my_total, red_sum);  // also publishes `weights`
  const float inv_total = total > 0.f ? 1.f / total : 0.f;

  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
    float acc = 0.f;
    for (int i = 0; i < num_parts; ++i) acc += weights[i] * to_float(tmp_out[i * HEAD_SIZE + d]);
    out[d] = from_float<T>(acc * inv_total);
  }
}

// Launches the merge for every (head, sequence) of `p` after phase 1 has run on `stream`.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
Status launch_partition_reduce(const PagedAttentionParams& p, cudaStream_t stream) {
  const int parts_needed = div_round_up(p.max_seq_len, partition_size_of(p));
  const dim3 grid(p.num_heads, p.num_seqs);
  const size_t smem = float_smem_bytes(parts_needed);
  const auto kernel = partition_reduce_kernel<T, HEAD_SIZE, NUM_THREADS>;
  MINI_VLLM_LAUNCH(kernel, grid, NUM_THREADS, smem, stream)(p);
  return cuda_status(cudaGetLastError());
}

}  // namespace mini_vllm
