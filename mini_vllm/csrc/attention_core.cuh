// The body shared by paged attention v1 and v2: one thread block computes the attention of one
// query head of one sequence over a range of that sequence's KV blocks.
//
// Work decomposition (NUM_THREADS = 128, so 4 warps):
//   * a warp handles one KV block at a time; warp w takes blocks w, w + 4, w + 8, ...
//   * inside the warp, a *thread group* of GROUP = 32 / BLOCK_SIZE lanes handles one token of the
//     block, so the warp covers the whole block in one step;
//   * the lanes of a group split each key: of every 16-byte chunk of the key (the `x` dimension
//     of the cache) each lane loads VEC = x / GROUP elements, so a group reads one chunk with
//     GROUP adjacent loads and the warp reads BLOCK_SIZE * 16 contiguous bytes per chunk;
//   * the group adds its partial dot products with shuffles; its first lane stores the logit in
//     shared memory.
// Then the block finds the max logit and the sum of exponentials (two block reductions), and the
// warps walk the same blocks again for the values: a lane loads 16 bytes of one value row (V_VEC
// consecutive tokens), weighs them by those tokens' probabilities and accumulates per row; the
// lanes sharing a row, then the warps, add their partial sums.
//
// The three steps are separate functions (qk_logits, softmax_in_place, accumulate_values); the
// lab 02-06 starter.cu has the same skeleton with their bodies left to write.
//
// The cache's element type CacheT is the model's T, or __nv_fp8_e4m3 for an FP8 cache: then x is
// 16 elements per chunk, and every loaded key (value) element is widened to fp32 and multiplied
// by p.k_scale (p.v_scale) before any arithmetic, as upstream's scaled_convert does. CacheT is
// the last template argument (defaulting to T) so that the probes and the lab's starter.cu,
// which know only the model dtype, call the same steps unchanged.
// upstream: csrc/attention/attention_kernels.cuh:82 @ v0.11.0 (KV_DTYPE)
//
// upstream: csrc/attention/attention_kernels.cuh:85 @ v0.11.0
#pragma once

#include "common.cuh"

namespace mini_vllm {

// What one thread block works on, computed once by attend_blocks.
struct AttentionWork {
  int seq;
  int head;
  int kv_head;
  int seq_len;      // tokens in the sequence (clamped)
  int first_block;  // [first_block, end_block): the logical blocks of this thread block
  int end_block;
  int start_token;  // first_block * BLOCK_SIZE: logits[i] belongs to token start_token + i
  int num_tokens;   // tokens of the range that exist (the last block may be partial)
  const int* block_table;
  float alibi_slope;  // 0 without ALiBi
};

struct SoftmaxStats {
  float max_logit;
  float exp_sum;
};

// Dynamic shared memory the kernels must provide, in bytes: one fp32 logit per token slot of the
// blocks handled, and later one fp32 partial output row per warp (the buffer is reused).
template <int HEAD_SIZE, int NUM_THREADS>
__host__ __device__ constexpr int attention_smem_bytes(int num_token_slots) {
  return float_smem_bytes(const_max(num_token_slots, (NUM_THREADS / kWarpSize) * HEAD_SIZE));
}

// Static shared memory of attend_blocks: the scaled query row and the two reduction scratch
// arrays. The v1 launcher counts it before a launch (the emulation reports a kernel's static
// shared memory only once a block of it has run; a GPU's cudaFuncGetAttributes may add padding).
template <int HEAD_SIZE, int NUM_THREADS>
__host__ __device__ constexpr int attention_static_smem_bytes() {
  return 4 * HEAD_SIZE + 2 * 4 * (NUM_THREADS / kWarpSize);
}

// Step 1: logits[t - start_token] = q . k_t (+ ALiBi) for every token slot t of the range; slots
// past the end of the sequence get 0. Returns the max over this thread's valid logits.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename CacheT = T>
__device__ float qk_logits(const PagedAttentionParams& p, const AttentionWork& w,
                           const float* q_smem, float* logits) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));     // elements per 16-byte chunk
  constexpr int GROUP = const_max(kWarpSize / BLOCK_SIZE, 1);  // lanes per token
  constexpr int VEC = X / GROUP;                               // elements per lane per chunk
  constexpr int CHUNKS = HEAD_SIZE / X;                        // chunks per key
  static_assert(BLOCK_SIZE <= kWarpSize && kWarpSize % BLOCK_SIZE == 0,
                "one warp must cover one block: block size must divide 32");
  static_assert(VEC >= 1 && GROUP * VEC == X, "a thread group must load exactly one chunk");
  static_assert(HEAD_SIZE % X == 0, "head size must be a whole number of 16-byte chunks");

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int token_in_block = lane / GROUP;  // the token this lane's group handles
  const int lane_in_group = lane % GROUP;
  const CacheT* key_cache = static_cast<const CacheT*>(p.key_cache);

  float my_max = -FLT_MAX;
  for (int block = w.first_block + warp; block < w.end_block; block += NUM_WARPS) {
    const int64_t physical = w.block_table[block];
    // Chunk c of this token's key starts at key_cache[physical, kv_head, c, token_in_block, 0].
    const CacheT* k = key_cache + physical * p.kv_block_stride + w.kv_head * p.kv_head_stride +
                      token_in_block * X + lane_in_group * VEC;
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float kv[VEC];
      // An fp8 key is dequantized element by element, before the dot product.
      // upstream: csrc/attention/attention_kernels.cuh:282 @ v0.11.0
      load_cache_as_float<CacheT, VEC>(k + c * BLOCK_SIZE * X, p.k_scale, kv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += q_smem[c * X + lane_in_group * VEC + e] * kv[e];
    }
    dot = group_sum<GROUP>(dot);
    const int token = block * BLOCK_SIZE + token_in_block;
    if (lane_in_group == 0) {
      const bool valid = token < w.seq_len;
      // The single query sits at position seq_len - 1; ALiBi adds slope * (distance <= 0).
      const float logit = dot + w.alibi_slope * static_cast<float>(token - (w.seq_len - 1));
      // Slots past the end of the sequence hold garbage keys: store 0, keep them out of the max.
      logits[token - w.start_token] = valid ? logit : 0.f;
      if (valid) my_max = fmaxf(my_max, logit);
    }
  }
  return my_max;
}

// Step 2: replace logits[0, num_tokens) by exp(logit - max) and return the max and their sum.
// `my_max` is this thread's result of step 1; red_max and red_sum hold NUM_WARPS floats each.
template <int NUM_THREADS>
__device__ SoftmaxStats softmax_in_place(float* logits, int num_tokens, float my_max,
                                         float* red_max, float* red_sum) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  // block_max's barrier also makes every logit written in step 1 visible to every thread.
  const float max_logit = block_max<NUM_WARPS>(my_max, red_max);
  float my_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - max_logit);
    logits[i] = e;
    my_sum += e;
  }
  // Its own scratch buffer: a fast warp must not overwrite red_max while others still read it.
  const float exp_sum = block_sum<NUM_WARPS>(my_sum, red_sum);
  return {max_logit, exp_sum};
}

// Step 3: out[d] = inv_sum * sum_t probs[t - start_token] * v_t[d] over the range's tokens.
// `probs` (the step-2 numerators) is reused as scratch once every warp is done reading it.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename CacheT = T>
__device__ void accumulate_values(const PagedAttentionParams& p, const AttentionWork& w,
                                  float* probs, float inv_sum, T* __restrict__ out) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));
  constexpr int V_VEC = const_min(X, BLOCK_SIZE);           // tokens per 16-byte value load
  constexpr int LANES_PER_ROW = BLOCK_SIZE / V_VEC;         // lanes covering one row of a block
  constexpr int ROWS_PER_PASS = kWarpSize / LANES_PER_ROW;  // rows a warp covers per load
  constexpr int PASSES = div_round_up(HEAD_SIZE, ROWS_PER_PASS);

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int v_token = (lane % LANES_PER_ROW) * V_VEC;  // first token of this lane's slice
  const int v_row = lane / LANES_PER_ROW;
  const CacheT* value_cache = static_cast<const CacheT*>(p.value_cache);

  float acc[PASSES];
#pragma unroll
  for (int r = 0; r < PASSES; ++r) acc[r] = 0.f;

  for (int block = w.first_block + warp; block < w.end_block; block += NUM_WARPS) {
    const int64_t physical = w.block_table[block];
    const CacheT* v = value_cache + physical * p.kv_block_stride + w.kv_head * p.kv_head_stride;
    const int token0 = block * BLOCK_SIZE + v_token;
    bool valid[V_VEC];
    float prob[V_VEC];
#pragma unroll
    for (int e = 0; e < V_VEC; ++e) {
      valid[e] = token0 + e < w.seq_len;
      prob[e] = valid[e] ? probs[token0 + e - w.start_token] : 0.f;
    }
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
      const int row = v_row + r * ROWS_PER_PASS;
      if (row < HEAD_SIZE) {  // the last pass overhangs when HEAD_SIZE is not a multiple
        float vals[V_VEC];
        // upstream: csrc/attention/attention_kernels.cuh:412 @ v0.11.0 (the values' scaled_convert)
        load_cache_as_float<CacheT, V_VEC>(v + row * BLOCK_SIZE + v_token, p.v_scale, vals);
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) {
          // Select rather than multiply by 0: a slot past the end may hold NaN (NaN * 0 = NaN).
          if (valid[e]) acc[r] += prob[e] * vals[e];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < PASSES; ++r) acc[r] = group_sum<LANES_PER_ROW>(acc[r]);

  // Every warp holds a partial output row (over its own blocks); add them in shared memory.
  __syncthreads();  // every warp is done reading probs: reuse the buffer
  float* partial = probs;  // [NUM_WARPS][HEAD_SIZE]
  if (lane % LANES_PER_ROW == 0) {
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
      const int row = v_row + r * ROWS_PER_PASS;
      if (row < HEAD_SIZE) partial[warp * HEAD_SIZE + row] = acc[r];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) {
    float total = 0.f;
#pragma unroll
    for (int wp = 0; wp < NUM_WARPS; ++wp) total += partial[wp * HEAD_SIZE + i];
    out[i] = from_float<T>(total * inv_sum);
  }
}

// The work of the thread block that attends for query head `head` of sequence `seq` (of
// seq_len tokens) over the KV blocks [first_block, end_block) of its block table.
template <int BLOCK_SIZE>
__device__ AttentionWork make_work(const PagedAttentionParams& p, int seq, int head, int seq_len,
                                   int first_block, int end_block) {
  AttentionWork w;
  w.seq = seq;
  w.head = head;
  w.kv_head = head / (p.num_heads / p.num_kv_heads);
  w.seq_len = seq_len;
  w.first_block = first_block;
  w.end_block = end_block;
  w.start_token = first_block * BLOCK_SIZE;
  w.num_tokens = min(end_block * BLOCK_SIZE, seq_len) - w.start_token;
  w.block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;
  w.alibi_slope = p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[head];
  return w;
}

// The query row of (seq, head), scaled once, into shared memory (every thread group reads all
// of it). Every thread of the block must call it; it ends with the barrier that publishes it.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
__device__ void stage_query(const PagedAttentionParams& p, int seq, int head, float* q_smem) {
  const T* q = static_cast<const T*>(p.query) + seq * p.q_stride +
               static_cast<int64_t>(head) * HEAD_SIZE;
  for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) {
    q_smem[i] = to_float(q[i]) * p.scale;
  }
  __syncthreads();
}

// Attention of query head `head` of sequence `seq` over the KV blocks [first_block, end_block)
// of its block table. Writes the normalised output row (HEAD_SIZE elements) to `out` and, when
// `max_logit_out` is not null, the range's max logit and sum of exp(logit - max) (for v2).
// Every thread of the block must call it (it synchronises).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename CacheT = T>
__device__ void attend_blocks(const PagedAttentionParams& p, int seq, int head, int seq_len,
                              int first_block, int end_block, T* __restrict__ out,
                              float* max_logit_out, float* exp_sum_out) {
  static_assert(NUM_THREADS % kWarpSize == 0, "whole warps only");
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  MINI_VLLM_DYNAMIC_SHARED(float, logits);  // attention_smem_bytes(...) bytes

  const AttentionWork w =
      make_work<BLOCK_SIZE>(p, seq, head, seq_len, first_block, end_block);
  stage_query<T, HEAD_SIZE, NUM_THREADS>(p, seq, head, q_smem);

  const float my_max =
      qk_logits<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, CacheT>(p, w, q_smem, logits);
  const SoftmaxStats stats =
      softmax_in_place<NUM_THREADS>(logits, w.num_tokens, my_max, red_max, red_sum);
  // Normalising the output row once is the same as normalising every probability.
  const float inv_sum = stats.exp_sum > 0.f ? 1.f / stats.exp_sum : 0.f;
  accumulate_values<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, CacheT>(p, w, logits, inv_sum, out);
  if (threadIdx.x == 0 && max_logit_out != nullptr) {
    *max_logit_out = stats.max_logit;
    *exp_sum_out = stats.exp_sum;
  }
}

}  // namespace mini_vllm
