// Paged attention v1: one thread block per (query head, sequence) attends over the whole context.
// Grid (num_heads, num_seqs); all logits of a sequence sit in shared memory at once, so the
// longest context is bounded by the shared memory of one block (about 56K tokens on an H100).
//
// upstream: csrc/attention/attention_kernels.cuh:497 @ v0.11.0 (kernel)
// upstream: csrc/attention/paged_attention_v1.cu:46 @ v0.11.0 (launcher)
#include "attention_core.cuh"
#include "dispatch.cuh"

namespace mini_vllm {

constexpr int kV1Threads = 128;

// T: the model's dtype (query, output); CacheT: the cache's elements (T, or __nv_fp8_e4m3).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_v1_kernel(const PagedAttentionParams p) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = clamped_seq_len(p, seq);
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_heads + head) * HEAD_SIZE;
  attend_blocks<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, CacheT>(
      p, seq, head, seq_len, 0, div_round_up(seq_len, BLOCK_SIZE), out, nullptr, nullptr);
}

template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_v1(const PagedAttentionParams& p, cudaStream_t stream) {
  const auto kernel = paged_attention_v1_kernel<T, CacheT, HEAD_SIZE, BLOCK_SIZE, kV1Threads>;
  const int slots = div_round_up(p.max_seq_len, BLOCK_SIZE) * BLOCK_SIZE;
  const int smem = attention_smem_bytes<HEAD_SIZE, kV1Threads>(slots);
  const int static_smem = attention_static_smem_bytes<HEAD_SIZE, kV1Threads>();
  if (smem + static_smem > 48 * 1024) {
    // Past 48 KB a block must opt in, up to the device's limit minus the static shared memory.
    int device = 0, optin = 0;
    cudaFuncAttributes attrs{};
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
    if (err != cudaSuccess) return cuda_status(err);
    if (smem > optin - const_max(static_smem, static_cast<int>(attrs.sharedSizeBytes))) {
      return unsupported(
          "max_seq_len is too long for paged_attention_v1 (its logits do not fit in shared "
          "memory); use paged_attention_v2");
    }
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cuda_status(err);
  }
  const dim3 grid(p.num_heads, p.num_seqs);
  MINI_VLLM_LAUNCH(kernel, grid, kV1Threads, smem, stream)(p);
  return cuda_status(cudaGetLastError());
}

Status launch_paged_attention_v1(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0) return ok();  // an empty grid is not a valid launch
  return dispatch_attention_kv(
      p.dtype, p.kv_cache_dtype, p.head_size, p.block_size,
      [&](auto type_tag, auto cache_tag, auto head_tag, auto block_tag) {
        return launch_v1<typename decltype(type_tag)::type, typename decltype(cache_tag)::type,
                          decltype(head_tag)::value, decltype(block_tag)::value>(p, stream);
      });
}

}  // namespace mini_vllm
