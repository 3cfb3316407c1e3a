// Paged attention written the obvious way: lab 02-06's first kernel (task 0), the baseline that
// v1 improves on. Same grid as v1, one thread block per (query head, sequence), and the same
// three steps (logits, softmax, weighted sum of the values), but every thread works alone with
// scalar loads:
//
//   * logits: thread i takes tokens i, i + NUM_THREADS, ... and computes each dot product by
//     itself, HEAD_SIZE loads of one element each. Neighbouring threads read neighbouring tokens,
//     16 bytes apart, so one warp-wide load touches 32 chunks to use one element of each; the rest
//     of each chunk waits in L1 for the next iterations, if it is still there;
//   * values: thread d takes output rows d, d + NUM_THREADS, ... and walks the whole context
//     alone, one element per token. With HEAD_SIZE < NUM_THREADS some threads have nothing to do.
//
// It is correct and short, which is its job: the student sees the whole algorithm before the
// tricks. v1 (attention_core.cuh) keeps the algorithm and changes who loads what: thread groups
// that share one token's key, 16-byte vector loads, warps over blocks, a cross-warp sum.
// Its logits live in shared memory without opting in to more than 48 KB (about 12K tokens).
//
// upstream: none. Upstream starts at v1; this is its test's reference loop,
// tests/kernels/attention/test_attention.py:65 @ v0.11.0, written as a kernel.
#include "attention_core.cuh"
#include "dispatch.cuh"

namespace mini_vllm {

constexpr int kNaiveThreads = 128;

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_naive_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr int X = 16 / sizeof(T);  // elements per 16-byte chunk of a key
  MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  MINI_VLLM_DYNAMIC_SHARED(float, logits);  // one float per token of the sequence
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = clamped_seq_len(p, seq);
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int* block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;
  const T* key_cache = static_cast<const T*>(p.key_cache) + kv_head * p.kv_head_stride;
  const T* value_cache = static_cast<const T*>(p.value_cache) + kv_head * p.kv_head_stride;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_heads + head) * HEAD_SIZE;
  const float alibi_slope = p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[head];
  stage_query<T, HEAD_SIZE, NUM_THREADS>(p, seq, head, q_smem);

  // Logits: key element d of token t sits at chunk d / X, slot t % BLOCK_SIZE, lane d % X.
  float my_max = -FLT_MAX;
  for (int t = threadIdx.x; t < seq_len; t += NUM_THREADS) {
    const int64_t physical = block_table[t / BLOCK_SIZE];
    const T* key = key_cache + physical * p.kv_block_stride + (t % BLOCK_SIZE) * X;
    float dot = 0.f;
    for (int d = 0; d < HEAD_SIZE; ++d) {
      dot += q_smem[d] * to_float(key[(d / X) * BLOCK_SIZE * X + d % X]);
    }
    const float logit = dot + alibi_slope * static_cast<float>(t - (seq_len - 1));
    logits[t] = logit;
    my_max = fmaxf(my_max, logit);
  }

  // Softmax. block_max's barrier publishes every thread's logits; each thread then rewrites only
  // its own tokens, and block_sum's barrier publishes the exponentials for the value loop.
  const float max_logit = block_max<NUM_WARPS>(my_max, red_max);
  float my_sum = 0.f;
  for (int t = threadIdx.x; t < seq_len; t += NUM_THREADS) {
    const float e = expf(logits[t] - max_logit);
    logits[t] = e;
    my_sum += e;
  }
  const float exp_sum = block_sum<NUM_WARPS>(my_sum, red_sum);
  const float inv_sum = exp_sum > 0.f ? 1.f / exp_sum : 0.f;

  // Values: row d of a block holds element d of its BLOCK_SIZE tokens; only the sequence's
  // tokens are read, so the unused slots of its last block never reach the sum.
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float acc = 0.f;
    for (int start = 0; start < seq_len; start += BLOCK_SIZE) {
      const int64_t physical = block_table[start / BLOCK_SIZE];
      const T* row = value_cache + physical * p.kv_block_stride + d * BLOCK_SIZE;
      const int tokens = min(BLOCK_SIZE, seq_len - start);
      for (int i = 0; i < tokens; ++i) acc += logits[start + i] * to_float(row[i]);
    }
    out[d] = from_float<T>(acc * inv_sum);
  }
}

// The logits' shared memory must fit the 48 KB a block gets without opting in, beside the static
// arrays; kNaiveSmemSlack leaves room for the alignment the compiler may give them and the
// dynamic buffer (ops.naive_max_seq_len computes the same limit for the Python check).
constexpr int kNaiveSmemSlack = 64;
template <int HEAD_SIZE, int NUM_THREADS>
constexpr int naive_max_seq_len() {
  return (48 * 1024 - attention_static_smem_bytes<HEAD_SIZE, NUM_THREADS>() - kNaiveSmemSlack) / 4;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_naive(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.max_seq_len > naive_max_seq_len<HEAD_SIZE, kNaiveThreads>()) {
    return unsupported(
        "max_seq_len is too long for paged_attention_naive (its logits must fit in 48 KB of "
        "shared memory: about 12K tokens); use paged_attention_v1 or v2");
  }
  const auto kernel = paged_attention_naive_kernel<T, HEAD_SIZE, BLOCK_SIZE, kNaiveThreads>;
  const dim3 grid(p.num_heads, p.num_seqs);
  MINI_VLLM_LAUNCH(kernel, grid, kNaiveThreads, float_smem_bytes(p.max_seq_len), stream)(p);
  return cuda_status(cudaGetLastError());
}

Status launch_paged_attention_naive(const PagedAttentionParams& p, cudaStream_t stream) {
  const Status cache = refuse_fp8_cache(
      p.kv_cache_dtype, "paged_attention_naive reads a KV cache in the model's dtype only");
  if (cache.code != StatusCode::kOk) return cache;
  if (p.num_seqs == 0) return ok();  // an empty grid is not a valid launch
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    return launch_naive<typename decltype(t)::type, decltype(h)::value, decltype(b)::value>(
        p, stream);
  });
}

}  // namespace mini_vllm
