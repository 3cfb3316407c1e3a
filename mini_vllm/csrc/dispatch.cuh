// Turns the run-time dtype, head size and block size into template arguments.
//
// Each kernel is compiled once per (element type, head size, block size) so that all loop bounds
// are compile-time constants: the loops unroll and the per-thread arrays live in registers.
// Defining MINI_VLLM_COMPILE_CHECK builds a small subset (all dtypes, head size 128, block 16),
// which is what the CPU-side compile test uses to stay fast on a small machine.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernel_params.h"

namespace mini_vllm {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int N>
using IntTag = std::integral_constant<int, N>;

// Calls fn(TypeTag<T>{}, IntTag<HEAD_SIZE>{}, IntTag<BLOCK_SIZE>{}) and returns its Status, or
// an "unsupported" Status naming the value that has no compiled kernel.
template <typename Fn>
Status dispatch_attention(DType dtype, int head_size, int block_size, Fn&& fn) {
  auto by_block = [&](auto type_tag, auto head_tag) -> Status {
    switch (block_size) {
#ifndef MINI_VLLM_COMPILE_CHECK
      case 8: return fn(type_tag, head_tag, IntTag<8>{});
      case 32: return fn(type_tag, head_tag, IntTag<32>{});
#endif
      case 16: return fn(type_tag, head_tag, IntTag<16>{});
      default: return unsupported("block size must be 8, 16 or 32");
    }
  };
  auto by_head = [&](auto type_tag) -> Status {
    switch (head_size) {
#ifndef MINI_VLLM_COMPILE_CHECK
      case 64: return by_block(type_tag, IntTag<64>{});
      case 80: return by_block(type_tag, IntTag<80>{});
      case 96: return by_block(type_tag, IntTag<96>{});
      case 112: return by_block(type_tag, IntTag<112>{});
      case 256: return by_block(type_tag, IntTag<256>{});
#endif
      case 128: return by_block(type_tag, IntTag<128>{});
      default: return unsupported("head size must be 64, 80, 96, 112, 128 or 256");
    }
  };
  switch (dtype) {
    case DType::kFloat32: return by_head(TypeTag<float>{});
    case DType::kFloat16: return by_head(TypeTag<__half>{});
    case DType::kBFloat16: return by_head(TypeTag<__nv_bfloat16>{});
  }
  return unsupported("dtype must be float32, float16 or bfloat16");
}

// The same, over the dtype only (for kernels whose sizes are run-time values).
template <typename Fn>
Status dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(TypeTag<float>{});
    case DType::kFloat16: return fn(TypeTag<__half>{});
    case DType::kBFloat16: return fn(TypeTag<__nv_bfloat16>{});
  }
  return unsupported("dtype must be float32, float16 or bfloat16");
}

}  // namespace mini_vllm
