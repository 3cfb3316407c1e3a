// Small device helpers shared by every kernel: element conversions, 16-byte vector loads,
// warp and block reductions. No torch header: this compiles with plain nvcc.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernel_params.h"
#include "portable.cuh"

namespace mini_vllm {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int div_round_up(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int const_min(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int const_max(int a, int b) { return a > b ? a : b; }

// Bytes of a dynamic shared array of `n` floats, rounded up to whole 16-byte groups. nvcc may
// read the last 1-3 floats of such an array with one 16-byte LDS.128 (partition_reduce_kernel's
// tail loop does, for sm_90), and that read must stay inside the launch's allocation:
// compute-sanitizer on an H200 reported it as an out-of-bounds shared read before this padding.
__host__ __device__ constexpr int float_smem_bytes(int n) { return 16 * div_round_up(n, 4); }

// ---- element conversions: all arithmetic is done in fp32 -----------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The FP8 KV cache's element type (upstream stores uint8_t and picks the conversion with its
// KV_DTYPE template argument; the type itself says it here).
template <typename CacheT>
constexpr bool kIsFp8 = std::is_same<CacheT, __nv_fp8_e4m3>::value;

// What a new key or value element is stored as in a cache of CacheT: the element itself, or
// e4m3(v / scale), saturated to +-448 by the conversion (NaN stays NaN).
// upstream: csrc/quantization/fp8/nvidia/quant_utils.cuh:496 @ v0.11.0
template <typename CacheT, typename T>
__device__ __forceinline__ CacheT to_cache(T v, float scale) {
  if constexpr (kIsFp8<CacheT>) {
    return CacheT(to_float(v) / scale);
  } else {
    static_assert(std::is_same<CacheT, T>::value, "a non-fp8 cache holds the model's dtype");
    return v;
  }
}

// ---- vector loads ---------------------------------------------------------------------------

// An unsigned integer type of exactly BYTES bytes, used to move BYTES in one load instruction.
template <int BYTES>
struct RawBits;
template <>
struct RawBits<2> { using type = uint16_t; };
template <>
struct RawBits<4> { using type = uint32_t; };
template <>
struct RawBits<8> { using type = uint2; };
template <>
struct RawBits<16> { using type = uint4; };

// Loads N consecutive elements with a single load (16 bytes at most) and widens them to fp32.
// `ptr` must be aligned to N * sizeof(T) bytes; the cache layouts guarantee it (see callers).
template <typename T, int N>
__device__ __forceinline__ void load_as_float(const T* ptr, float (&out)[N]) {
  using Raw = typename RawBits<N * static_cast<int>(sizeof(T))>::type;
  const Raw raw = *reinterpret_cast<const Raw*>(ptr);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(elems[i]);
}

// Loads N consecutive cache elements (one vector load) as the values they stand for: a model-dtype
// cache's as they are, an fp8 cache's widened to fp32 and multiplied by the layer's scale
// (k_scale for keys, v_scale for values).
// upstream: csrc/quantization/fp8/nvidia/quant_utils.cuh:419 @ v0.11.0
template <typename CacheT, int N>
__device__ __forceinline__ void load_cache_as_float(const CacheT* ptr, float scale,
                                                    float (&out)[N]) {
  load_as_float<CacheT, N>(ptr, out);
  if constexpr (kIsFp8<CacheT>) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] *= scale;
  }
}

// N consecutive floats from 16-byte aligned memory (shared memory, in the kernels), in 16-byte
// loads when N is a multiple of 4.
template <int N>
__device__ __forceinline__ void load_floats(const float* ptr, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(ptr)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = ptr[i];
  }
}

// ---- reductions -----------------------------------------------------------------------------

// Sum over aligned groups of WIDTH consecutive lanes (WIDTH a power of two <= 32). A butterfly:
// afterwards every lane of a group holds the group's total.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
  static_assert(WIDTH >= 1 && WIDTH <= kWarpSize && (WIDTH & (WIDTH - 1)) == 0,
                "group width must be a power of two no larger than a warp");
#pragma unroll
  for (int mask = WIDTH / 2; mask >= 1; mask /= 2) v += __shfl_xor_sync(kFullMask, v, mask);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask >= 1; mask /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, mask));
  }
  return v;
}

// Block-wide max / sum; every thread of the block must call it and gets the result.
// `scratch` holds NUM_WARPS floats. It contains a __syncthreads(), so shared-memory writes made
// before the call are visible to every thread after it. A scratch buffer must not be reused by
// the next reduction before another __syncthreads(): a fast warp could overwrite a slot that a
// slow warp has not read yet. The kernels give each reduction its own buffer.
template <int NUM_WARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float result = scratch[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) result = fmaxf(result, scratch[w]);
  return result;
}

template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = group_sum<kWarpSize>(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float result = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) result += scratch[w];
  return result;
}

// ---- helpers for the attention kernels --------------------------------------------------------

// Tokens per partition of a partitioned launch (v2 always uses kPartitionSize).
__host__ __device__ __forceinline__ int partition_size_of(const PagedAttentionParams& p) {
  return p.partition_size > 0 ? p.partition_size : kPartitionSize;
}

// The number of context tokens of sequence `seq`, clamped so that bad values cannot take a
// kernel outside its buffers: never negative, never past max_seq_len or the block table's width.
__device__ __forceinline__ int clamped_seq_len(const PagedAttentionParams& p, int seq) {
  const int limit = min(p.max_seq_len, p.max_num_blocks_per_seq * p.block_size);
  return max(0, min(p.seq_lens[seq], limit));
}

}  // namespace mini_vllm
