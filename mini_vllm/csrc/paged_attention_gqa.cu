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
// Two kernels, one contract:
//   * paged_attention_gqa_kernel (scalar, fp32 FMAs; in gqa_scalar_kernel.cuh, around the two
//     steps defined here, gqa_logits and gqa_values, which lab 02-06's stretch asks for): keys
//     as in attention_core.cuh (a warp takes one KV block, a thread group one token); values:
//     every warp walks all blocks of the partition but owns a quarter of the head's rows, so no
//     cross-warp sum is needed.
//   * paged_attention_gqa_tc_kernel (tensor cores, nvcuda::wmma): with G query heads per KV
//     head, decode does 2 * G multiply-adds per K/V element it reads (one for q.k, one for p*v,
//     per head): 16 at G = 8, which the FP32 units of an H100 cannot keep up with at full memory
//     bandwidth. The tensor cores do these products as small matrix multiplies: the logits of a
//     32-token tile are K_tile [32 x D] * Q^T [D x 8], the output is V^T [D x T] * P^T [T x 8].
// The launcher takes the tensor-core kernel for fp16, and bf16 on sm_80 and later, when a
// chunk holds 4 or more query heads; the scalar kernel otherwise.
// An FP8 (e4m3) cache is read by the scalar kernel only (templated on the cache element type as
// attention_core.cuh: each key element times k_scale, each value element times v_scale); the
// tensor-core kernel's fragments hold the model dtype, and converting fp8 tiles for them is left
// out.
#include <mma.h>

#include "common.cuh"
#include "dispatch.cuh"
#include "gqa_common.cuh"
#include "partition_reduce.cuh"

namespace mini_vllm {

// Step 1: logits[g][t - start_token] = q_g . k_t + slope[g] * (t - (seq_len - 1)) for every
// query head g < num_q and token slot t of the range (0 past the sequence's end), and each
// thread's max of the valid ones in my_max[g]. Keys as in attention_core.cuh (a warp takes one
// KV block, a thread group one token), but each key chunk, once loaded, serves every head.
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ __forceinline__ void gqa_logits(const PagedAttentionParams& p, const GqaWork& w,
                                           const float (*q_smem)[HEAD_SIZE], const float* slope,
                                           float (*logits)[kPartitionSize], float* my_max) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));  // 16 for an fp8 cache
  constexpr int GROUP = const_max(kWarpSize / BLOCK_SIZE, 1);  // lanes per token
  constexpr int VEC = X / GROUP;
  constexpr int CHUNKS = HEAD_SIZE / X;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int token_in_block = lane / GROUP;
  const int lane_in_group = lane % GROUP;
  const CacheT* key_cache = static_cast<const CacheT*>(p.key_cache);
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) my_max[g] = -FLT_MAX;

  for (int block = w.first_block + warp; block < w.end_block; block += NUM_WARPS) {
    const int64_t physical = w.block_table[block];
    const CacheT* k = key_cache + physical * p.kv_block_stride + w.kv_head * p.kv_head_stride +
                      token_in_block * X + lane_in_group * VEC;
    float dot[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float kv[VEC];
      load_cache_as_float<CacheT, VEC>(k + c * BLOCK_SIZE * X, p.k_scale, kv);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < w.num_q) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] += q_smem[g][c * X + lane_in_group * VEC + e] * kv[e];
        }
      }
    }
    const int token = block * BLOCK_SIZE + token_in_block;
    const bool valid = token < w.seq_len;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < w.num_q) {  // num_q is the same for the whole block: no divergence around shuffles
        const float logit =
            group_sum<GROUP>(dot[g]) + slope[g] * static_cast<float>(token - (w.seq_len - 1));
        if (lane_in_group == 0) {
          logits[g][token - w.start_token] = valid ? logit : 0.f;
          if (valid) my_max[g] = fmaxf(my_max[g], logit);
        }
      }
    }
  }
}

// Step 3: for every query head g < num_q, row d of the range's output,
//     sum_t probs[g][t - start_token] * v_t[d] * inv_sum[g],
// written to tmp_out (partition `part`'s row of head head0 + g). Warp w owns rows
// [w * ROWS_PER_WARP, (w + 1) * ROWS_PER_WARP), so no cross-warp sum is needed; each value
// vector, once loaded, serves every head.
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ __forceinline__ void gqa_values(const PagedAttentionParams& p, const GqaWork& w,
                                           const float (*probs)[kPartitionSize],
                                           const float* inv_sum) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));
  constexpr int V_VEC = const_min(X, BLOCK_SIZE);
  constexpr int LANES_PER_ROW = BLOCK_SIZE / V_VEC;
  constexpr int ROWS_PER_PASS = kWarpSize / LANES_PER_ROW;
  constexpr int ROWS_PER_WARP = div_round_up(HEAD_SIZE, NUM_WARPS);
  constexpr int PASSES = div_round_up(ROWS_PER_WARP, ROWS_PER_PASS);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int v_token = (lane % LANES_PER_ROW) * V_VEC;
  const int first_row = warp * ROWS_PER_WARP;
  const CacheT* value_cache = static_cast<const CacheT*>(p.value_cache);

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
  const int full_end = min(w.end_block, w.seq_len / BLOCK_SIZE);  // [first_block, full_end): full
  for (int block = w.first_block; block < w.end_block; ++block) {
    const int64_t physical = w.block_table[block];
    const CacheT* v = value_cache + physical * p.kv_block_stride + w.kv_head * p.kv_head_stride;
    float vals[PASSES][V_VEC];
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
      const int local_row = lane / LANES_PER_ROW + r * ROWS_PER_PASS;
      const int row = first_row + local_row;
      if (local_row < ROWS_PER_WARP && row < HEAD_SIZE) {
        load_cache_as_float<CacheT, V_VEC>(v + row * BLOCK_SIZE + v_token, p.v_scale, vals[r]);
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
        for (int e = 0; e < V_VEC; ++e) vals[r][e] = token0 + e < w.seq_len ? vals[r][e] : 0.f;
      }
    }
    const int slot0 = token0 - w.start_token;  // a multiple of V_VEC: 16-byte aligned
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < w.num_q) {
        float prob[V_VEC];
        load_floats<V_VEC>(&probs[g][slot0], prob);
#pragma unroll
        for (int r = 0; r < PASSES; ++r) {
#pragma unroll
          for (int e = 0; e < V_VEC; ++e) acc[g][r] += prob[e] * vals[r][e];
        }
      }
    }
  }

  // Lanes sharing a row hold sums over different token slices of it: add them, then write.
  const int64_t out_row0 = static_cast<int64_t>(w.seq) * p.num_heads + w.head0;
  T* tmp_out = static_cast<T*>(p.tmp_out);
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g < w.num_q) {
      const int64_t row_base = ((out_row0 + g) * p.max_num_partitions + w.part) * HEAD_SIZE;
#pragma unroll
      for (int r = 0; r < PASSES; ++r) {
        const float total = group_sum<LANES_PER_ROW>(acc[g][r]);
        const int local_row = lane / LANES_PER_ROW + r * ROWS_PER_PASS;
        const int row = first_row + local_row;
        if (lane % LANES_PER_ROW == 0 && local_row < ROWS_PER_WARP && row < HEAD_SIZE) {
          tmp_out[row_base + row] = from_float<T>(total * inv_sum[g]);
        }
      }
    }
  }
}

}  // namespace mini_vllm

// The kernel that runs gqa_logits and gqa_values, and its launcher launch_gqa.
#include "gqa_scalar_kernel.cuh"

namespace mini_vllm {

// ---- the tensor-core kernel -------------------------------------------------------------------

// bf16 matrix fragments exist from sm_80 on; the launcher never takes the tensor-core kernel for
// bf16 on older GPUs (a T4 runs the scalar one), so there it compiles to nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MINI_VLLM_BF16_MMA 0
#else
#define MINI_VLLM_BF16_MMA 1
#endif

constexpr int kTcMinGroup = 4;   // query heads per chunk from which the tensor cores pay off
constexpr int kTcTile = 32;      // tokens per warp tile: the M of the m32n8k16 logits multiply
constexpr int kTcKeyChunk = 64;  // key dimensions staged in shared memory at a time
constexpr int kTcMinBlocksPerSm = 4;

// 128-byte aligned units of dynamic shared memory (the matrix loads need 32-byte alignment).
struct __align__(128) TcSmemUnit {
  unsigned char bytes[128];
};

// The tensor-core kernel's dynamic shared memory, in bytes from its start (P: partition size).
//   q       T     [8][Q_LD]          the group's queries, scaled
//   probs   T     [8][P + 8]         softmax numerators, the B operand of P * V
//   red     float [2][8][4]          per-warp maxima and sums
//   logits  float [8][P + 4]         the logits; reused for the 4 warps' partial outputs
//   stage   T     [4][STAGE]         per warp: a key chunk [32][64 + 8] or a value tile [32][40]
template <typename T, int HEAD_SIZE>
struct TcLayout {
  static constexpr int Q_LD = HEAD_SIZE + 8;  // +8 elements: rows start in other banks
  static constexpr int DP = div_round_up(HEAD_SIZE, 32) * 32;  // value rows in whole M tiles
  static constexpr int KEY_LD = kTcKeyChunk + 8;
  static constexpr int VALUE_LD = kTcTile + 8;
  static constexpr int STAGE = const_max(kTcTile * KEY_LD, 32 * VALUE_LD);  // elements per warp
  static constexpr int NUM_WARPS = 4;
  __host__ __device__ static constexpr int up(int bytes) { return (bytes + 127) / 128 * 128; }
  __host__ __device__ static constexpr int probs_ld(int P) { return P + 8; }
  __host__ __device__ static constexpr int logits_ld(int P) { return P + 4; }
  __host__ __device__ static constexpr int probs_offset() {
    return up(kMaxGroup * Q_LD * static_cast<int>(sizeof(T)));
  }
  __host__ __device__ static constexpr int red_offset(int P) {
    return probs_offset() + up(kMaxGroup * probs_ld(P) * static_cast<int>(sizeof(T)));
  }
  __host__ __device__ static constexpr int logits_offset(int P) {
    return red_offset(P) + up(2 * kMaxGroup * NUM_WARPS * 4);
  }
  __host__ __device__ static constexpr int stage_offset(int P) {
    return logits_offset(P) +
           up(4 * const_max(kMaxGroup * logits_ld(P), NUM_WARPS * kMaxGroup * DP));
  }
  __host__ __device__ static constexpr int bytes(int P) {
    return stage_offset(P) + up(NUM_WARPS * STAGE * static_cast<int>(sizeof(T)));
  }
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, kTcMinBlocksPerSm)
    paged_attention_gqa_tc_kernel(const PagedAttentionParams p) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && !MINI_VLLM_BF16_MMA) {
    return;  // never launched (see MINI_VLLM_BF16_MMA)
  } else {
    using namespace nvcuda;
    using L = TcLayout<T, HEAD_SIZE>;
    constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
    constexpr int X = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
    constexpr int DT = L::DP / 32;                        // 32-row tiles of the output
    static_assert(NUM_WARPS == L::NUM_WARPS, "the shared-memory layout is for 4 warps");
    static_assert(HEAD_SIZE % 16 == 0, "the logits multiply takes 16 dimensions at a time");
    static_assert(BLOCK_SIZE % X == 0 && kTcTile % BLOCK_SIZE == 0,
                  "a tile holds whole blocks, a value vector lies in one block");
    using AccFrag = wmma::fragment<wmma::accumulator, 32, 8, 16, float>;
    using AFrag = wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::row_major>;
    using BFrag = wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major>;

    const int tid = threadIdx.x;
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const int group_size = p.num_heads / p.num_kv_heads;
    const int chunks_per_kv_head = div_round_up(group_size, kMaxGroup);
    const int kv_head = blockIdx.x / chunks_per_kv_head;
    const int head0 = kv_head * group_size + (blockIdx.x % chunks_per_kv_head) * kMaxGroup;
    const int num_q = min(kMaxGroup, (kv_head + 1) * group_size - head0);
    const int seq = blockIdx.y;
    const int part = blockIdx.z;
    const int seq_len = clamped_seq_len(p, seq);
    const int partition_size = partition_size_of(p);
    const int blocks_per_partition = partition_size / BLOCK_SIZE;
    const int first_block = part * blocks_per_partition;
    if (first_block * BLOCK_SIZE >= seq_len) return;
    const int end_block = min(first_block + blocks_per_partition, div_round_up(seq_len, BLOCK_SIZE));
    const int start_token = first_block * BLOCK_SIZE;
    const int num_tokens = min(end_block * BLOCK_SIZE, seq_len) - start_token;
    const int num_tiles = div_round_up((end_block - first_block) * BLOCK_SIZE, kTcTile);

    const T* query = static_cast<const T*>(p.query);
    const T* key_cache = static_cast<const T*>(p.key_cache);
    const T* value_cache = static_cast<const T*>(p.value_cache);
    const int* block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;
    const int64_t head_offset = kv_head * p.kv_head_stride;

    MINI_VLLM_DYNAMIC_SHARED(TcSmemUnit, smem);  // TcLayout<T, HEAD_SIZE>::bytes(P) bytes
    unsigned char* base = smem[0].bytes;
    T* q_s = reinterpret_cast<T*>(base);
    T* probs = reinterpret_cast<T*>(base + L::probs_offset());
    float* red_max = reinterpret_cast<float*>(base + L::red_offset(partition_size));
    float* red_sum = red_max + kMaxGroup * NUM_WARPS;
    float* logits = reinterpret_cast<float*>(base + L::logits_offset(partition_size));
    T* stage = reinterpret_cast<T*>(base + L::stage_offset(partition_size)) + warp * L::STAGE;
    const int probs_ld = L::probs_ld(partition_size);
    const int logits_ld = L::logits_ld(partition_size);

    // The queries, scaled once; rows past num_q are zero, so their logits are zero.
    for (int i = tid; i < kMaxGroup * HEAD_SIZE; i += NUM_THREADS) {
      const int g = i / HEAD_SIZE;
      const int d = i % HEAD_SIZE;
      const float v = g < num_q ? to_float(query[seq * p.q_stride +
                                                 static_cast<int64_t>(head0 + g) * HEAD_SIZE + d]) *
                                      p.scale
                                : 0.f;
      q_s[g * L::Q_LD + d] = from_float<T>(v);
    }
    float slope[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      slope[g] = (p.alibi_slopes != nullptr && g < num_q) ? p.alibi_slopes[head0 + g] : 0.f;
    }
    __syncthreads();

    // ---- logits: warp w takes tiles w, w + 4, ... of 32 tokens; S^T = K_tile * Q^T ----------
    float my_max[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) my_max[g] = -FLT_MAX;
#pragma unroll 1
    for (int tile = warp; tile < num_tiles; tile += NUM_WARPS) {
      const int t0 = tile * kTcTile;  // slot of the tile's first token
      const int token = start_token + t0 + lane;  // the token whose key this lane stages
      const int block = token / BLOCK_SIZE;
      // Blocks past the range are not read (their keys are staged as zeros).
      const T* k = nullptr;
      if (block < end_block) {
        const int64_t physical = block_table[block];
        k = key_cache + physical * p.kv_block_stride + head_offset + (token % BLOCK_SIZE) * X;
      }
      AccFrag s;
      wmma::fill_fragment(s, 0.f);
#pragma unroll
      for (int c0 = 0; c0 < HEAD_SIZE; c0 += kTcKeyChunk) {
        constexpr int kMax = kTcKeyChunk / X;
        const int chunk = const_min(kTcKeyChunk, HEAD_SIZE - c0);
        // Stage keys [32 tokens][chunk dims] row-major: lane = token, 16-byte pieces of it.
#pragma unroll
        for (int i = 0; i < kMax; ++i) {
          if (i < chunk / X) {
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (k != nullptr) raw = *reinterpret_cast<const uint4*>(k + (c0 / X + i) * BLOCK_SIZE * X);
            *reinterpret_cast<uint4*>(stage + lane * L::KEY_LD + i * X) = raw;
          }
        }
        __syncwarp();  // the stores above before the warp's matrix loads
#pragma unroll
        for (int kk = 0; kk < kTcKeyChunk / 16; ++kk) {
          if (kk < chunk / 16) {
            AFrag a;
            BFrag b;
            wmma::load_matrix_sync(a, stage + kk * 16, L::KEY_LD);
            wmma::load_matrix_sync(b, q_s + c0 + kk * 16, L::Q_LD);
            wmma::mma_sync(s, a, b, s);
          }
        }
        __syncwarp();  // the warp's matrix loads before the next chunk overwrites the stage
      }
      // logits[g][t0 + m] = S^T[m][g]
      wmma::store_matrix_sync(logits + t0, s, logits_ld, wmma::mem_col_major);
      __syncwarp();
      // ALiBi, and the end of the sequence: slots past it get 0 and stay out of the max.
      const bool valid = token < seq_len;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < num_q) {
          float& l = logits[g * logits_ld + t0 + lane];
          const float v = l + slope[g] * static_cast<float>(token - (seq_len - 1));
          l = valid ? v : 0.f;
          if (valid) my_max[g] = fmaxf(my_max[g], v);
        }
      }
    }

    // ---- softmax: one max and one sum per query head ------------------------------------------
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float m = warp_max(my_max[g]);
      if (lane == 0) red_max[g * NUM_WARPS + warp] = m;
    }
    __syncthreads();  // also publishes every warp's logits
    const int padded = num_tiles * kTcTile;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      float m = red_max[g * NUM_WARPS];
#pragma unroll
      for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, red_max[g * NUM_WARPS + w]);
      float sum = 0.f;
      if (g < num_q) {
        // Probabilities in T, the B operand of the values multiply; 0 past the end.
        for (int i = tid; i < padded; i += NUM_THREADS) {
          const float e = i < num_tokens ? expf(logits[g * logits_ld + i] - m) : 0.f;
          probs[g * probs_ld + i] = from_float<T>(e);
          sum += e;
        }
      }
      sum = group_sum<kWarpSize>(sum);
      if (lane == 0) red_sum[g * NUM_WARPS + warp] = sum;
    }
    __syncthreads();  // publishes the probabilities and the sums

    // ---- values: O^T [D x 8] += V_tile^T [D x 32] * P_tile^T [32 x 8], per warp tile ----------
    AccFrag acc[DT];
#pragma unroll
    for (int mt = 0; mt < DT; ++mt) wmma::fill_fragment(acc[mt], 0.f);
    const int tg = lane % 4;       // this lane stages tokens tg * 8 ... tg * 8 + 7 of the tile
    const int row_in = lane / 4;   // and rows row_in + 8 j of each 32-row tile
#pragma unroll 1
    for (int tile = warp; tile < num_tiles; tile += NUM_WARPS) {
      const int t0 = tile * kTcTile;
      BFrag pb[kTcTile / 16];
#pragma unroll
      for (int kk = 0; kk < kTcTile / 16; ++kk) {
        wmma::load_matrix_sync(pb[kk], probs + t0 + kk * 16, probs_ld);
      }
      const int token0 = start_token + t0 + tg * X;
      const int block = token0 / BLOCK_SIZE;
      const T* v = nullptr;
      if (block < end_block) {
        const int64_t physical = block_table[block];
        v = value_cache + physical * p.kv_block_stride + head_offset + token0 % BLOCK_SIZE;
      }
      // Only the sequence's last block can hold slots past its end; they may hold anything,
      // NaN included, and a probability of 0 does not cancel NaN: they are zeroed in the stage,
      // in the one tile where the sequence ends (the same branch for the whole warp).
      const int tail = seq_len - (start_token + t0);  // tokens of the tile that exist
#pragma unroll
      for (int mt = 0; mt < DT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int row = row_in + 8 * j;
          const int d = mt * 32 + row;
          uint4 raw = make_uint4(0, 0, 0, 0);
          if (v != nullptr && d < HEAD_SIZE) {
            raw = *reinterpret_cast<const uint4*>(v + d * BLOCK_SIZE);
          }
          *reinterpret_cast<uint4*>(stage + row * L::VALUE_LD + tg * X) = raw;
        }
        __syncwarp();
        if (tail < kTcTile) {
          for (int t = tail; t < kTcTile; ++t) stage[lane * L::VALUE_LD + t] = from_float<T>(0.f);
          __syncwarp();
        }
#pragma unroll
        for (int kk = 0; kk < kTcTile / 16; ++kk) {
          AFrag a;
          wmma::load_matrix_sync(a, stage + kk * 16, L::VALUE_LD);
          wmma::mma_sync(acc[mt], a, pb[kk], acc[mt]);
        }
        __syncwarp();
      }
    }

    // Each warp's partial output over its own tiles, then their sum. The logits are no longer
    // read (the barrier above), so their buffer holds the partials: [warp][head][DP].
    float* partial = logits;
#pragma unroll
    for (int mt = 0; mt < DT; ++mt) {
      wmma::store_matrix_sync(partial + warp * kMaxGroup * L::DP + mt * 32, acc[mt], L::DP,
                              wmma::mem_col_major);
    }
    __syncthreads();
    const int64_t out_row0 = static_cast<int64_t>(seq) * p.num_heads + head0;
    T* tmp_out = static_cast<T*>(p.tmp_out);
    for (int i = tid; i < kMaxGroup * HEAD_SIZE; i += NUM_THREADS) {
      const int g = i / HEAD_SIZE;
      const int d = i % HEAD_SIZE;
      if (g < num_q) {
        float total = 0.f, exp_sum = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
          total += partial[(w * kMaxGroup + g) * L::DP + d];
          exp_sum += red_sum[g * NUM_WARPS + w];
        }
        const float inv_sum = exp_sum > 0.f ? 1.f / exp_sum : 0.f;
        tmp_out[((out_row0 + g) * p.max_num_partitions + part) * HEAD_SIZE + d] =
            from_float<T>(total * inv_sum);
      }
    }
    if (tid < num_q) {
      const int g = tid;
      float m = red_max[g * NUM_WARPS], exp_sum = 0.f;
      for (int w = 0; w < NUM_WARPS; ++w) {
        m = fmaxf(m, red_max[g * NUM_WARPS + w]);
        exp_sum += red_sum[g * NUM_WARPS + w];
      }
      const int64_t idx = (out_row0 + g) * p.max_num_partitions + part;
      p.max_logits[idx] = m;
      p.exp_sums[idx] = exp_sum;
    }
  }
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_gqa_tc(const PagedAttentionParams& p, cudaStream_t stream, bool* launched) {
  *launched = false;
  const int smem = TcLayout<T, HEAD_SIZE>::bytes(partition_size_of(p));
  const auto kernel = paged_attention_gqa_tc_kernel<T, HEAD_SIZE, BLOCK_SIZE, kGqaThreads>;
  if (smem > 48 * 1024) {
    int device = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (err != cudaSuccess) return cuda_status(err);
    if (smem > optin) return ok();  // not launched: the scalar kernel does it
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cuda_status(err);
  }
  const int group_size = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_kv_heads * div_round_up(group_size, kMaxGroup), p.num_seqs,
                  div_round_up(p.max_seq_len, partition_size_of(p)));
  MINI_VLLM_LAUNCH(kernel, grid, kGqaThreads, smem, stream)(p);
  *launched = true;
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  return launch_partition_reduce<T, HEAD_SIZE, kGqaThreads>(p, stream);
}

// Whether the tensor-core kernel serves `p` with element type T on the current device.
template <typename T>
Status use_tensor_cores(const PagedAttentionParams& p, bool* use) {
  *use = false;
  const int group_size = p.num_heads / p.num_kv_heads;
  if (const_min(group_size, kMaxGroup) < kTcMinGroup) return ok();
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    int device = 0, major = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    }
    if (err != cudaSuccess) return cuda_status(err);
    if (major < 8) return ok();  // bf16 matrix operations need sm_80: the scalar kernel
  }
  *use = true;
  return ok();
}

// fp32 goes to v2 (same inputs, same result): with 4-byte elements the per-head register
// arrays of this kernel no longer fit (ptxas spills kilobytes at block size 32), and fp32 decode
// is not what this kernel is for. Not instantiating it also keeps the build shorter.
Status launch_paged_attention_gqa(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0) return ok();
  const Status partitions = check_gqa_partitions(p);
  if (partitions.code != StatusCode::kOk) return partitions;
  return dispatch_attention_kv(
      p.dtype, p.kv_cache_dtype, p.head_size, p.block_size,
      [&](auto type_tag, auto cache_tag, auto head_tag, auto block_tag) -> Status {
        using T = typename decltype(type_tag)::type;
        using CacheT = typename decltype(cache_tag)::type;
        constexpr int H = decltype(head_tag)::value;
        constexpr int B = decltype(block_tag)::value;
        if constexpr (std::is_same_v<T, float>) {
          PagedAttentionParams v2 = p;
          v2.partition_size = 0;  // v2's partitions are always 512 tokens
          return launch_paged_attention_v2(v2, stream);
        } else if constexpr (kIsFp8<CacheT>) {
          return launch_gqa<T, CacheT, H, B>(p, stream);  // the scalar kernel (see the top)
        } else {
          bool tc = false, launched = false;
          Status status = use_tensor_cores<T>(p, &tc);
          if (status.code == StatusCode::kOk && tc) {
            status = launch_gqa_tc<T, H, B>(p, stream, &launched);
          }
          if (status.code != StatusCode::kOk || launched) return status;
          return launch_gqa<T, T, H, B>(p, stream);
        }
      });
}

}  // namespace mini_vllm
