// The GQA-aware scalar kernel and its launcher, around its two steps gqa_logits and gqa_values:
// a file that includes this header defines them first (the reference in paged_attention_gqa.cu,
// the student in lab 02-06's stretch_gqa.cu), so that both run this same skeleton.
#pragma once

#include "common.cuh"
#include "gqa_common.cuh"
#include "partition_reduce.cuh"

namespace mini_vllm {

// The scalar kernel: steps 1 (gqa_logits) and 3 (gqa_values), with the softmax between them,
// for one (chunk of query heads of a KV head, sequence, partition).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, (gqa_min_blocks_per_sm<HEAD_SIZE, BLOCK_SIZE>()))
    paged_attention_gqa_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));  // 16 for an fp8 cache
  constexpr int GROUP = const_max(kWarpSize / BLOCK_SIZE, 1);  // lanes per token (keys)
  static_assert(BLOCK_SIZE <= kWarpSize && kWarpSize % BLOCK_SIZE == 0, "block size divides 32");
  static_assert(X / GROUP >= 1 && GROUP * (X / GROUP) == X, "a thread group loads one chunk");
  static_assert(HEAD_SIZE % X == 0, "head size must be a whole number of 16-byte chunks");
  static_assert(kMinPartitionSize % BLOCK_SIZE == 0, "partitions must hold whole blocks");

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  // Which KV head, and which chunk of its query heads, this thread block computes.
  GqaWork w;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
  w.kv_head = blockIdx.x / chunks_per_kv_head;
  w.head0 = w.kv_head * group_size + (blockIdx.x % chunks_per_kv_head) * kMaxGroup;
  w.num_q = min(kMaxGroup, (w.kv_head + 1) * group_size - w.head0);  // heads in this chunk
  w.seq = blockIdx.y;
  w.part = blockIdx.z;
  w.seq_len = clamped_seq_len(p, w.seq);
  const int blocks_per_partition = partition_size_of(p) / BLOCK_SIZE;  // checked by the launcher
  w.first_block = w.part * blocks_per_partition;
  if (w.first_block * BLOCK_SIZE >= w.seq_len) return;
  w.end_block = min(w.first_block + blocks_per_partition, div_round_up(w.seq_len, BLOCK_SIZE));
  w.start_token = w.first_block * BLOCK_SIZE;
  w.num_tokens = min(w.end_block * BLOCK_SIZE, w.seq_len) - w.start_token;
  w.block_table = p.block_tables + static_cast<int64_t>(w.seq) * p.max_num_blocks_per_seq;

  MINI_VLLM_SHARED(float, q_smem, [kMaxGroup][HEAD_SIZE]);
  // float4 storage: the value loop reads probabilities in 16-byte loads.
  MINI_VLLM_SHARED(float4, logits_storage, [kMaxGroup][kPartitionSize / 4]);
  auto* logits = reinterpret_cast<float(*)[kPartitionSize]>(&logits_storage[0][0]);
  MINI_VLLM_SHARED(float, red_max, [kMaxGroup][NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [kMaxGroup][NUM_WARPS]);

  // Queries of the chunk (rows past num_q are zero and never used), scaled once.
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
  gqa_logits<T, CacheT, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, q_smem, slope, logits, my_max);

  // One max per query head. Each head has its own scratch row, so one barrier serves them all.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    const float m = warp_max(my_max[g]);
    if (lane == 0) red_max[g][warp] = m;
  }
  __syncthreads();
  float max_logit[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    max_logit[g] = red_max[g][0];
#pragma unroll
    for (int i = 1; i < NUM_WARPS; ++i) max_logit[g] = fmaxf(max_logit[g], red_max[g][i]);
  }

  // Softmax numerators and sums.
  float exp_sum[kMaxGroup];
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
  float inv_sum[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    exp_sum[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NUM_WARPS; ++i) exp_sum[g] += red_sum[g][i];
    inv_sum[g] = exp_sum[g] > 0.f ? 1.f / exp_sum[g] : 0.f;
  }

  gqa_values<T, CacheT, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, logits, inv_sum);

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

template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
  const int parts_needed = div_round_up(p.max_seq_len, partition_size_of(p));
  const dim3 grid(p.num_kv_heads * chunks_per_kv_head, p.num_seqs, parts_needed);
  const auto kernel = paged_attention_gqa_kernel<T, CacheT, HEAD_SIZE, BLOCK_SIZE, kGqaThreads>;
  MINI_VLLM_LAUNCH(kernel, grid, kGqaThreads, 0, stream)(p);
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  return launch_partition_reduce<T, HEAD_SIZE, kGqaThreads>(p, stream);
}

// The partition size must be a power of two in [kMinPartitionSize, kPartitionSize], and the
// partition buffers wide enough for it.
inline Status check_gqa_partitions(const PagedAttentionParams& p) {
  const int size = partition_size_of(p);
  if (size < kMinPartitionSize || size > kPartitionSize || (size & (size - 1)) != 0) {
    return unsupported("partition_size must be a power of two from 64 to 512");
  }
  if (div_round_up(p.max_seq_len, size) > p.max_num_partitions) {
    return unsupported("the partition buffers are too narrow for this partition_size");
  }
  return ok();
}

}  // namespace mini_vllm
