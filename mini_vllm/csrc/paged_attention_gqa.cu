// A decode kernel for grouped-query attention that reads each K/V block once per KV head.
//
// Upstream's grid has one thread block per *query* head, so with G query heads per KV head every
// K/V block is fetched G times (from L2 at best). Here one thread block handles one (KV head,
// sequence, partition) and computes all the query heads of the group together: each key or value
// vector, once in registers, is used for up to kMaxGroup query heads. Larger groups are split
// into chunks of kMaxGroup heads (one thread block each). Inputs and outputs are those of v2:
// the same partition buffers, merged by the same reduce kernel. fp32 inputs are handed to v2
// (see launch_paged_attention_gqa).
//
// Keys: as in attention_core.cuh, a warp takes one KV block and a thread group one token.
// Values: every warp walks all blocks of the partition but owns a quarter of the head's rows,
// so no cross-warp reduction is needed and each value byte is still read once.
#include "common.cuh"
#include "dispatch.cuh"
#include "partition_reduce.cuh"

namespace mini_vllm {

constexpr int kGqaThreads = 128;
constexpr int kMaxGroup = 8;  // query heads computed by one thread block
// Thread blocks that must fit on one SM at once: with 4, ptxas keeps the kernel within
// 65536 / (4 * 128) = 128 registers per thread. Without it ptxas takes 148 on sm_90 (fp16, d128,
// block 16), 3 blocks per SM, and the default shape's 512 blocks need 1.29 waves of 396 slots.
// scripts/gqa_sass_report.py shows registers, spills and occupancy per instantiation.
// Head size 256 with blocks of 16 or 32 tokens keeps more values in flight per lane (its value
// loop holds 32 or 64 of them); it gets up to 255 registers (2 blocks per SM) so that nothing
// spills (with 3, ptxas spills at block size 16).
template <int HEAD_SIZE, int BLOCK_SIZE>
constexpr int gqa_min_blocks_per_sm() {
  return HEAD_SIZE < 256 || BLOCK_SIZE == 8 ? 4 : 2;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, (gqa_min_blocks_per_sm<HEAD_SIZE, BLOCK_SIZE>()))
    paged_attention_gqa_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(T));
  constexpr int GROUP = const_max(kWarpSize / BLOCK_SIZE, 1);  // lanes per token (keys)
  constexpr int VEC = X / GROUP;
  constexpr int CHUNKS = HEAD_SIZE / X;
  static_assert(BLOCK_SIZE <= kWarpSize && kWarpSize % BLOCK_SIZE == 0, "block size divides 32");
  static_assert(VEC >= 1 && GROUP * VEC == X, "a thread group must load exactly one chunk");
  static_assert(HEAD_SIZE % X == 0, "head size must be a whole number of 16-byte chunks");
  static_assert(kMinPartitionSize % BLOCK_SIZE == 0, "partitions must hold whole blocks");

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  // Which KV head, and which chunk of its query heads, this thread block computes.
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
  const int kv_head = blockIdx.x / chunks_per_kv_head;
  const int head0 = kv_head * group_size + (blockIdx.x % chunks_per_kv_head) * kMaxGroup;
  const int num_q = min(kMaxGroup, (kv_head + 1) * group_size - head0);  // heads in this chunk
  const int seq = blockIdx.y;
  const int part = blockIdx.z;

  const int seq_len = clamped_seq_len(p, seq);
  const int blocks_per_partition = partition_size_of(p) / BLOCK_SIZE;  // checked by the launcher
  const int first_block = part * blocks_per_partition;
  if (first_block * BLOCK_SIZE >= seq_len) return;
  const int end_block = min(first_block + blocks_per_partition, div_round_up(seq_len, BLOCK_SIZE));
  const int start_token = first_block * BLOCK_SIZE;
  const int num_tokens = min(end_block * BLOCK_SIZE, seq_len) - start_token;

  const T* query = static_cast<const T*>(p.query);
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int* block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;

  MINI_VLLM_SHARED(float, q_smem, [kMaxGroup][HEAD_SIZE]);
  // float4 storage: the value loop reads probabilities in 16-byte loads.
  MINI_VLLM_SHARED(float4, logits_storage, [kMaxGroup][kPartitionSize / 4]);
  auto* logits = reinterpret_cast<float(*)[kPartitionSize]>(&logits_storage[0][0]);
  MINI_VLLM_SHARED(float, red_max, [kMaxGroup][NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [kMaxGroup][NUM_WARPS]);

  // Queries of the chunk (rows past num_q are zero and never used), scaled once.
  for (int i = tid; i < kMaxGroup * HEAD_SIZE; i += NUM_THREADS) {
    const int g = i / HEAD_SIZE;
    const int d = i % HEAD_SIZE;
    q_smem[g][d] = g < num_q ? to_float(query[seq * p.q_stride +
                                              static_cast<int64_t>(head0 + g) * HEAD_SIZE + d]) *
                                   p.scale
                             : 0.f;
  }
  float slope[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    slope[g] = (p.alibi_slopes != nullptr && g < num_q) ? p.alibi_slopes[head0 + g] : 0.f;
  }
  __syncthreads();

  // ---- logits: each key chunk is loaded once and used for every query head of the chunk ----
  const int token_in_block = lane / GROUP;
  const int lane_in_group = lane % GROUP;
  float my_max[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) my_max[g] = -FLT_MAX;

  for (int block = first_block + warp; block < end_block; block += NUM_WARPS) {
    const int64_t physical = block_table[block];
    const T* k = key_cache + physical * p.kv_block_stride + kv_head * p.kv_head_stride +
                 token_in_block * X + lane_in_group * VEC;
    float dot[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float kv[VEC];
      load_as_float<T, VEC>(k + c * BLOCK_SIZE * X, kv);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < num_q) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] += q_smem[g][c * X + lane_in_group * VEC + e] * kv[e];
        }
      }
    }
    const int token = block * BLOCK_SIZE + token_in_block;
    const bool valid = token < seq_len;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < num_q) {  // num_q is the same for the whole block: no divergence around shuffles
        const float logit =
            group_sum<GROUP>(dot[g]) + slope[g] * static_cast<float>(token - (seq_len - 1));
        if (lane_in_group == 0) {
          logits[g][token - start_token] = valid ? logit : 0.f;
          if (valid) my_max[g] = fmaxf(my_max[g], logit);
        }
      }
    }
  }

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
    for (int w = 1; w < NUM_WARPS; ++w) max_logit[g] = fmaxf(max_logit[g], red_max[g][w]);
  }

  // ---- softmax numerators and sums ------------------------------------------------------------
  float exp_sum[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    float s = 0.f;
    if (g < num_q) {
      for (int i = tid; i < num_tokens; i += NUM_THREADS) {
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
    for (int w = 0; w < NUM_WARPS; ++w) exp_sum[g] += red_sum[g][w];
    inv_sum[g] = exp_sum[g] > 0.f ? 1.f / exp_sum[g] : 0.f;
  }

  // ---- values: warp w owns rows [w * ROWS_PER_WARP, (w + 1) * ROWS_PER_WARP) of the head ----
  constexpr int V_VEC = const_min(X, BLOCK_SIZE);
  constexpr int LANES_PER_ROW = BLOCK_SIZE / V_VEC;
  constexpr int ROWS_PER_PASS = kWarpSize / LANES_PER_ROW;
  constexpr int ROWS_PER_WARP = div_round_up(HEAD_SIZE, NUM_WARPS);
  constexpr int PASSES = div_round_up(ROWS_PER_WARP, ROWS_PER_PASS);
  const int v_token = (lane % LANES_PER_ROW) * V_VEC;
  const int first_row = warp * ROWS_PER_WARP;

  float acc[kMaxGroup][PASSES];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int r = 0; r < PASSES; ++r) acc[g][r] = 0.f;
  }

  // Slots past the end of the sequence hold probability 0: the logits loop stored 0 in every
  // slot of the range's blocks past seq_len, and the softmax exponentiated only the first
  // num_tokens slots. So the loop multiplies probabilities without a per-token test. Only the
  // values need care, and only in the sequence's last block when it is partial: its unused slots
  // may hold anything, NaN included (and NaN * 0 is NaN), so they are zeroed there.
  const int full_end = min(end_block, seq_len / BLOCK_SIZE);  // [first_block, full_end): full
  for (int block = first_block; block < end_block; ++block) {
    const int64_t physical = block_table[block];
    const T* v = value_cache + physical * p.kv_block_stride + kv_head * p.kv_head_stride;
    float vals[PASSES][V_VEC];
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
      const int local_row = lane / LANES_PER_ROW + r * ROWS_PER_PASS;
      const int row = first_row + local_row;
      if (local_row < ROWS_PER_WARP && row < HEAD_SIZE) {
        load_as_float<T, V_VEC>(v + row * BLOCK_SIZE + v_token, vals[r]);
      } else {
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) vals[r][e] = 0.f;
      }
    }
    const int token0 = block * BLOCK_SIZE + v_token;
    if (block >= full_end) {  // the partial last block (the same branch for the whole warp)
#pragma unroll
      for (int r = 0; r < PASSES; ++r) {
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) vals[r][e] = token0 + e < seq_len ? vals[r][e] : 0.f;
      }
    }
    const int slot0 = token0 - start_token;  // a multiple of V_VEC: 16-byte aligned
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < num_q) {
        float prob[V_VEC];
        load_floats<V_VEC>(&logits[g][slot0], prob);
#pragma unroll
        for (int r = 0; r < PASSES; ++r) {
#pragma unroll
          for (int e = 0; e < V_VEC; ++e) acc[g][r] += prob[e] * vals[r][e];
        }
      }
    }
  }

  // Lanes sharing a row hold sums over different token slices of it: add them, then write.
  const int64_t out_row0 = static_cast<int64_t>(seq) * p.num_heads + head0;
  T* tmp_out = static_cast<T*>(p.tmp_out);
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g < num_q) {
      const int64_t row_base = ((out_row0 + g) * p.max_num_partitions + part) * HEAD_SIZE;
#pragma unroll
      for (int r = 0; r < PASSES; ++r) {
        const float total = group_sum<LANES_PER_ROW>(acc[g][r]);
        const int local_row = lane / LANES_PER_ROW + r * ROWS_PER_PASS;
        const int row = first_row + local_row;
        if (lane % LANES_PER_ROW == 0 && local_row < ROWS_PER_WARP && row < HEAD_SIZE) {
          tmp_out[row_base + row] = from_float<T>(total * inv_sum[g]);
        }
      }
      if (tid == 0) {
        const int64_t idx = (out_row0 + g) * p.max_num_partitions + part;
        p.max_logits[idx] = max_logit[g];
        p.exp_sums[idx] = exp_sum[g];
      }
    }
  }
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

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
  const int parts_needed = div_round_up(p.max_seq_len, partition_size_of(p));
  const dim3 grid(p.num_kv_heads * chunks_per_kv_head, p.num_seqs, parts_needed);
  const auto kernel = paged_attention_gqa_kernel<T, HEAD_SIZE, BLOCK_SIZE, kGqaThreads>;
  MINI_VLLM_LAUNCH(kernel, grid, kGqaThreads, 0, stream)(p);
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  return launch_partition_reduce<T, HEAD_SIZE, kGqaThreads>(p, stream);
}

// fp32 goes to v2 (same inputs, same result): with 4-byte elements the per-head register
// arrays of this kernel no longer fit (ptxas spills kilobytes at block size 32), and fp32 decode
// is not what this kernel is for. Not instantiating it also keeps the build shorter.
Status launch_paged_attention_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0) return ok();
  const Status partitions = check_gqa_partitions(p);
  if (partitions.code != StatusCode::kOk) return partitions;
  return dispatch_attention(p.dtype, p.head_size, p.block_size,
                            [&](auto type_tag, auto head_tag, auto block_tag) {
                              using T = typename decltype(type_tag)::type;
                              if constexpr (std::is_same_v<T, float>) {
                                PagedAttentionParams v2 = p;
                                v2.partition_size = 0;  // v2's partitions are always 512 tokens
                                return launch_paged_attention_v2(v2, stream);
                              } else {
                                return launch_gqa<T, decltype(head_tag)::value,
                                                  decltype(block_tag)::value>(p, stream);
                              }
                            });
}

}  // namespace mini_vllm
