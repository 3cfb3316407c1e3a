// Turns the run-time dtype, head size and block size into template arguments.
//
// Each kernel is compiled once per (element type, head size, block size) so that all loop bounds
// are compile-time constants: the loops unroll and the per-thread arrays live in registers.
//
// A build may compile fewer instantiations by defining the lists it wants (the others then
// return an "unsupported" Status naming the missing value):
//   MINI_VLLM_DTYPES       DType values, default 0, 1, 2 (fp32, fp16, bf16)
//   MINI_VLLM_HEAD_SIZES   default 64, 80, 96, 112, 128, 256
//   MINI_VLLM_BLOCK_SIZES  default 8, 16, 32
//   MINI_VLLM_KV_CACHE_DTYPES  KVCacheDType values, default 0, 1 (auto: the model's dtype; fp8)
// (0 alone means none; for the cache dtypes 0 is kAuto and -1 alone means none.) The decode
// kernels are built for an fp8 cache with each model dtype, which doubles their instantiations,
// as upstream's are. The CPU emulation builds one combination per executable; defining
// MINI_VLLM_COMPILE_CHECK keeps every dtype and both cache dtypes with head size 128 and block
// size 16, which is what the compile tests use to stay fast on a small machine.
#pragma once

#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernel_params.h"

#if defined(MINI_VLLM_COMPILE_CHECK)
#ifndef MINI_VLLM_HEAD_SIZES
#define MINI_VLLM_HEAD_SIZES 128
#endif
#ifndef MINI_VLLM_BLOCK_SIZES
#define MINI_VLLM_BLOCK_SIZES 16
#endif
#endif
#ifndef MINI_VLLM_DTYPES
#define MINI_VLLM_DTYPES 0, 1, 2
#endif
#ifndef MINI_VLLM_HEAD_SIZES
#define MINI_VLLM_HEAD_SIZES 64, 80, 96, 112, 128, 256
#endif
#ifndef MINI_VLLM_BLOCK_SIZES
#define MINI_VLLM_BLOCK_SIZES 8, 16, 32
#endif
#ifndef MINI_VLLM_KV_CACHE_DTYPES
#define MINI_VLLM_KV_CACHE_DTYPES 0, 1
#endif

namespace mini_vllm {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int N>
using IntTag = std::integral_constant<int, N>;

constexpr bool in_list(std::initializer_list<int> list, int value) {
  for (int x : list) {
    if (x == value) return true;
  }
  return false;
}
constexpr bool dtype_built(DType d) { return in_list({MINI_VLLM_DTYPES}, static_cast<int>(d)); }
constexpr bool head_size_built(int h) { return in_list({MINI_VLLM_HEAD_SIZES}, h); }
constexpr bool block_size_built(int b) { return in_list({MINI_VLLM_BLOCK_SIZES}, b); }
constexpr bool kv_cache_dtype_built(KVCacheDType d) {
  return in_list({MINI_VLLM_KV_CACHE_DTYPES}, static_cast<int>(d));
}

inline Status not_built(const char* what) { return unsupported(what); }

// The same, over the dtype only (for kernels whose sizes are run-time values).
template <typename Fn>
Status dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      if constexpr (dtype_built(DType::kFloat32)) return fn(TypeTag<float>{});
      break;
    case DType::kFloat16:
      if constexpr (dtype_built(DType::kFloat16)) return fn(TypeTag<__half>{});
      break;
    case DType::kBFloat16:
      if constexpr (dtype_built(DType::kBFloat16)) return fn(TypeTag<__nv_bfloat16>{});
      break;
    default:
      return unsupported("dtype must be float32, float16 or bfloat16");
  }
  return not_built("this build has no kernel for that dtype (MINI_VLLM_DTYPES)");
}

// Calls fn(TypeTag<T>{}, IntTag<HEAD_SIZE>{}, IntTag<BLOCK_SIZE>{}) and returns its Status, or
// an "unsupported" Status naming the value that has no compiled kernel.
template <typename Fn>
Status dispatch_attention(DType dtype, int head_size, int block_size, Fn&& fn) {
  auto by_block = [&](auto type_tag, auto head_tag) -> Status {
    switch (block_size) {
      case 8:
        if constexpr (block_size_built(8)) return fn(type_tag, head_tag, IntTag<8>{});
        break;
      case 16:
        if constexpr (block_size_built(16)) return fn(type_tag, head_tag, IntTag<16>{});
        break;
      case 32:
        if constexpr (block_size_built(32)) return fn(type_tag, head_tag, IntTag<32>{});
        break;
      default:
        return unsupported("block size must be 8, 16 or 32");
    }
    return not_built("this build has no kernel for that block size (MINI_VLLM_BLOCK_SIZES)");
  };
  auto by_head = [&](auto type_tag) -> Status {
    switch (head_size) {
      case 64:
        if constexpr (head_size_built(64)) return by_block(type_tag, IntTag<64>{});
        break;
      case 80:
        if constexpr (head_size_built(80)) return by_block(type_tag, IntTag<80>{});
        break;
      case 96:
        if constexpr (head_size_built(96)) return by_block(type_tag, IntTag<96>{});
        break;
      case 112:
        if constexpr (head_size_built(112)) return by_block(type_tag, IntTag<112>{});
        break;
      case 128:
        if constexpr (head_size_built(128)) return by_block(type_tag, IntTag<128>{});
        break;
      case 256:
        if constexpr (head_size_built(256)) return by_block(type_tag, IntTag<256>{});
        break;
      default:
        return unsupported("head size must be 64, 80, 96, 112, 128 or 256");
    }
    return not_built("this build has no kernel for that head size (MINI_VLLM_HEAD_SIZES)");
  };
  return dispatch_dtype(dtype, by_head);
}

// Calls fn(TypeTag<CacheT>{}) with the element type of a cache for model dtype T: T itself for
// kAuto, __nv_fp8_e4m3 for kFp8E4M3.
// upstream: csrc/attention/paged_attention_v1.cu:180 @ v0.11.0 (DISPATCH_BY_KV_CACHE_DTYPE)
template <typename T, typename Fn>
Status dispatch_cache_type(KVCacheDType kv_cache_dtype, Fn&& fn) {
  switch (kv_cache_dtype) {
    case KVCacheDType::kAuto:
      if constexpr (kv_cache_dtype_built(KVCacheDType::kAuto)) return fn(TypeTag<T>{});
      break;
    case KVCacheDType::kFp8E4M3:
      if constexpr (kv_cache_dtype_built(KVCacheDType::kFp8E4M3)) {
        return fn(TypeTag<__nv_fp8_e4m3>{});
      }
      break;
    default:
      return unsupported("the KV cache dtype must be auto (the model's) or fp8 (e4m3)");
  }
  return not_built("this build has no kernel for that KV cache dtype (MINI_VLLM_KV_CACHE_DTYPES)");
}

// dispatch_attention with the cache's element type too: calls
// fn(TypeTag<T>{}, TypeTag<CacheT>{}, IntTag<HEAD_SIZE>{}, IntTag<BLOCK_SIZE>{}).
template <typename Fn>
Status dispatch_attention_kv(DType dtype, KVCacheDType kv_cache_dtype, int head_size,
                             int block_size, Fn&& fn) {
  return dispatch_attention(dtype, head_size, block_size,
                            [&](auto type_tag, auto head_tag, auto block_tag) -> Status {
                              using T = typename decltype(type_tag)::type;
                              return dispatch_cache_type<T>(kv_cache_dtype, [&](auto cache_tag) {
                                return fn(type_tag, cache_tag, head_tag, block_tag);
                              });
                            });
}

// The kernels that read a cache in the model's dtype only (the probes, the lab's starter.cu)
// refuse an fp8 cache with this.
inline Status refuse_fp8_cache(KVCacheDType kv_cache_dtype, const char* what) {
  return kv_cache_dtype == KVCacheDType::kAuto ? ok() : unsupported(what);
}

}  // namespace mini_vllm
