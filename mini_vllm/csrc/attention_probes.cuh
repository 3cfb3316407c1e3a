// Probes for lab 02-06's feedback task by task: step 1 (qk_logits) or step 2 (softmax_in_place)
// of attend_blocks run alone, with what the step leaves in shared memory copied out to global
// memory. Tasks 1-3 together make one kernel, so without these no test could check task 1
// before tasks 2 and 3 are written. They are test aids, not part of the decode path.
//
// Include this file after qk_logits, softmax_in_place, make_work and stage_query are defined:
// the probe kernels call the ones in scope there (attention_core.cuh's in the reference build,
// the student's in the lab's starter.cu).
//
// upstream: none (vLLM tests its decode kernels whole: tests/kernels/attention/test_attention.py)
#pragma once

#include "dispatch.cuh"

namespace mini_vllm {

constexpr int kProbeMaxSmem = 48 * 1024;  // no opt-in: probes run short contexts only

// Step 1 for thread block (head, seq, range) over the blocks of tokens
// [range * range_tokens, (range + 1) * range_tokens) of the sequence, exactly as attend_blocks
// runs it for a v2 partition (or, with one range, for v1). Copies every slot the step stored to
// probe.logits at its token position, and the block-wide max of the threads' returned maxes to
// probe.range_max.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    qk_logits_probe_kernel(const PagedAttentionParams p, const QkLogitsProbe probe) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int range = blockIdx.z;
  const int seq_len = clamped_seq_len(p, seq);
  const int blocks_per_range = probe.range_tokens / BLOCK_SIZE;
  const int first_block = range * blocks_per_range;
  if (first_block * BLOCK_SIZE >= seq_len) return;  // as v2: an empty range is not run
  const int end_block = min(first_block + blocks_per_range, div_round_up(seq_len, BLOCK_SIZE));
  MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_DYNAMIC_SHARED(float, logits);

  const AttentionWork w = make_work<BLOCK_SIZE>(p, seq, head, seq_len, first_block, end_block);
  stage_query<T, HEAD_SIZE, NUM_THREADS>(p, seq, head, q_smem);
  const float my_max = qk_logits<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, q_smem, logits);
  // Its barrier is also the one that makes every thread's logits visible (as in step 2).
  const float range_max = block_max<NUM_WARPS>(my_max, red_max);

  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  float* out = probe.logits + row * probe.logits_stride + w.start_token;
  for (int i = threadIdx.x; i < (end_block - first_block) * BLOCK_SIZE; i += NUM_THREADS) {
    out[i] = logits[i];
  }
  if (threadIdx.x == 0) probe.range_max[row * probe.num_ranges + range] = range_max;
}

// Step 2 for thread block r on row r: the row's `width` floats go to shared memory, each thread
// takes the max of the entries [0, lengths[r]) it loaded as its step-1 result, then
// softmax_in_place runs on the first lengths[r] entries (with no barrier before it, as in
// attend_blocks). The whole row is copied back, and every thread writes the (max, sum) it got.
template <int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) softmax_probe_kernel(const SoftmaxProbe probe) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  MINI_VLLM_DYNAMIC_SHARED(float, logits);

  float* row = probe.rows + static_cast<int64_t>(blockIdx.x) * probe.width;
  const int num_tokens = min(max(probe.lengths[blockIdx.x], 0), probe.width);
  float my_max = -FLT_MAX;
  for (int i = threadIdx.x; i < probe.width; i += NUM_THREADS) {
    logits[i] = row[i];
    if (i < num_tokens) my_max = fmaxf(my_max, logits[i]);
  }
  const SoftmaxStats stats =
      softmax_in_place<NUM_THREADS>(logits, num_tokens, my_max, red_max, red_sum);
  __syncthreads();  // every thread's part of the softmax is done before the row is read back
  for (int i = threadIdx.x; i < probe.width; i += NUM_THREADS) row[i] = logits[i];
  float* mine = probe.stats + (static_cast<int64_t>(blockIdx.x) * NUM_THREADS + threadIdx.x) * 2;
  mine[0] = stats.max_logit;
  mine[1] = stats.exp_sum;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_qk_logits_probe_for(const PagedAttentionParams& p, const QkLogitsProbe& probe,
                                  cudaStream_t stream) {
  const int smem = float_smem_bytes(probe.range_tokens);
  if (smem > kProbeMaxSmem) return unsupported("the probe's range is too long (48 KB of logits)");
  const auto kernel = qk_logits_probe_kernel<T, HEAD_SIZE, BLOCK_SIZE, kProbeThreads>;
  MINI_VLLM_LAUNCH(kernel, dim3(p.num_heads, p.num_seqs, probe.num_ranges), kProbeThreads, smem,
                   stream)(p, probe);
  return cuda_status(cudaGetLastError());
}

inline Status run_qk_logits_probe(const PagedAttentionParams& p, const QkLogitsProbe& probe,
                                  cudaStream_t stream) {
  const Status cache = refuse_fp8_cache(
      p.kv_cache_dtype, "the step-1 probe reads a cache in the model's dtype only (no fp8)");
  if (cache.code != StatusCode::kOk) return cache;
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    return launch_qk_logits_probe_for<typename decltype(t)::type, decltype(h)::value,
                                      decltype(b)::value>(p, probe, stream);
  });
}

inline Status run_softmax_probe(const SoftmaxProbe& probe, cudaStream_t stream) {
  if (probe.num_rows == 0) return ok();
  const int smem = 4 * probe.width;
  if (smem > kProbeMaxSmem) return unsupported("the probe's rows are too long (48 KB)");
  const auto kernel = softmax_probe_kernel<kProbeThreads>;
  MINI_VLLM_LAUNCH(kernel, dim3(probe.num_rows), kProbeThreads, smem, stream)(probe);
  return cuda_status(cudaGetLastError());
}

}  // namespace mini_vllm
