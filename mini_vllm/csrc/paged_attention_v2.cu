// Paged attention v2: the context is cut into partitions of kPartitionSize tokens and one thread
// block handles one (query head, sequence, partition); a second kernel merges the partitions.
// Grid (num_heads, num_seqs, max_num_partitions). Long contexts then use many blocks instead of
// one, and shared memory per block no longer grows with the context.
//
// upstream: csrc/attention/attention_kernels.cuh:529 @ v0.11.0 (kernel)
// upstream: csrc/attention/paged_attention_v2.cu:46 @ v0.11.0 (launcher)
#include "attention_core.cuh"
#include "dispatch.cuh"
#include "partition_reduce.cuh"

namespace mini_vllm {

constexpr int kV2Threads = 128;

// T: the model's dtype (query, output); CacheT: the cache's elements (T, or __nv_fp8_e4m3).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_v2_kernel(const PagedAttentionParams p) {
  static_assert(kPartitionSize % BLOCK_SIZE == 0, "partitions must hold whole blocks");
  constexpr int BLOCKS_PER_PARTITION = kPartitionSize / BLOCK_SIZE;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int seq_len = clamped_seq_len(p, seq);
  const int first_block = part * BLOCKS_PER_PARTITION;
  if (first_block * BLOCK_SIZE >= seq_len) return;  // the whole block leaves: nothing to do
  const int end_block = min(first_block + BLOCKS_PER_PARTITION, div_round_up(seq_len, BLOCK_SIZE));

  const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_num_partitions + part;
  T* tmp_out = static_cast<T*>(p.tmp_out) + row * HEAD_SIZE;
  attend_blocks<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, CacheT>(p, seq, head, seq_len, first_block,
                                                        end_block, tmp_out, p.max_logits + row,
                                                        p.exp_sums + row);
}

template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_v2(const PagedAttentionParams& p, cudaStream_t stream) {
  const int parts_needed = div_round_up(p.max_seq_len, kPartitionSize);
  const int smem = attention_smem_bytes<HEAD_SIZE, kV2Threads>(kPartitionSize);  // < 48 KB
  const dim3 grid(p.num_heads, p.num_seqs, parts_needed);
  const auto kernel = paged_attention_v2_kernel<T, CacheT, HEAD_SIZE, BLOCK_SIZE, kV2Threads>;
  MINI_VLLM_LAUNCH(kernel, grid, kV2Threads, smem, stream)(p);
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  return launch_partition_reduce<T, HEAD_SIZE, kV2Threads>(p, stream);
}

Status launch_paged_attention_v2(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0) return ok();
  return dispatch_attention_kv(
      p.dtype, p.kv_cache_dtype, p.head_size, p.block_size,
      [&](auto type_tag, auto cache_tag, auto head_tag, auto block_tag) {
        return launch_v2<typename decltype(type_tag)::type, typename decltype(cache_tag)::type,
                          decltype(head_tag)::value, decltype(block_tag)::value>(p, stream);
      });
}

}  // namespace mini_vllm
