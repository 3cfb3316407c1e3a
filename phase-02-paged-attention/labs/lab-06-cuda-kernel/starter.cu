// Lab 02-06: PagedAttention in CUDA. This file is yours.
//
// It holds everything of a naive decode kernel and of paged attention v1 and v2 except the five
// pieces you write (tasks 0-4 in the README): first the naive kernel, whole, then v1 and v2 in
// four steps. The helpers it includes from mini_vllm/csrc/ are given: common.cuh (fp32
// conversions, load_as_float for 16-byte vector loads, group_sum / warp_max / block_max /
// block_sum), dispatch.cuh (run-time sizes to template arguments), kernel_params.h (the inputs).
// Like the reference kernels, this file includes no torch header, so plain nvcc compiles it.
//
// When a task is written, set its LAB_TASK_N_DONE to 1: the launchers refuse to run a kernel
// whose tasks are not marked done, so the tests tell you which task is missing instead of
// comparing an unwritten output.
#include "common.cuh"
#include "dispatch.cuh"

#define LAB_TASK_0_DONE 0  // paged_attention_naive_kernel
#define LAB_TASK_1_DONE 0  // qk_logits
#define LAB_TASK_2_DONE 0  // softmax_in_place
#define LAB_TASK_3_DONE 0  // accumulate_values
#define LAB_TASK_4_DONE 0  // partition_reduce_kernel

namespace mini_vllm {

constexpr int kThreads = 128;  // 4 warps per thread block

// What one thread block works on (filled in by make_work below).
struct AttentionWork {
  int seq;
  int head;
  int kv_head;      // the KV head that query head `head` reads
  int seq_len;      // tokens in the sequence
  int first_block;  // [first_block, end_block): the logical blocks of this thread block
  int end_block;
  int start_token;  // first_block * BLOCK_SIZE: logits[i] belongs to token start_token + i
  int num_tokens;   // tokens of the range that exist (the last block may be partial)
  const int* block_table;  // this sequence's row of block_tables
  float alibi_slope;       // 0 without ALiBi
};

struct SoftmaxStats {
  float max_logit;
  float exp_sum;
};

template <int HEAD_SIZE, int NUM_THREADS>
__host__ __device__ constexpr int attention_smem_bytes(int num_token_slots) {
  return 4 * const_max(num_token_slots, (NUM_THREADS / kWarpSize) * HEAD_SIZE);
}

// The static shared memory of attend_blocks (q_smem, red_max, red_sum), counted by launch_v1.
template <int HEAD_SIZE, int NUM_THREADS>
__host__ __device__ constexpr int attention_static_smem_bytes() {
  return 4 * HEAD_SIZE + 2 * 4 * (NUM_THREADS / kWarpSize);
}

// Given: the query row, times the scale, as fp32 in q_smem; ends with the barrier that
// publishes it.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
__device__ void stage_query(const PagedAttentionParams& p, int seq, int head, float* q_smem) {
  const T* q = static_cast<const T*>(p.query) + seq * p.q_stride +
               static_cast<int64_t>(head) * HEAD_SIZE;
  for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) {
    q_smem[i] = to_float(q[i]) * p.scale;
  }
  __syncthreads();
}

// Task 0. The naive kernel: one thread block of NUM_THREADS threads per (query head `head`,
// sequence `seq`) computes out = softmax(q . K^T * scale + ALiBi) V over the sequence's first
// seq_len tokens, the whole attention in one function, with no trick:
//   1. thread i computes the logits of tokens i, i + NUM_THREADS, ..., each dot product alone,
//      one scalar element at a time, into logits[t] (shared memory, one float per token), plus
//      alibi_slope * (t - (seq_len - 1)), and keeps its max;
//   2. block_max (common.cuh) over the threads' maxes; each thread turns its own logits into
//      exp(logit - max) and adds them up; block_sum over the threads' sums;
//   3. thread d computes out[d] = sum_t logits[t] * v_t[d] / sum for d = i, i + NUM_THREADS, ...
//      (d < HEAD_SIZE), walking the blocks of the table, in fp32, written as T.
// The cache layout: key element d of token t is
// key_cache[block_table[t / BLOCK_SIZE], kv_head, d / X, t % BLOCK_SIZE, d % X] with X elements
// per 16-byte chunk; value element d is value_cache[block_table[t / BLOCK_SIZE], kv_head, d,
// t % BLOCK_SIZE]. The pointers below are already at kv_head; a block's offset is
// physical * p.kv_block_stride, with `physical` read as int64_t. Read only tokens t < seq_len:
// the unused slots of the last block may hold NaN. Everything given is set up above the TODO.
// Hint: `python -m course hint 02-06 0`. (Tasks 1-4 then rebuild this as v1 and v2.)
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_naive_kernel(const PagedAttentionParams p) {
  // ([[maybe_unused]] only silences the compiler until you use them.)
  [[maybe_unused]] constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  [[maybe_unused]] constexpr int X = 16 / sizeof(T);  // elements per 16-byte chunk of a key
  MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);
  [[maybe_unused]] MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  [[maybe_unused]] MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  [[maybe_unused]] MINI_VLLM_DYNAMIC_SHARED(float, logits);  // one float per token of the sequence
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  [[maybe_unused]] const int seq_len = clamped_seq_len(p, seq);
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  [[maybe_unused]] const int* block_table =
      p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;
  [[maybe_unused]] const T* key_cache =
      static_cast<const T*>(p.key_cache) + kv_head * p.kv_head_stride;
  [[maybe_unused]] const T* value_cache =
      static_cast<const T*>(p.value_cache) + kv_head * p.kv_head_stride;
  [[maybe_unused]] T* out =
      static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_heads + head) * HEAD_SIZE;
  [[maybe_unused]] const float alibi_slope =
      p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[head];
  stage_query<T, HEAD_SIZE, NUM_THREADS>(p, seq, head, q_smem);  // q * scale, then a barrier
  // TODO(lab 02-06, task 0): the three steps above; then set LAB_TASK_0_DONE to 1.
}

// Task 1. For every token slot t of blocks [w.first_block, w.end_block), store
//     logits[t - w.start_token] = q . k_t + w.alibi_slope * (t - (w.seq_len - 1))
// (q_smem already holds the query times the scale, as fp32), store 0 for slots t >= w.seq_len,
// and return the max of the valid logits this thread stored (-FLT_MAX if none).
// Contract: every thread of the block calls it; key t of logical block b is
// key_cache[w.block_table[b], w.kv_head, c, t % BLOCK_SIZE, 0..X) for chunk c < HEAD_SIZE / X
// (offsets in elements: p.kv_block_stride, p.kv_head_stride; the block number times a stride
// needs 64 bits). Slots past the end may hold anything, NaN included: they must not reach a
// valid logit or the max. Read each key element once per thread block, in 16-byte vector loads
// (load_as_float). No barrier is needed inside: task 2's first reduction is the barrier.
// How to split the tokens among warps and lanes: `python -m course hint 02-06 1`.
// (CacheT, the cache's element type, is always T here: reading an fp8 cache is the reference's
// extension, mini_vllm/csrc/attention_core.cuh. Write your code with T.)
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename CacheT = T>
__device__ float qk_logits(const PagedAttentionParams& p, const AttentionWork& w,
                           const float* q_smem, float* logits) {
  // TODO(lab 02-06, task 1): compute the logits; then set LAB_TASK_1_DONE to 1.
  return -FLT_MAX;
}

// Task 2. Turn logits[0, num_tokens) into exp(logit - max) in place and return the max and the
// sum of the exponentials over the whole thread block. `my_max` is this thread's task-1 result.
// Use block_max and block_sum (common.cuh), each with its own scratch buffer (red_max, red_sum:
// NUM_WARPS floats each). Their barrier is also what makes task 1's logits visible to all.
// Hint: `python -m course hint 02-06 2`.
template <int NUM_THREADS>
__device__ SoftmaxStats softmax_in_place(float* logits, int num_tokens, float my_max,
                                         float* red_max, float* red_sum) {
  // TODO(lab 02-06, task 2): the block-wide softmax; then set LAB_TASK_2_DONE to 1.
  return {0.f, 0.f};
}

// Task 3. Write out[d] = inv_sum * sum_t probs[t - w.start_token] * v_t[d] for d < HEAD_SIZE,
// over the tokens t < w.seq_len of blocks [w.first_block, w.end_block), in T.
// Contract: every thread of the block calls it; the values of logical block b are
// value_cache[w.block_table[b], w.kv_head, d, 0..BLOCK_SIZE) (row d, tokens along it, same
// strides as the keys). Slots past the end may hold NaN and must not reach the output (NaN * 0
// is NaN: leave them out, do not multiply them by 0). Accumulate in fp32. `probs` is yours to
// reuse as scratch (attention_smem_bytes above is its size) once no thread reads it any
// more; the barrier that guarantees that is yours too.
// How to split the rows among lanes and add the warps' parts: `python -m course hint 02-06 3`.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename CacheT = T>
__device__ void accumulate_values(const PagedAttentionParams& p, const AttentionWork& w,
                                  float* probs, float inv_sum, T* __restrict__ out) {
  // TODO(lab 02-06, task 3): the weighted sum of the values; then set LAB_TASK_3_DONE to 1.
}

// Given: the AttentionWork of the thread block that attends for query head `head` of sequence
// `seq` over the KV blocks [first_block, end_block) of its block table.
template <int BLOCK_SIZE>
__device__ AttentionWork make_work(const PagedAttentionParams& p, int seq, int head, int seq_len,
                                   int first_block, int end_block) {
  AttentionWork w;
  w.seq = seq;
  w.head = head;
  w.kv_head = head / (p.num_heads / p.num_kv_heads);
  w.seq_len = seq_len;
  w.first_block = first_block;
  w.end_block = end_block;
  w.start_token = first_block * BLOCK_SIZE;
  w.num_tokens = min(end_block * BLOCK_SIZE, seq_len) - w.start_token;
  w.block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;
  w.alibi_slope = p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[head];
  return w;
}

// Given: the skeleton that ties tasks 1-3 together for one (head, sequence, block range).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ void attend_blocks(const PagedAttentionParams& p, int seq, int head, int seq_len,
                              int first_block, int end_block, T* __restrict__ out,
                              float* max_logit_out, float* exp_sum_out) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  MINI_VLLM_SHARED(float, q_smem, [HEAD_SIZE]);  // __shared__ float q_smem[HEAD_SIZE];
  MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  MINI_VLLM_DYNAMIC_SHARED(float, logits);  // extern __shared__ float logits[];

  const AttentionWork w = make_work<BLOCK_SIZE>(p, seq, head, seq_len, first_block, end_block);
  stage_query<T, HEAD_SIZE, NUM_THREADS>(p, seq, head, q_smem);

  const float my_max = qk_logits<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, q_smem, logits);
  const SoftmaxStats stats =
      softmax_in_place<NUM_THREADS>(logits, w.num_tokens, my_max, red_max, red_sum);
  const float inv_sum = stats.exp_sum > 0.f ? 1.f / stats.exp_sum : 0.f;
  accumulate_values<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, w, logits, inv_sum, out);
  if (threadIdx.x == 0 && max_logit_out != nullptr) {
    *max_logit_out = stats.max_logit;
    *exp_sum_out = stats.exp_sum;
  }
}

// Given: v1, one thread block per (head, sequence) over the whole context.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_v1_kernel(const PagedAttentionParams p) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = clamped_seq_len(p, seq);
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_heads + head) * HEAD_SIZE;
  attend_blocks<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(
      p, seq, head, seq_len, 0, div_round_up(seq_len, BLOCK_SIZE), out, nullptr, nullptr);
}

// Given: v2 phase 1, one thread block per (head, sequence, partition of kPartitionSize tokens).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_v2_kernel(const PagedAttentionParams p) {
  constexpr int BLOCKS_PER_PARTITION = kPartitionSize / BLOCK_SIZE;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int seq_len = clamped_seq_len(p, seq);
  const int first_block = part * BLOCKS_PER_PARTITION;
  if (first_block * BLOCK_SIZE >= seq_len) return;
  const int end_block = min(first_block + BLOCKS_PER_PARTITION, div_round_up(seq_len, BLOCK_SIZE));
  const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_num_partitions + part;
  T* tmp_out = static_cast<T*>(p.tmp_out) + row * HEAD_SIZE;
  attend_blocks<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(p, seq, head, seq_len, first_block,
                                                        end_block, tmp_out, p.max_logits + row,
                                                        p.exp_sums + row);
}

// Task 4. v2 phase 2, one thread block per (head, sequence): merge the partitions.
// Partition i (i < num_parts) left m_i = max_logits[i], s_i = exp_sums[i] and its normalised
// output o_i = tmp_out[i * HEAD_SIZE ...]. With M = max_i m_i and w_i = s_i * exp(m_i - M), write
//     out[d] = sum_i w_i * o_i[d] / sum_i w_i.
// Use block_max / block_sum with red_max / red_sum, and `weights` (num_parts floats of dynamic
// shared memory) to keep the w_i. Partitions i >= num_parts were never written: do not read them.
// Hint: `python -m course hint 02-06 4`.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
    partition_reduce_kernel(const PagedAttentionParams p) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  // ([[maybe_unused]] only silences the compiler until you use them.)
  [[maybe_unused]] const int tid = threadIdx.x;
  [[maybe_unused]] const int num_parts = div_round_up(clamped_seq_len(p, seq), kPartitionSize);
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  [[maybe_unused]] const float* max_logits = p.max_logits + row * p.max_num_partitions;
  [[maybe_unused]] const float* exp_sums = p.exp_sums + row * p.max_num_partitions;
  [[maybe_unused]] const T* tmp_out =
      static_cast<const T*>(p.tmp_out) + row * p.max_num_partitions * HEAD_SIZE;
  [[maybe_unused]] T* out = static_cast<T*>(p.out) + row * HEAD_SIZE;
  [[maybe_unused]] MINI_VLLM_DYNAMIC_SHARED(float, weights);
  [[maybe_unused]] MINI_VLLM_SHARED(float, red_max, [NUM_WARPS]);
  [[maybe_unused]] MINI_VLLM_SHARED(float, red_sum, [NUM_WARPS]);
  // TODO(lab 02-06, task 4): merge the partitions into `out`; then set LAB_TASK_4_DONE to 1.
}

// ---- launchers (given) ------------------------------------------------------------------------

// The message the tests show for task `task` while it is not marked done (nullptr once it is).
inline const char* task_todo(int task) {
  if (task == 0 && !LAB_TASK_0_DONE)
    return "lab 02-06, task 0: write paged_attention_naive_kernel in starter.cu, then set LAB_TASK_0_DONE to 1 (hint: python -m course hint 02-06 0)";
  if (task == 1 && !LAB_TASK_1_DONE)
    return "lab 02-06, task 1: write qk_logits in starter.cu, then set LAB_TASK_1_DONE to 1 (hint: python -m course hint 02-06 1)";
  if (task == 2 && !LAB_TASK_2_DONE)
    return "lab 02-06, task 2: write softmax_in_place in starter.cu, then set LAB_TASK_2_DONE to 1 (hint: python -m course hint 02-06 2)";
  if (task == 3 && !LAB_TASK_3_DONE)
    return "lab 02-06, task 3: write accumulate_values in starter.cu, then set LAB_TASK_3_DONE to 1 (hint: python -m course hint 02-06 3)";
  if (task == 4 && !LAB_TASK_4_DONE)
    return "lab 02-06, task 4: write partition_reduce_kernel in starter.cu, then set LAB_TASK_4_DONE to 1 (hint: python -m course hint 02-06 4)";
  return nullptr;
}

// The first of tasks 1..last_task that a kernel needs and is not marked done.
inline const char* missing_task(int last_task) {
  for (int task = 1; task <= last_task; ++task) {
    if (const char* todo = task_todo(task)) return todo;
  }
  return nullptr;
}

constexpr const char* kNoFp8 =
    "lab 02-06's kernels read a KV cache in the model's dtype only (unsupported: an fp8 cache); "
    "use mini_vllm.csrc.ops for the fp8 path";

// The naive kernel's logits must fit the 48 KB a block gets without opting in, beside its static
// arrays and 64 bytes for their alignment (the limit of mini_vllm.csrc.ops.naive_max_seq_len).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_naive(const PagedAttentionParams& p, cudaStream_t stream) {
  const int static_smem = attention_static_smem_bytes<HEAD_SIZE, kThreads>();
  if (4 * p.max_seq_len + static_smem + 64 > 48 * 1024) {
    return unsupported(
        "max_seq_len is too long for paged_attention_naive (its logits must fit in 48 KB of "
        "shared memory: about 12K tokens); use paged_attention_v1 or v2");
  }
  const auto kernel = paged_attention_naive_kernel<T, HEAD_SIZE, BLOCK_SIZE, kThreads>;
  MINI_VLLM_LAUNCH(kernel, dim3(p.num_heads, p.num_seqs), kThreads,
                   float_smem_bytes(p.max_seq_len), stream)(p);
  return cuda_status(cudaGetLastError());
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_v1(const PagedAttentionParams& p, cudaStream_t stream) {
  const auto kernel = paged_attention_v1_kernel<T, HEAD_SIZE, BLOCK_SIZE, kThreads>;
  const int slots = div_round_up(p.max_seq_len, BLOCK_SIZE) * BLOCK_SIZE;
  const int smem = attention_smem_bytes<HEAD_SIZE, kThreads>(slots);
  const int static_smem = attention_static_smem_bytes<HEAD_SIZE, kThreads>();
  if (smem + static_smem > 48 * 1024) {
    // Past 48 KB a kernel must opt in, up to the device's limit minus its static shared memory.
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
  MINI_VLLM_LAUNCH(kernel, dim3(p.num_heads, p.num_seqs), kThreads, smem, stream)(p);
  return cuda_status(cudaGetLastError());
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
Status launch_v2(const PagedAttentionParams& p, cudaStream_t stream) {
  const int parts = div_round_up(p.max_seq_len, kPartitionSize);
  const int smem = attention_smem_bytes<HEAD_SIZE, kThreads>(kPartitionSize);
  const auto kernel = paged_attention_v2_kernel<T, HEAD_SIZE, BLOCK_SIZE, kThreads>;
  MINI_VLLM_LAUNCH(kernel, dim3(p.num_heads, p.num_seqs, parts), kThreads, smem, stream)(p);
  const Status status = cuda_status(cudaGetLastError());
  if (status.code != StatusCode::kOk) return status;
  const auto reduce = partition_reduce_kernel<T, HEAD_SIZE, kThreads>;
  MINI_VLLM_LAUNCH(reduce, dim3(p.num_heads, p.num_seqs), kThreads, float_smem_bytes(parts),
                   stream)(p);
  return cuda_status(cudaGetLastError());
}

Status launch_paged_attention_naive(const PagedAttentionParams& p, cudaStream_t stream) {
  if (const char* todo = task_todo(0)) return not_implemented(todo);
  const Status cache = refuse_fp8_cache(p.kv_cache_dtype, kNoFp8);
  if (cache.code != StatusCode::kOk) return cache;
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    return launch_naive<typename decltype(t)::type, decltype(h)::value, decltype(b)::value>(
        p, stream);
  });
}

Status launch_paged_attention_v1(const PagedAttentionParams& p, cudaStream_t stream) {
  if (const char* todo = missing_task(3)) return not_implemented(todo);
  // Your kernels read a cache in the model's dtype; the fp8 cache is the reference's.
  const Status cache = refuse_fp8_cache(p.kv_cache_dtype, kNoFp8);
  if (cache.code != StatusCode::kOk) return cache;
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    return launch_v1<typename decltype(t)::type, decltype(h)::value, decltype(b)::value>(p,
                                                                                       stream);
  });
}

Status launch_paged_attention_v2(const PagedAttentionParams& p, cudaStream_t stream) {
  if (const char* todo = missing_task(4)) return not_implemented(todo);
  // Your kernels read a cache in the model's dtype; the fp8 cache is the reference's.
  const Status cache = refuse_fp8_cache(p.kv_cache_dtype, kNoFp8);
  if (cache.code != StatusCode::kOk) return cache;
  if (p.num_seqs == 0) return ok();
  return dispatch_attention(p.dtype, p.head_size, p.block_size, [&](auto t, auto h, auto b) {
    return launch_v2<typename decltype(t)::type, decltype(h)::value, decltype(b)::value>(p,
                                                                                       stream);
  });
}

}  // namespace mini_vllm

// The probes the tests use to check tasks 1 and 2 alone, before the rest of the kernel exists:
// each runs one of your steps and copies out its result. Included here, after your steps,
// because the probe kernels call the qk_logits and softmax_in_place defined above.
#include "attention_probes.cuh"

namespace mini_vllm {

Status launch_qk_logits_probe(const PagedAttentionParams& p, const QkLogitsProbe& probe,
                              cudaStream_t stream) {
  if (const char* todo = task_todo(1)) return not_implemented(todo);
  return run_qk_logits_probe(p, probe, stream);
}

Status launch_softmax_probe(const SoftmaxProbe& probe, cudaStream_t stream) {
  if (const char* todo = task_todo(2)) return not_implemented(todo);
  return run_softmax_probe(probe, stream);
}

}  // namespace mini_vllm
