// The plain-C++ interface between the CUDA kernels and the PyTorch bindings.
//
// Nothing here includes a torch header: the kernels (*.cu) include this file and compile with
// plain nvcc; bindings.cpp includes it too and fills the structs from tensors. Every launcher
// returns a Status instead of throwing, so that the kernel files need no C++ exception support
// from the host side and the bindings decide how an error reaches Python.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mini_vllm {

// Element types the kernels are built for (the model's: query, output, new keys and values).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// What the KV cache holds. kAuto: the model's dtype, read as it is. kFp8E4M3: one e4m3 byte per
// element (__nv_fp8_e4m3, x = 16 per 16-byte chunk), standing for byte * scale with one float
// scale per layer for keys and one for values (k_scale, v_scale); written as
// e4m3(saturate(x / scale)). Upstream's e5m2 (kFp8E5M2 = 2) is left out, and upstream passes the
// scales as pointers to device floats (a captured CUDA graph then sees new values); here they are
// plain floats set for each call.
// upstream: csrc/attention/dtype_fp8.cuh:14 @ v0.11.0
enum class KVCacheDType : int { kAuto = 0, kFp8E4M3 = 1 };

// Tokens per v2 partition; every supported block size divides it. The GQA-aware kernel may use
// smaller partitions (a power of two from kMinPartitionSize, chosen by its caller from the shape
// so that short contexts and small batches still give the GPU enough thread blocks).
constexpr int kPartitionSize = 512;
constexpr int kMinPartitionSize = 64;

enum class StatusCode : int { kOk = 0, kNotImplemented = 1, kUnsupported = 2, kCudaError = 3 };

struct Status {
  StatusCode code;
  const char* message;  // a string literal or cudaGetErrorString(); never owned
};

inline Status ok() { return {StatusCode::kOk, ""}; }
inline Status not_implemented(const char* what) { return {StatusCode::kNotImplemented, what}; }
inline Status unsupported(const char* what) { return {StatusCode::kUnsupported, what}; }
inline Status cuda_status(cudaError_t err) {
  return err == cudaSuccess ? ok() : Status{StatusCode::kCudaError, cudaGetErrorString(err)};
}

// Inputs of the decode kernels (v1, v2, GQA-aware). Sizes in elements unless named otherwise.
//   query, out        [num_seqs, num_heads, head_size]       (query may have a row stride)
//   key_cache         [num_blocks, num_kv_heads, head_size / x, block_size, x]
//   value_cache       [num_blocks, num_kv_heads, head_size, block_size]
//                     (elements of the model's dtype, or e4m3 bytes with kv_cache_dtype kFp8E4M3;
//                     x = 16 / element size: 4 for fp32, 8 for fp16/bf16, 16 for fp8)
//   block_tables      int32 [num_seqs, max_num_blocks_per_seq]
//   seq_lens          int32 [num_seqs]
//   alibi_slopes      fp32 [num_heads] or nullptr
//   exp_sums, max_logits  fp32 [num_seqs, num_heads, max_num_partitions]       (v2 / GQA only)
//   tmp_out           [num_seqs, num_heads, max_num_partitions, head_size]     (v2 / GQA only)
// The values of seq_lens and block_tables are trusted, as upstream does; the kernels only clamp
// each length to what max_seq_len and the table width allow, so bad values cannot make them read
// or write outside the buffers described here.
struct PagedAttentionParams {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  const int* seq_lens;
  const float* alibi_slopes;
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  DType dtype;                  // of query, out and tmp_out
  KVCacheDType kv_cache_dtype;  // of key_cache and value_cache
  float k_scale;  // fp8 cache: a key element reads as byte * k_scale (ignored with kAuto)
  float v_scale;  // fp8 cache: a value element reads as byte * v_scale (ignored with kAuto)
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int max_num_blocks_per_seq;
  int max_seq_len;
  int max_num_partitions;  // size of dim 2 of exp_sums / max_logits / tmp_out (their stride)
  int64_t q_stride;        // elements between two sequences' queries
  int64_t kv_block_stride;  // elements between two physical blocks of a cache
  int64_t kv_head_stride;   // elements between two KV heads inside a block
  float scale;
  int partition_size;  // tokens per partition of the GQA-aware kernel and its merge; 0: 512
};

// Writes the new tokens' keys and values into their cache slots.
//   key, value    [>= num_tokens, num_kv_heads, head_size] (row stride key_stride / value_stride;
//                 rows past num_tokens, a padded batch's, are not read)
//   key_cache, value_cache  as for PagedAttentionParams; with kFp8E4M3 each element is stored as
//                 e4m3(key / k_scale) (value / v_scale), saturated to +-448
//   slot_mapping  int64 [num_tokens]; a negative slot marks padding and is skipped
struct ReshapeAndCacheParams {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  DType dtype;  // of key and value
  KVCacheDType kv_cache_dtype;
  float k_scale;  // fp8 cache only: the cache stores key / k_scale
  float v_scale;  // fp8 cache only: the cache stores value / v_scale
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t num_blocks;
  int64_t key_stride;
  int64_t value_stride;
};

// Lab 02-06's probes (attention_probes.cuh): one step of the decode kernels run alone, so that
// its tests check each task before the next is written. Not on the decode path.
//   logits     fp32 [num_seqs, num_heads, logits_stride]: step 1's logits at their token positions
//   range_max  fp32 [num_seqs, num_heads, num_ranges]: the max of each range's valid logits
struct QkLogitsProbe {
  float* logits;
  int64_t logits_stride;
  float* range_max;
  int num_ranges;
  int range_tokens;  // tokens per thread block (a multiple of block_size), like a v2 partition
};

//   rows     fp32 [num_rows, width]: step 2 runs on row r's first lengths[r] entries, in place
//   lengths  int32 [num_rows]
//   stats    fp32 [num_rows, kProbeThreads, 2]: the (max, sum) each thread of row r's block got
constexpr int kProbeThreads = 128;  // as the decode kernels: the steps assume 4 warps
struct SoftmaxProbe {
  float* rows;
  const int* lengths;
  float* stats;
  int num_rows;
  int width;
};

// The naive kernel (lab 02-06's task 0): v1's grid, one thread per token or output row, scalar
// loads. Refuses an fp8 cache and contexts whose logits exceed 48 KB of shared memory.
Status launch_paged_attention_naive(const PagedAttentionParams& p, cudaStream_t stream);
Status launch_paged_attention_v1(const PagedAttentionParams& p, cudaStream_t stream);
Status launch_paged_attention_v2(const PagedAttentionParams& p, cudaStream_t stream);
Status launch_paged_attention_gqa(const PagedAttentionParams& p, cudaStream_t stream);
Status launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream);
Status launch_qk_logits_probe(const PagedAttentionParams& p, const QkLogitsProbe& probe,
                              cudaStream_t stream);
Status launch_softmax_probe(const SoftmaxProbe& probe, cudaStream_t stream);

// key_cache_ptrs / value_cache_ptrs: device arrays of num_layers base addresses;
// block_mapping: device int64 [num_pairs, 2] of (src, dst) block numbers.
Status launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                          const int64_t* block_mapping, int num_layers, int num_pairs,
                          int64_t bytes_per_block, cudaStream_t stream);

// block_mapping: host int64 [num_pairs, 2]. One async copy per pair, in the order given.
Status launch_swap_blocks(char* dst, const char* src, const int64_t* block_mapping,
                          int num_pairs, int64_t bytes_per_block, cudaMemcpyKind kind,
                          cudaStream_t stream);

}  // namespace mini_vllm
