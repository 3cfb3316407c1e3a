// The CUDA subset that mini_vllm's kernels use, for the host C++ compiler.
//
// With this header (reached through the shims in emulation/include/, which stand in for
// <cuda_runtime_api.h>, <cuda_fp16.h> and <cuda_bf16.h>) the unmodified kernel sources compile
// with g++ or clang++ and run on the CPU:
//   * a kernel is an ordinary function; MINI_VLLM_LAUNCH (portable.cuh) hands it to the runtime
//     (runtime.cpp), which runs the grid's blocks one after another and each thread of a block as
//     a cooperative fiber on one OS thread;
//   * __syncthreads() and the warp collectives (__shfl*_sync, __syncwarp, __ballot_sync, ...)
//     are rendezvous points: a fiber runs until it reaches one and waits there until every
//     thread the collective names has arrived at the *same* call site. Anything else (a thread
//     that exits or waits elsewhere, a lane missing from a shuffle) is reported as an error that
//     names the kernel, the block, the threads and the source lines, instead of hanging;
//   * __shared__ storage (MINI_VLLM_SHARED / MINI_VLLM_DYNAMIC_SHARED) is allocated fresh for
//     every block and filled with 0xff bytes, a NaN in every floating-point type, so a read of
//     shared memory that no thread wrote shows up in the output;
//   * the runtime API calls the kernels' launchers make (attributes, shared-memory opt-in,
//     cudaGetLastError, cudaMemcpyAsync) behave like those of the modelled device
//     (MINI_VLLM_EMU_DEVICE: default, t4, a100, h100).
// Nothing here is specific to one kernel. What the emulator does not model (timing, the memory
// model beyond barrier ordering, warp-synchronous code without collectives, texture instructions,
// the layout of tensor-core fragments: wmma is emulated with a layout of its own) is listed in the lab 02-06 README.
#pragma once

#define MINI_VLLM_EMULATION 1

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- keywords ---------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Shared memory must be declared through portable.cuh, which gives every block fresh storage.
#define __shared__ \
  _Pragma("GCC error \"the CPU emulation needs MINI_VLLM_SHARED or MINI_VLLM_DYNAMIC_SHARED (portable.cuh) instead of __shared__\"")
// __restrict__ is understood by g++ and clang++ as it is.

// ---- vector and index types -------------------------------------------------------------------

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return {x, y, z}; }
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(4) ushort2 {
  unsigned short x, y;
};
struct alignas(8) ushort4 {
  unsigned short x, y, z, w;
};

// ---- 16-bit floating point ----------------------------------------------------------------------
// Bit-exact conversions (round to nearest even, as the __*_rn intrinsics do). Arithmetic
// operators are left out on purpose, as in a build with __CUDA_NO_HALF_OPERATORS__ (what torch
// passes to nvcc): kernels convert to float and compute in fp32.

namespace mini_vllm_emu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline unsigned short float_to_half_rn(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<unsigned short>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<unsigned short>(sign | 0x7c00u);  // overflow: infinity
  if (e <= 0) {                                                        // subnormal or zero
    if (e < -10) return static_cast<unsigned short>(sign);
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<unsigned short>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may round up to infinity
  return static_cast<unsigned short>(sign | h);
}

inline float half_to_float(unsigned short h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline unsigned short float_to_bfloat16_rn(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((x >> 16) | 0x40u);
  return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat16_to_float(unsigned short b) { return bits_float(static_cast<uint32_t>(b) << 16); }

}  // namespace mini_vllm_emu

struct alignas(2) __half {
  unsigned short __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
using half = __half;
using half2 = __half2;

inline float __half2float(__half h) { return mini_vllm_emu::half_to_float(h.__x); }
inline __half __float2half_rn(float f) { return {mini_vllm_emu::float_to_half_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }

inline float __bfloat162float(__nv_bfloat16 b) { return mini_vllm_emu::bfloat16_to_float(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {mini_vllm_emu::float_to_bfloat16_rn(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return {__bfloat162float(b.x), __bfloat162float(b.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// ---- device math and bit helpers ----------------------------------------------------------------

inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float_as_int(float f) { return static_cast<int>(mini_vllm_emu::float_bits(f)); }
inline unsigned __float_as_uint(float f) { return mini_vllm_emu::float_bits(f); }
inline float __int_as_float(int i) { return mini_vllm_emu::bits_float(static_cast<uint32_t>(i)); }
inline float __uint_as_float(unsigned u) { return mini_vllm_emu::bits_float(u); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Atomics: fibers switch only at rendezvous points, so any read-modify-write is atomic here; the
// __atomic builtins tell ThreadSanitizer that these accesses are meant to be concurrent.
template <typename T>
inline T atomicAdd(T* address, T val) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
  } else {
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, static_cast<T>(old + val), false,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
  }
}
template <typename T>
inline T atomicMax(T* address, T val) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < val && !__atomic_compare_exchange_n(address, &old, val, false, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* address, T val) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (val < old && !__atomic_compare_exchange_n(address, &old, val, false, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicExch(T* address, T val) {
  return __atomic_exchange_n(address, val, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicCAS(T* address, T compare, T val) {
  __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}

// ---- runtime API types ------------------------------------------------------------------------

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorNotSupported = 801,
};
typedef enum cudaError cudaError_t;
typedef struct CUstream_st* cudaStream_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

struct cudaFuncAttributes {
  size_t sharedSizeBytes;  // static shared memory (as far as the emulator has seen it run)
  size_t constSizeBytes;
  size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
  int cacheModeCA;
  int maxDynamicSharedSizeBytes;
  int preferredShmemCarveout;
};

// ---- the runtime's interface (runtime.cpp) ------------------------------------------------------

namespace mini_vllm_emu {

enum class Op : int {
  kSyncThreads,
  kSyncThreadsCount,
  kSyncThreadsAnd,
  kSyncThreadsOr,
  kSyncWarp,
  kShflIdx,
  kShflUp,
  kShflDown,
  kShflXor,
  kBallot,
  kAny,
  kAll,
  kWmmaLoad,
  kWmmaStore,
  kWmmaMma,
};

// What a fiber sees of itself; the scheduler points g_thread at the running fiber's record.
struct ThreadIndex {
  uint3 thread_idx;
};
extern ThreadIndex* g_thread;
extern uint3 g_block_idx;
extern dim3 g_block_dim;
extern dim3 g_grid_dim;

// A block-wide barrier; returns the reduction of `predicate` that `op` asks for.
int block_barrier(Op op, int predicate, const char* file, int line);
// A warp collective over the lanes in `mask`. `bits` holds `bytes` bytes of this lane's value
// (shuffles) or its predicate (votes); `arg` is the source lane / delta / xor mask of a shuffle.
// Returns this lane's result in the same form.
uint64_t warp_collective(Op op, unsigned mask, uint64_t bits, int bytes, int arg, int width,
                         const char* file, int line);

// After a warp collective completes: the `bits` every lane of the calling thread's warp passed
// to it (32 entries, by lane).
const uint64_t* warp_lane_bits();
// Reports a misuse of a CUDA API inside a kernel (with the kernel, block and thread) and exits.
[[noreturn]] void usage_error(const std::string& message);

// The storage of one __shared__ declaration in the running block: allocated and filled with
// 0xff on first use in the block, then the same for every thread of it. `key` identifies it.
void* shared_array(const void* key, size_t bytes, size_t align, const char* name,
                   const char* file, int line);
// The block's dynamic shared memory (the launch's byte count, filled with 0xff).
void* dynamic_shared(size_t align, const char* name, const char* file, int line);

// Runs a launch: `run(closure)` executes the kernel body for the current fiber.
cudaError_t launch(const void* kernel, const char* kernel_expr, dim3 grid, dim3 block,
                   size_t dynamic_smem, void (*run)(void*), void* closure, const char* file,
                   int line);

cudaError_t func_get_attributes(cudaFuncAttributes* attr, const void* kernel);
cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value);

// A launch whose arguments come later, like `kernel<<<...>>>(args)`.
template <typename Kernel>
class Launcher {
 public:
  Launcher(Kernel* kernel, const char* expr, dim3 grid, dim3 block, size_t smem, const char* file,
           int line)
      : kernel_(kernel), expr_(expr), grid_(grid), block_(block), smem_(smem), file_(file),
        line_(line) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    // Like a real launch, the arguments are copied once; every thread reads that copy.
    using Tuple = std::tuple<std::decay_t<Args>...>;
    struct Closure {
      Kernel* kernel;
      Tuple args;
    } closure{kernel_, Tuple(std::forward<Args>(args)...)};
    auto run = [](void* c) {
      auto* self = static_cast<Closure*>(c);
      std::apply(self->kernel, self->args);
    };
    launch(reinterpret_cast<const void*>(kernel_), expr_, grid_, block_, smem_, +run, &closure,
           file_, line_);
  }

 private:
  Kernel* kernel_;
  const char* expr_;
  dim3 grid_, block_;
  size_t smem_;
  const char* file_;
  int line_;
};

template <typename Bits, typename T>
inline Bits to_bits(const T& v) {
  static_assert(std::is_trivially_copyable_v<T>, "a shuffled value must be trivially copyable");
  static_assert(sizeof(T) <= sizeof(Bits), "a shuffled value has at most 8 bytes");
  Bits b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T, typename Bits>
inline T from_bits(Bits b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace mini_vllm_emu

// ---- thread indices ---------------------------------------------------------------------------

#define threadIdx (::mini_vllm_emu::g_thread->thread_idx)
#define blockIdx (::mini_vllm_emu::g_block_idx)
#define blockDim (::mini_vllm_emu::g_block_dim)
#define gridDim (::mini_vllm_emu::g_grid_dim)
constexpr int warpSize = 32;

// ---- barriers and warp collectives --------------------------------------------------------------
// The trailing defaulted arguments record the call site (the caller's file and line), which is
// how the runtime decides that two threads wait at the same collective.

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  mini_vllm_emu::block_barrier(mini_vllm_emu::Op::kSyncThreads, 0, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
  return mini_vllm_emu::block_barrier(mini_vllm_emu::Op::kSyncThreadsCount, predicate != 0, file,
                                      line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  return mini_vllm_emu::block_barrier(mini_vllm_emu::Op::kSyncThreadsAnd, predicate != 0, file,
                                      line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  return mini_vllm_emu::block_barrier(mini_vllm_emu::Op::kSyncThreadsOr, predicate != 0, file,
                                      line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  mini_vllm_emu::warp_collective(mini_vllm_emu::Op::kSyncWarp, mask, 0, 0, 0, 32, file, line);
}

#define MINI_VLLM_EMU_SHUFFLE(NAME, OP)                                                          \
  template <typename T>                                                                          \
  inline T NAME(unsigned mask, T var, int arg, int width = warpSize,                             \
                const char* file = __builtin_FILE(), int line = __builtin_LINE()) {              \
    const uint64_t bits = mini_vllm_emu::warp_collective(                                        \
        mini_vllm_emu::Op::OP, mask, mini_vllm_emu::to_bits<uint64_t>(var),                      \
        static_cast<int>(sizeof(T)), arg, width, file, line);                                    \
    return mini_vllm_emu::from_bits<T>(bits);                                                    \
  }
MINI_VLLM_EMU_SHUFFLE(__shfl_sync, kShflIdx)
MINI_VLLM_EMU_SHUFFLE(__shfl_up_sync, kShflUp)
MINI_VLLM_EMU_SHUFFLE(__shfl_down_sync, kShflDown)
MINI_VLLM_EMU_SHUFFLE(__shfl_xor_sync, kShflXor)
#undef MINI_VLLM_EMU_SHUFFLE

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return static_cast<unsigned>(mini_vllm_emu::warp_collective(
      mini_vllm_emu::Op::kBallot, mask, predicate != 0, 4, 0, 32, file, line));
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(mini_vllm_emu::warp_collective(mini_vllm_emu::Op::kAny, mask,
                                                         predicate != 0, 4, 0, 32, file, line));
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(mini_vllm_emu::warp_collective(mini_vllm_emu::Op::kAll, mask,
                                                         predicate != 0, 4, 0, 32, file, line));
}

// ---- host runtime API -----------------------------------------------------------------------------

const char* cudaGetErrorString(cudaError_t err);
const char* cudaGetErrorName(cudaError_t err);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);

inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* kernel) {
  return mini_vllm_emu::func_get_attributes(attr, kernel);
}
template <typename R, typename... A>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, R (*kernel)(A...)) {
  return mini_vllm_emu::func_get_attributes(attr, reinterpret_cast<const void*>(kernel));
}
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  return mini_vllm_emu::func_set_attribute(kernel, attr, value);
}
template <typename R, typename... A>
inline cudaError_t cudaFuncSetAttribute(R (*kernel)(A...), cudaFuncAttribute attr, int value) {
  return mini_vllm_emu::func_set_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// ---- tensor cores: nvcuda::wmma ---------------------------------------------------------------------
// The warp-level matrix API of <mma.h>, computed in fp32 on the CPU. A fragment's layout across
// the lanes is unspecified by CUDA; here lane l holds elements l * E ... l * E + E - 1 of the
// matrix in row-major order (E = rows * cols / 32). load_matrix_sync, store_matrix_sync and
// mma_sync are warp collectives: every lane of the warp must reach the same call, as with the
// shuffles, and the pointer must be 256-bit aligned and ldm a multiple of 16 bytes, as CUDA
// requires. A load reads memory after every lane has arrived, so shared-memory stores made
// before it by any lane are seen (a GPU needs __syncwarp() for that; see the kernels).

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <typename Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};
inline float as_float(float v) { return v; }
inline float as_float(__half v) { return __half2float(v); }
inline float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

inline unsigned lane_id() {
  const uint3 t = threadIdx;
  return (t.x + blockDim.x * (t.y + blockDim.y * t.z)) % 32;
}

// The rendezvous of a wmma call: all 32 lanes, at the same call site; `bits` travels to the
// others (warp_lane_bits). Checks the pointer and ldm first, as the hardware requires.
inline void arrive(mini_vllm_emu::Op op, const void* ptr, unsigned ldm, size_t elem_bytes,
                   uint64_t bits, const char* file, int line) {
  if (ptr != nullptr) {
    const char* slash = strrchr(file, '/');
    file = slash ? slash + 1 : file;
    const char* what = op == mini_vllm_emu::Op::kWmmaLoad ? "wmma::load_matrix_sync"
                                                           : "wmma::store_matrix_sync";
    if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0) {
      char buf[256];
      snprintf(buf, sizeof buf, "%s() at %s:%d: the pointer %p is not 256-bit (32-byte) aligned",
               what, file, line, ptr);
      mini_vllm_emu::usage_error(buf);
    }
    if ((ldm * elem_bytes) % 16 != 0) {
      char buf[256];
      snprintf(buf, sizeof buf, "%s() at %s:%d: ldm %u is not a multiple of 16 bytes (%zu-byte "
               "elements)", what, file, line, ldm, elem_bytes);
      mini_vllm_emu::usage_error(buf);
    }
  }
  mini_vllm_emu::warp_collective(op, 0xffffffffu, bits, 8, 0, 32, file, line);
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
 public:
  static constexpr int rows = detail::Shape<Use, M, N, K>::rows;
  static constexpr int cols = detail::Shape<Use, M, N, K>::cols;
  static_assert(rows * cols % 32 == 0, "a fragment spreads its matrix over the 32 lanes");
  static constexpr int num_elements = rows * cols / 32;
  using element_type = T;
  T x[num_elements];
  // Element (r, c) of the whole matrix lives in lane (r * cols + c) / num_elements.
};

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = static_cast<T>(value);
}
template <typename Use, int M, int N, int K, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, __half, Layout>& f, float value) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = __float2half_rn(value);
}
template <typename Use, int M, int N, int K, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, __nv_bfloat16, Layout>& f, float value) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = __float2bfloat16_rn(value);
}

namespace detail {
template <typename Frag, typename T>
inline void load(Frag& f, const T* ptr, unsigned ldm, bool col_major, const char* file,
                 int line) {
  arrive(mini_vllm_emu::Op::kWmmaLoad, ptr, ldm, sizeof(T), 0, file, line);
  const int first = static_cast<int>(lane_id()) * Frag::num_elements;
  for (int i = 0; i < Frag::num_elements; ++i) {
    const int r = (first + i) / Frag::cols, c = (first + i) % Frag::cols;
    const T v = col_major ? ptr[r + static_cast<size_t>(c) * ldm]
                          : ptr[static_cast<size_t>(r) * ldm + c];
    f.x[i] = from_float<typename Frag::element_type>(as_float(v));
  }
}
}  // namespace detail

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* ptr, unsigned ldm,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  detail::load(f, ptr, ldm, std::is_same_v<Layout, col_major>, file, line);
}
template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* ptr, unsigned ldm,
                             layout_t layout, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  detail::load(f, ptr, ldm, layout == mem_col_major, file, line);
}

template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* ptr, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  using Frag = fragment<accumulator, M, N, K, T>;
  detail::arrive(mini_vllm_emu::Op::kWmmaStore, ptr, ldm, sizeof(T), 0, file, line);
  const int first = static_cast<int>(detail::lane_id()) * Frag::num_elements;
  for (int i = 0; i < Frag::num_elements; ++i) {
    const int r = (first + i) / Frag::cols, c = (first + i) % Frag::cols;
    T& dst = layout == mem_col_major ? ptr[r + static_cast<size_t>(c) * ldm]
                                     : ptr[static_cast<size_t>(r) * ldm + c];
    dst = f.x[i];
  }
}

// D = A * B + C, fp32 accumulation. Two rendezvous: the first publishes every lane's fragments
// (each lane then reads what its own outputs need from the others'), the second makes sure every
// lane has read before any lane writes D (which may be C itself).
template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b,
                     const fragment<accumulator, M, N, K, TC>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using FA = fragment<matrix_a, M, N, K, TA, LA>;
  using FB = fragment<matrix_b, M, N, K, TB, LB>;
  using FC = fragment<accumulator, M, N, K, TC>;
  struct Operands {
    const FA* a;
    const FB* b;
    const FC* c;
  } mine{&a, &b, &c};
  detail::arrive(mini_vllm_emu::Op::kWmmaMma, nullptr, 0, 1,
                 static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&mine)), file, line);
  const uint64_t* lanes = mini_vllm_emu::warp_lane_bits();
  auto operands = [&](int lane) -> const Operands& {
    return *reinterpret_cast<const Operands*>(static_cast<uintptr_t>(lanes[lane]));
  };
  float result[FC::num_elements];
  const int first = static_cast<int>(detail::lane_id()) * FC::num_elements;
  for (int i = 0; i < FC::num_elements; ++i) {
    const int r = (first + i) / N, col = (first + i) % N;
    float sum = detail::as_float(operands((r * N + col) / FC::num_elements)
                                     .c->x[(r * N + col) % FC::num_elements]);
    for (int k = 0; k < K; ++k) {
      const int ia = r * K + k, ib = k * N + col;
      sum += detail::as_float(operands(ia / FA::num_elements).a->x[ia % FA::num_elements]) *
             detail::as_float(operands(ib / FB::num_elements).b->x[ib % FB::num_elements]);
    }
    result[i] = sum;
  }
  detail::arrive(mini_vllm_emu::Op::kWmmaMma, nullptr, 0, 1, 0, file, line);
  for (int i = 0; i < FC::num_elements; ++i) d.x[i] = detail::from_float<TC>(result[i]);
}

}  // namespace wmma
}  // namespace nvcuda
