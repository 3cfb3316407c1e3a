// The three spellings that differ between a CUDA build (nvcc) and the CPU emulation build (the
// host C++ compiler with emulation/cuda_emulation.h): static shared memory, dynamic shared
// memory and a kernel launch. Everything else in the kernels is the same source for both.
//
//   MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);   // __shared__ float q_smem[HEAD_SIZE];
//   MINI_VLLM_DYNAMIC_SHARED(float, logits);         // extern __shared__ float logits[];
//   MINI_VLLM_LAUNCH(kernel, grid, block, smem, stream)(args...);
//                                                    // kernel<<<grid, block, smem, stream>>>(args...);
//
// `kernel` must be one macro argument: a kernel's name, or (for a template, whose arguments
// contain commas) a local `const auto kernel = my_kernel<T, N>;` as the launchers do. The
// emulation refuses a bare __shared__ with a compile error that points here.
#pragma once

#ifdef MINI_VLLM_EMULATION

// Each declaration gets a per-instantiation key (the address of a local static); the runtime
// hands every thread of a block the same fresh storage for it.
#define MINI_VLLM_SHARED(type, name, dims)                                                   \
  static char mini_vllm_shared_key_##name;                                                   \
  type(&name) dims = *static_cast<type(*) dims>(::mini_vllm_emu::shared_array(                \
      &mini_vllm_shared_key_##name, sizeof(type dims), alignof(type), #name, __FILE__, __LINE__))

#define MINI_VLLM_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(           \
      ::mini_vllm_emu::dynamic_shared(alignof(type), #name, __FILE__, __LINE__))

#define MINI_VLLM_LAUNCH(kernel, grid, block, smem, stream) \
  ::mini_vllm_emu::Launcher(kernel, #kernel, grid, block, smem, __FILE__, __LINE__)

#else

#define MINI_VLLM_SHARED(type, name, dims) __shared__ type name dims
#define MINI_VLLM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define MINI_VLLM_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>

#endif
