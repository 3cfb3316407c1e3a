// The cache-management kernels the engine needs around attention:
//   reshape_and_cache  write new tokens' keys and values into their slots of the paged cache;
//   copy_blocks        copy whole blocks inside the caches of every layer (copy-on-write);
//   swap_blocks        copy whole blocks between a GPU cache and a CPU cache (swapping).
//
// upstream: csrc/cache_kernels.cu:214 @ v0.11.0 (reshape_and_cache_kernel)
// upstream: csrc/cache_kernels.cu:76 @ v0.11.0 (copy_blocks_kernel)
// upstream: csrc/cache_kernels.cu:28 @ v0.11.0 (swap_blocks)
#include "common.cuh"
#include "dispatch.cuh"

namespace mini_vllm {

// One thread block per token; its threads walk the token's num_kv_heads * head_size elements.
// Element d of head h goes to key_cache[block, h, d / x, offset, d % x] (16-byte chunks of a key
// are interleaved across the block's tokens) and to value_cache[block, h, d, offset]. T is the
// model's dtype; CacheT the cache's (T, or __nv_fp8_e4m3: then x = 16 and each element is stored
// quantized with its scale, key / k_scale and value / v_scale).
// upstream: csrc/cache_kernels.cu:260 @ v0.11.0 (the fp8 write)
template <typename T, typename CacheT>
__global__ void reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  constexpr int X = 16 / static_cast<int>(sizeof(CacheT));
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  // A negative slot marks a padding token. A slot past the cache cannot be written safely; the
  // Python wrapper documents that slots are trusted, and this keeps memory safe regardless.
  if (slot < 0 || slot >= p.num_blocks * p.block_size) return;
  const int64_t block = slot / p.block_size;
  const int offset = static_cast<int>(slot % p.block_size);

  const T* key = static_cast<const T*>(p.key) + token * p.key_stride;
  const T* value = static_cast<const T*>(p.value) + token * p.value_stride;
  CacheT* key_cache = static_cast<CacheT*>(p.key_cache);
  CacheT* value_cache = static_cast<CacheT*>(p.value_cache);
  const int64_t head_elems = static_cast<int64_t>(p.head_size) * p.block_size;  // per (block, head)

  const int n = p.num_kv_heads * p.head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.head_size;
    const int d = i % p.head_size;
    const int64_t head_base = (block * p.num_kv_heads + h) * head_elems;
    key_cache[head_base + (static_cast<int64_t>(d / X) * p.block_size + offset) * X + d % X] =
        to_cache<CacheT>(key[i], p.k_scale);
    value_cache[head_base + static_cast<int64_t>(d) * p.block_size + offset] =
        to_cache<CacheT>(value[i], p.v_scale);
  }
}

Status launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return ok();
  const int threads = const_min(p.num_kv_heads * p.head_size, 512);
  return dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    return dispatch_cache_type<T>(p.kv_cache_dtype, [&](auto cache_tag) {
      const auto kernel = reshape_and_cache_kernel<T, typename decltype(cache_tag)::type>;
      MINI_VLLM_LAUNCH(kernel, p.num_tokens, threads, 0, stream)(p);
      return cuda_status(cudaGetLastError());
    });
  });
}

// Grid (num_layers, num_pairs): one thread block copies one block of one layer's key and value
// caches, 16 bytes per thread and step (a block is a whole number of 16-byte chunks).
__global__ void copy_blocks_kernel(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                                   const int64_t* block_mapping, int64_t chunks_per_block) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  uint4* keys = reinterpret_cast<uint4*>(key_cache_ptrs[layer]);
  uint4* values = reinterpret_cast<uint4*>(value_cache_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < chunks_per_block; i += blockDim.x) {
    keys[dst * chunks_per_block + i] = keys[src * chunks_per_block + i];
    values[dst * chunks_per_block + i] = values[src * chunks_per_block + i];
  }
}

Status launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                          const int64_t* block_mapping, int num_layers, int num_pairs,
                          int64_t bytes_per_block, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0) return ok();
  if (bytes_per_block % 16 != 0) return unsupported("a cache block must be a multiple of 16 bytes");
  const int64_t chunks = bytes_per_block / 16;
  const int threads = static_cast<int>(chunks < 256 ? chunks : 256);
  const dim3 grid(num_layers, num_pairs);
  MINI_VLLM_LAUNCH(copy_blocks_kernel, grid, threads, 0, stream)(key_cache_ptrs, value_cache_ptrs,
                                                                 block_mapping, chunks);
  return cuda_status(cudaGetLastError());
}

Status launch_swap_blocks(char* dst, const char* src, const int64_t* block_mapping, int num_pairs,
                          int64_t bytes_per_block, cudaMemcpyKind kind, cudaStream_t stream) {
  for (int i = 0; i < num_pairs; ++i) {
    const int64_t src_block = block_mapping[2 * i];
    const int64_t dst_block = block_mapping[2 * i + 1];
    const cudaError_t err =
        cudaMemcpyAsync(dst + dst_block * bytes_per_block, src + src_block * bytes_per_block,
                        bytes_per_block, kind, stream);
    if (err != cudaSuccess) return cuda_status(err);
  }
  return ok();
}

}  // namespace mini_vllm
