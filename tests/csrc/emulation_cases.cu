// Small kernels that exercise the CPU emulation itself (tests/test_csrc_emulation.py): one op per
// behaviour, right and wrong. Each op reads its inputs from the request (see driver.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>
#include <mma.h>

#include <cstdint>
#include <string>

#include "driver.h"
#include "portable.cuh"

namespace {

using mini_vllm_emu::Request;

void status(cudaError_t err) {
  mini_vllm_emu::report_status(err == cudaSuccess ? 0 : 3, cudaGetErrorString(err));
}

// ---- correct code: results are checked by the test ---------------------------------------------

// out[t] = the sum of the warp's values by xor shuffles; out2[t] = the value of lane (t+1)%32 by
// __shfl_sync, down by 1, up by 1; votes.
__global__ void warp_ops(const float* in, float* out, int* votes) {
  const int t = threadIdx.x;
  const int lane = t % 32;
  float v = in[t];
  float sum = v;
  for (int m = 16; m >= 1; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  out[4 * t + 0] = sum;
  out[4 * t + 1] = __shfl_sync(0xffffffffu, v, (lane + 1) % 32);
  out[4 * t + 2] = __shfl_down_sync(0xffffffffu, v, 1);
  out[4 * t + 3] = __shfl_up_sync(0xffffffffu, v, 1, 8);  // segments of 8 lanes
  const unsigned ballot = __ballot_sync(0xffffffffu, v > 0.f);
  votes[3 * t + 0] = static_cast<int>(ballot);
  votes[3 * t + 1] = __any_sync(0xffffffffu, v > 100.f);
  votes[3 * t + 2] = __syncthreads_count(v > 0.f);
  // Half-warps shuffling among themselves, with their own masks, at different lines.
  if (lane < 16) {
    v = __shfl_xor_sync(0x0000ffffu, v, 1);
  } else {
    v = __shfl_xor_sync(0xffff0000u, v, 2);
  }
  __syncwarp();
  out[4 * blockDim.x + t] = v;
}

// Reads shared memory that nobody wrote (NaN), writes it, and reports what block 1 sees at the
// start (fresh NaN again, not block 0's values).
__global__ void fresh_shared(float* out) {
  MINI_VLLM_SHARED(float, cells, [64]);
  MINI_VLLM_DYNAMIC_SHARED(float, extra);
  const int t = threadIdx.x;
  out[blockIdx.x * 128 + t] = cells[t];
  out[blockIdx.x * 128 + 64 + t] = extra[t];
  __syncthreads();
  cells[t] = 1.f;
  extra[t] = 2.f;
}

// Block-wide reduction through shared memory, done right: one barrier between write and read.
__global__ void shared_sum(const float* in, float* out) {
  MINI_VLLM_SHARED(float, cells, [128]);
  const int t = threadIdx.x;
  cells[t] = in[blockIdx.x * 128 + t];
  __syncthreads();
  if (t == 0) {
    float s = 0.f;
    for (int i = 0; i < 128; ++i) s += cells[i];
    out[blockIdx.x] = s;
  }
}

// ---- mistakes -----------------------------------------------------------------------------------

__global__ void early_exit(float* out, int quitter) {
  if (static_cast<int>(threadIdx.x) == quitter) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

__global__ void two_barriers(float* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

__global__ void shuffle_in_branch(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 2 == 0) v = __shfl_xor_sync(0xffffffffu, v, 4);
  __syncthreads();
  out[threadIdx.x] = v;
}

__global__ void shuffle_outside_mask(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

__global__ void read_past_end(const float* in, float* out, int n) {
  out[threadIdx.x] = in[threadIdx.x + n - 31];  // thread 31 reads in[n]
}

__global__ void write_input(float* in) { in[threadIdx.x] = 0.f; }

__global__ void race_on_shared(const float* in, float* out) {
  MINI_VLLM_SHARED(float, cells, [128]);
  const int t = threadIdx.x;
  cells[t] = in[t];
  out[t] = cells[(t + 33) % 128];  // another warp's cell, no barrier
}

__global__ void race_between_blocks(float* out) {
  if (threadIdx.x == blockIdx.x) out[0] = static_cast<float>(blockIdx.x);
}

__global__ void misaligned_vector_load(const float* in, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(in + 1);
  out[threadIdx.x] = static_cast<float>(raw.x);
}

__global__ void int_overflow(const int* in, float* out) {
  const int index = in[0] * in[1];  // overflows for large inputs
  out[threadIdx.x] = static_cast<float>(index % 7);
}

__global__ void big_static_shared(float* out) {
  MINI_VLLM_SHARED(float, a, [10000]);
  MINI_VLLM_SHARED(float, b, [4000]);
  a[threadIdx.x] = 1.f;
  b[threadIdx.x] = 1.f;
  out[threadIdx.x] = a[threadIdx.x] + b[threadIdx.x];
}

__global__ void dynamic_shared_user(float* out) {
  MINI_VLLM_DYNAMIC_SHARED(float, cells);
  cells[threadIdx.x] = 1.f;
  out[threadIdx.x] = cells[threadIdx.x];
}

// Every conversion the kernels use, element by element: fp32 -> fp16/bf16 bits, and back.
__global__ void convert(const float* in, unsigned short* half_bits, unsigned short* bf16_bits,
                        const unsigned short* all_bits, float* from_half, float* from_bf16,
                        int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    half_bits[i] = __half_as_ushort(__float2half_rn(in[i]));
    bf16_bits[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
  for (int i = threadIdx.x; i < 65536; i += blockDim.x) {
    from_half[i] = __half2float(__ushort_as_half(all_bits[i]));
    from_bf16[i] = __bfloat162float(__ushort_as_bfloat16(all_bits[i]));
  }
}

// fp32 -> e4m3 bits through __nv_fp8_e4m3's constructor (saturating, as the FP8 cache writes),
// and every e4m3 bit pattern back to fp32.
__global__ void convert_fp8(const float* in, unsigned char* fp8_bits, float* from_fp8, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) fp8_bits[i] = __nv_fp8_e4m3(in[i]).__x;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<__nv_fp8_storage_t>(i);
    from_fp8[i] = static_cast<float>(v);
  }
}

// ---- tensor cores (nvcuda::wmma) ------------------------------------------------------------------

// One warp: D = A * B + C for an M x K half matrix A (row-major), a K x N half matrix B (col-major,
// i.e. stored as B^T row by row) and an M x N float C, by wmma in the shape M, N, K; D stored
// row-major. The matrices go through shared memory, as a kernel would stage them.
template <int M, int N, int K>
__global__ void wmma_multiply(const __half* a, const __half* bt, const float* c, float* d) {
  using namespace nvcuda;
  MINI_VLLM_SHARED(float4, stage, [(M * K + K * N) / 8]);  // 16-byte units
  __half* sa = reinterpret_cast<__half*>(&stage[0]);
  __half* sb = sa + M * K;
  for (int i = threadIdx.x; i < M * K; i += 32) sa[i] = a[i];
  for (int i = threadIdx.x; i < K * N; i += 32) sb[i] = bt[i];
  __syncwarp();
  wmma::fragment<wmma::matrix_a, M, N, K, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, M, N, K, __half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, M, N, K, float> acc;
  wmma::load_matrix_sync(fa, sa, K);
  wmma::load_matrix_sync(fb, sb, K);
  wmma::load_matrix_sync(acc, c, N, wmma::mem_row_major);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, N, wmma::mem_row_major);
}

// Lanes 0-15 skip the mma: the others wait for them forever (a hang or garbage on a GPU).
__global__ void wmma_in_branch(float* d) {
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(fa, 1.f);
  wmma::fill_fragment(fb, 1.f);
  wmma::fill_fragment(acc, 0.f);
  if (threadIdx.x >= 16) wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
}

// A matrix load from a pointer 16 bytes past a 32-byte boundary.
__global__ void wmma_misaligned(const __half* a, float* d) {
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, a + 8, 16);
  d[threadIdx.x] = __half2float(fa.x[0]);
}

}  // namespace

MINI_VLLM_EMU_OP(wmma_multiply) {
  const auto* a = static_cast<const __half*>(req.buffer("a"));
  const auto* bt = static_cast<const __half*>(req.buffer("bt"));
  const auto* c = static_cast<const float*>(req.buffer("c"));
  auto* d = static_cast<float*>(req.buffer("d"));
  const int m = static_cast<int>(req.integer("m"));
  if (m == 32) {
    const auto kernel = wmma_multiply<32, 8, 16>;
    MINI_VLLM_LAUNCH(kernel, 1, 32, 0, nullptr)(a, bt, c, d);
  } else if (m == 8) {
    const auto kernel = wmma_multiply<8, 32, 16>;
    MINI_VLLM_LAUNCH(kernel, 1, 32, 0, nullptr)(a, bt, c, d);
  } else {
    const auto kernel = wmma_multiply<16, 16, 16>;
    MINI_VLLM_LAUNCH(kernel, 1, 32, 0, nullptr)(a, bt, c, d);
  }
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(wmma_in_branch) {
  MINI_VLLM_LAUNCH(wmma_in_branch, 1, 32, 0, nullptr)(static_cast<float*>(req.buffer("d")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(wmma_misaligned) {
  MINI_VLLM_LAUNCH(wmma_misaligned, 1, 32, 0, nullptr)(
      static_cast<const __half*>(req.buffer("a")), static_cast<float*>(req.buffer("d")));
  status(cudaGetLastError());
}

namespace {
}  // namespace

MINI_VLLM_EMU_OP(convert) {
  MINI_VLLM_LAUNCH(convert, 1, 64, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")),
      static_cast<unsigned short*>(req.buffer("half_bits")),
      static_cast<unsigned short*>(req.buffer("bf16_bits")),
      static_cast<const unsigned short*>(req.buffer("all_bits")),
      static_cast<float*>(req.buffer("from_half")), static_cast<float*>(req.buffer("from_bf16")),
      static_cast<int>(req.integer("n")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(convert_fp8) {
  MINI_VLLM_LAUNCH(convert_fp8, 1, 64, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")),
      static_cast<unsigned char*>(req.buffer("fp8_bits")),
      static_cast<float*>(req.buffer("from_fp8")), static_cast<int>(req.integer("n")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(warp_ops) {
  MINI_VLLM_LAUNCH(warp_ops, 1, static_cast<int>(req.integer("threads")), 0, nullptr)(
      static_cast<const float*>(req.buffer("in")), static_cast<float*>(req.buffer("out")),
      static_cast<int*>(req.buffer("votes")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(fresh_shared) {
  MINI_VLLM_LAUNCH(fresh_shared, 2, 64, 64 * sizeof(float), nullptr)(
      static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(shared_sum) {
  MINI_VLLM_LAUNCH(shared_sum, static_cast<int>(req.integer("blocks")), 128, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")), static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(early_exit) {
  MINI_VLLM_LAUNCH(early_exit, dim3(2, 1, 3), 64, 0, nullptr)(
      static_cast<float*>(req.buffer("out")), static_cast<int>(req.integer("quitter")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(two_barriers) {
  MINI_VLLM_LAUNCH(two_barriers, 1, 64, 0, nullptr)(static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(shuffle_in_branch) {
  MINI_VLLM_LAUNCH(shuffle_in_branch, 1, 64, 0, nullptr)(static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(shuffle_outside_mask) {
  MINI_VLLM_LAUNCH(shuffle_outside_mask, 1, 32, 0, nullptr)(
      static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(read_past_end) {
  MINI_VLLM_LAUNCH(read_past_end, 1, 32, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")), static_cast<float*>(req.buffer("out")),
      static_cast<int>(req.integer("n")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(write_input) {
  MINI_VLLM_LAUNCH(write_input, 1, 32, 0, nullptr)(static_cast<float*>(req.buffer("in")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(race_on_shared) {
  MINI_VLLM_LAUNCH(race_on_shared, 1, 128, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")), static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(race_between_blocks) {
  MINI_VLLM_LAUNCH(race_between_blocks, 2, 32, 0, nullptr)(static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(misaligned_vector_load) {
  MINI_VLLM_LAUNCH(misaligned_vector_load, 1, 32, 0, nullptr)(
      static_cast<const float*>(req.buffer("in")), static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(int_overflow) {
  MINI_VLLM_LAUNCH(int_overflow, 1, 32, 0, nullptr)(static_cast<const int*>(req.buffer("in")),
                                                    static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

MINI_VLLM_EMU_OP(big_static_shared) {
  MINI_VLLM_LAUNCH(big_static_shared, 1, 32, 0, nullptr)(static_cast<float*>(req.buffer("out")));
  status(cudaGetLastError());
}

// The shared-memory opt-in, as a launcher does it: out = [opt-in limit, error of launching with
// `bytes` dynamic bytes without opting in, error of opting in, error of the launch after it].
// A launch whose dynamic shared memory does not end on a 16-byte boundary.
MINI_VLLM_EMU_OP(dynamic_shared_tail) {
  const int bytes = static_cast<int>(req.integer("bytes"));
  MINI_VLLM_LAUNCH(dynamic_shared_user, 1, 32, bytes, nullptr)(static_cast<float*>(req.buffer("out")));
  mini_vllm_emu::report_status(0, "");
}

MINI_VLLM_EMU_OP(dynamic_shared_optin) {
  const int bytes = static_cast<int>(req.integer("bytes"));
  int* result = static_cast<int*>(req.buffer("result"));
  float* out = static_cast<float*>(req.buffer("out"));
  cudaDeviceGetAttribute(&result[0], cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  MINI_VLLM_LAUNCH(dynamic_shared_user, 1, 32, bytes, nullptr)(out);
  result[1] = cudaGetLastError();
  result[2] = cudaFuncSetAttribute(dynamic_shared_user, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   bytes);
  MINI_VLLM_LAUNCH(dynamic_shared_user, 1, 32, bytes, nullptr)(out);
  result[3] = cudaGetLastError();
  mini_vllm_emu::report_status(0, "");
}
