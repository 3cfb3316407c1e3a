// The thin layer between PyTorch and the kernels: tensors in, PagedAttentionParams out, one
// launcher call, and a Status turned into a Python exception. The friendly input checks (with
// messages that say what to change) live in mini_vllm/csrc/ops.py and run before these; the
// checks here are the last line of defence that keeps a kernel inside its buffers.
//
// Built by torch.utils.cpp_extension (see mini_vllm/csrc/__init__.py). With
// MINI_VLLM_ATTENTION_ONLY defined it binds only paged_attention_naive/v1/v2 and the probes of
// their steps 1 and 2, which is what the lab 02-06 starter build (bindings + starter.cu) provides;
// with MINI_VLLM_GQA_ONLY, only paged_attention_gqa (the lab's stretch build, stretch_gqa.cu).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernel_params.h"

namespace {

using mini_vllm::DType;
using mini_vllm::KVCacheDType;
using mini_vllm::PagedAttentionParams;
using mini_vllm::Status;
using mini_vllm::StatusCode;

void raise_if_error(const Status& status, const char* op) {
  switch (status.code) {
    case StatusCode::kOk:
      return;
    case StatusCode::kNotImplemented:
      TORCH_CHECK_NOT_IMPLEMENTED(false, status.message);
    case StatusCode::kUnsupported:
      TORCH_CHECK_VALUE(false, op, ": ", status.message);
    case StatusCode::kCudaError:
      TORCH_CHECK(false, op, ": CUDA error: ", status.message,
                  " (run again with CUDA_LAUNCH_BLOCKING=1 to see which kernel failed)");
  }
  TORCH_CHECK(false, op, ": unknown status");
}

DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return DType::kFloat32;
    case torch::kFloat16: return DType::kFloat16;
    case torch::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", t.scalar_type(),
                              "; use float32, float16 or bfloat16");
  }
  return DType::kFloat32;  // not reached: TORCH_CHECK_TYPE throws
}

// The cache dtype by upstream's names ("auto", "fp8", "fp8_e4m3"; e5m2 is left out) and its
// scales, which must be finite and > 0: the cache stores x / scale.
struct CacheDType {
  KVCacheDType kind;
  float k_scale;
  float v_scale;
};

CacheDType cache_dtype_of(const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  TORCH_CHECK_VALUE(kv_cache_dtype == "auto" || kv_cache_dtype == "fp8" ||
                        kv_cache_dtype == "fp8_e4m3",
                    "kv_cache_dtype must be auto, fp8 or fp8_e4m3, got ", kv_cache_dtype);
  TORCH_CHECK_VALUE(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) &&
                        v_scale > 0,
                    "k_scale and v_scale must be finite and > 0, got ", k_scale, " and ", v_scale);
  const KVCacheDType kind = kv_cache_dtype == "auto" ? KVCacheDType::kAuto : KVCacheDType::kFp8E4M3;
  return {kind, static_cast<float>(k_scale), static_cast<float>(v_scale)};
}

// The element type a cache must have: the model's, or e4m3 for an fp8 cache.
c10::ScalarType cache_scalar_type(const CacheDType& kv, const torch::Tensor& model) {
  return kv.kind == KVCacheDType::kAuto ? model.scalar_type() : c10::ScalarType::Float8_e4m3fn;
}

void check_on(const torch::Tensor& t, const torch::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be on ", ref.device(),
              ", got ", t.device());
}

using NamedTensor = std::pair<const torch::Tensor*, const char*>;

bool aligned16(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

PagedAttentionParams attention_params(torch::Tensor& out, const torch::Tensor& query,
                                      const torch::Tensor& key_cache,
                                      const torch::Tensor& value_cache, int64_t num_kv_heads,
                                      double scale, const torch::Tensor& block_tables,
                                      const torch::Tensor& seq_lens, int64_t block_size,
                                      int64_t max_seq_len,
                                      const std::optional<torch::Tensor>& alibi_slopes,
                                      const CacheDType& kv) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor");
  const c10::ScalarType cache_type = cache_scalar_type(kv, query);
  const NamedTensor others[] = {{&out, "out"},
                                {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"},
                                {&block_tables, "block_tables"},
                                {&seq_lens, "seq_lens"}};
  for (const auto& [t, name] : others) check_on(*t, query, name);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [num_seqs, num_heads, head_size] with contiguous rows");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.is_contiguous(), "out must be a contiguous tensor like query");
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() &&
                  key_cache.scalar_type() == cache_type && value_cache.scalar_type() == cache_type &&
                  key_cache.size(3) == block_size && value_cache.size(3) == block_size &&
                  key_cache.size(2) * key_cache.size(4) == query.size(2) &&
                  key_cache.size(4) * key_cache.element_size() == 16 &&
                  value_cache.sizes().slice(0, 3) ==
                      torch::IntArrayRef({key_cache.size(0), num_kv_heads, query.size(2)}) &&
                  key_cache.size(1) == num_kv_heads,
              "key_cache / value_cache do not have the paged layout for these inputs");
  TORCH_CHECK(aligned16(query) && aligned16(key_cache) && aligned16(value_cache) &&
                  query.stride(0) * query.element_size() % 16 == 0,
              "query and caches must be 16-byte aligned");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int32 [num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens must be contiguous int32 [num_seqs]");
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(max_seq_len >= 1 && max_seq_len <= INT32_MAX, "max_seq_len must be positive");

  PagedAttentionParams p{};
  if (alibi_slopes.has_value()) {
    const auto& a = alibi_slopes.value();
    check_on(a, query, "alibi_slopes");
    TORCH_CHECK(a.scalar_type() == torch::kFloat32 && a.is_contiguous() && a.dim() == 1 &&
                    a.size(0) == query.size(1),
                "alibi_slopes must be contiguous float32 [num_heads]");
    p.alibi_slopes = a.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.dtype = dtype_of(query);
  p.kv_cache_dtype = kv.kind;
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.num_seqs = static_cast<int>(query.size(0));
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(query.size(2));
  p.block_size = static_cast<int>(block_size);
  p.max_num_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.max_seq_len = static_cast<int>(max_seq_len);
  p.q_stride = query.stride(0);
  p.kv_block_stride = key_cache.stride(0);
  p.kv_head_stride = key_cache.stride(1);
  p.scale = static_cast<float>(scale);
  return p;
}

void add_partition_buffers(PagedAttentionParams& p, const torch::Tensor& query,
                           torch::Tensor& exp_sums, torch::Tensor& max_logits,
                           torch::Tensor& tmp_out) {
  const int64_t parts = (p.max_seq_len + mini_vllm::kPartitionSize - 1) / mini_vllm::kPartitionSize;
  const NamedTensor buffers[] = {{&exp_sums, "exp_sums"}, {&max_logits, "max_logits"}};
  for (const auto& [t, name] : buffers) {
    check_on(*t, query, name);
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == p.num_seqs && t->size(1) == p.num_heads && t->size(2) >= parts,
                name, " must be contiguous float32 [num_seqs, num_heads, >= ", parts, "]");
  }
  check_on(tmp_out, query, "tmp_out");
  TORCH_CHECK(tmp_out.scalar_type() == query.scalar_type() && tmp_out.is_contiguous() &&
                  tmp_out.dim() == 4 && tmp_out.size(0) == p.num_seqs &&
                  tmp_out.size(1) == p.num_heads && tmp_out.size(2) == exp_sums.size(2) &&
                  max_logits.size(2) == exp_sums.size(2) && tmp_out.size(3) == p.head_size,
              "tmp_out must be contiguous [num_seqs, num_heads, max_num_partitions, head_size]");
  p.exp_sums = exp_sums.data_ptr<float>();
  p.max_logits = max_logits.data_ptr<float>();
  p.tmp_out = tmp_out.data_ptr();
  p.max_num_partitions = static_cast<int>(exp_sums.size(2));
}

#ifndef MINI_VLLM_GQA_ONLY  // lab 02-06's stretch build binds the GQA kernel only

void paged_attention_naive(torch::Tensor& out, const torch::Tensor& query,
                           const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                           int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                           const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                           const std::optional<torch::Tensor>& alibi_slopes) {
  const PagedAttentionParams p = attention_params(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
      max_seq_len, alibi_slopes, cache_dtype_of("auto", 1.0, 1.0));
  const c10::cuda::CUDAGuard guard(query.device());
  raise_if_error(mini_vllm::launch_paged_attention_naive(p, c10::cuda::getCurrentCUDAStream()),
                 "paged_attention_naive");
}

void paged_attention_v1(torch::Tensor& out, const torch::Tensor& query,
                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                        const std::optional<torch::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const PagedAttentionParams p = attention_params(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
      max_seq_len, alibi_slopes, cache_dtype_of(kv_cache_dtype, k_scale, v_scale));
  const c10::cuda::CUDAGuard guard(query.device());
  raise_if_error(mini_vllm::launch_paged_attention_v1(p, c10::cuda::getCurrentCUDAStream()),
                 "paged_attention_v1");
}

#endif  // MINI_VLLM_GQA_ONLY

// v2 and the GQA-aware kernel share their signature (the GQA kernel adds `partition_size`, 0 for
// 512 tokens; v2 the cache dtype and scales); `launch` picks the kernel.
template <Status (*launch)(const PagedAttentionParams&, cudaStream_t)>
void partitioned_attention(torch::Tensor& out, torch::Tensor& exp_sums, torch::Tensor& max_logits,
                           torch::Tensor& tmp_out, const torch::Tensor& query,
                           const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                           int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                           const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                           const std::optional<torch::Tensor>& alibi_slopes,
                           int64_t partition_size, const CacheDType& kv) {
  PagedAttentionParams p =
      attention_params(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       seq_lens, block_size, max_seq_len, alibi_slopes, kv);
  add_partition_buffers(p, query, exp_sums, max_logits, tmp_out);
  TORCH_CHECK(partition_size >= 0 && partition_size <= mini_vllm::kPartitionSize,
              "partition_size must be 0 (512) or a power of two from 64 to 512");
  p.partition_size = static_cast<int>(partition_size);
  const c10::cuda::CUDAGuard guard(query.device());
  raise_if_error(launch(p, c10::cuda::getCurrentCUDAStream()), "paged attention");
}

#ifndef MINI_VLLM_GQA_ONLY
void partitioned_v2(torch::Tensor& out, torch::Tensor& exp_sums, torch::Tensor& max_logits,
                    torch::Tensor& tmp_out, const torch::Tensor& query,
                    const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                    const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                    const std::optional<torch::Tensor>& alibi_slopes,
                    const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  partitioned_attention<mini_vllm::launch_paged_attention_v2>(
      out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
      block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, 0,
      cache_dtype_of(kv_cache_dtype, k_scale, v_scale));
}

#endif  // MINI_VLLM_GQA_ONLY

#ifndef MINI_VLLM_ATTENTION_ONLY

// The GQA-aware kernel: v2's arguments, then partition_size, then the cache dtype and scales.
void partitioned_gqa(torch::Tensor& out, torch::Tensor& exp_sums, torch::Tensor& max_logits,
                     torch::Tensor& tmp_out, const torch::Tensor& query,
                     const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                     const std::optional<torch::Tensor>& alibi_slopes, int64_t partition_size,
                     const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  partitioned_attention<mini_vllm::launch_paged_attention_gqa>(
      out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
      block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, partition_size,
      cache_dtype_of(kv_cache_dtype, k_scale, v_scale));
}


#ifndef MINI_VLLM_GQA_ONLY

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& key_cache, torch::Tensor& value_cache,
                       const torch::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                       double k_scale, double v_scale) {
  TORCH_CHECK(key.is_cuda(), "key must be a CUDA tensor");
  const CacheDType kv = cache_dtype_of(kv_cache_dtype, k_scale, v_scale);
  const c10::ScalarType cache_type = cache_scalar_type(kv, key);
  const NamedTensor others[] = {{&value, "value"},
                                {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"},
                                {&slot_mapping, "slot_mapping"}};
  for (const auto& [t, name] : others) check_on(*t, key, name);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                  value.stride(2) == 1 && key.stride(1) == key.size(2) &&
                  value.stride(1) == value.size(2),
              "key and value must be [num_tokens, num_kv_heads, head_size] with contiguous rows");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 5 &&
                  value_cache.dim() == 4 && key_cache.scalar_type() == cache_type &&
                  value_cache.scalar_type() == cache_type &&
                  value.scalar_type() == key.scalar_type() && key_cache.size(1) == key.size(1) &&
                  key_cache.size(2) * key_cache.size(4) == key.size(2) &&
                  key_cache.size(4) * key_cache.element_size() == 16 &&
                  value_cache.size(0) == key_cache.size(0) &&
                  value_cache.size(1) == key.size(1) && value_cache.size(2) == key.size(2) &&
                  value_cache.size(3) == key_cache.size(3),
              "key_cache / value_cache do not have the paged layout for these keys");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) <= key.size(0),
              "slot_mapping must be contiguous int64 [num_tokens] (key may be padded: longer)");
  mini_vllm::ReshapeAndCacheParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.dtype = dtype_of(key);
  p.kv_cache_dtype = kv.kind;
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.num_tokens = static_cast<int>(slot_mapping.size(0));  // the real tokens; key may be longer
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(key.size(2));
  p.block_size = static_cast<int>(key_cache.size(3));
  p.num_blocks = key_cache.size(0);
  p.key_stride = key.stride(0);
  p.value_stride = value.stride(0);
  const c10::cuda::CUDAGuard guard(key.device());
  raise_if_error(mini_vllm::launch_reshape_and_cache(p, c10::cuda::getCurrentCUDAStream()),
                 "reshape_and_cache");
}

void copy_blocks(const std::vector<torch::Tensor>& key_caches,
                 const std::vector<torch::Tensor>& value_caches,
                 const torch::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(),
              "key_caches and value_caches must list the same layers");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const torch::Tensor& first = key_caches[0];
  TORCH_CHECK(first.is_cuda(), "the caches must be CUDA tensors");
  std::vector<int64_t> key_ptrs, value_ptrs;
  for (size_t i = 0; i < key_caches.size(); ++i) {
    for (const torch::Tensor* t : {&key_caches[i], &value_caches[i]}) {
      check_on(*t, first, "every cache");
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == first.scalar_type() &&
                      t->size(0) == first.size(0) && t->numel() == first.numel() &&
                      aligned16(*t),
                  "every cache must be contiguous, 16-byte aligned and shaped like the first");
    }
    key_ptrs.push_back(reinterpret_cast<int64_t>(key_caches[i].data_ptr()));
    value_ptrs.push_back(reinterpret_cast<int64_t>(value_caches[i].data_ptr()));
  }
  TORCH_CHECK(block_mapping.scalar_type() == torch::kInt64 && block_mapping.dim() == 2 &&
                  block_mapping.size(1) == 2, "block_mapping must be int64 [num_pairs, 2]");
  const auto on_device = torch::TensorOptions().dtype(torch::kInt64).device(first.device());
  // The pointer arrays and the mapping travel to the GPU (a small synchronous copy each).
  const torch::Tensor key_ptrs_t = torch::tensor(key_ptrs, torch::kInt64).to(on_device);
  const torch::Tensor value_ptrs_t = torch::tensor(value_ptrs, torch::kInt64).to(on_device);
  const torch::Tensor mapping = block_mapping.to(on_device).contiguous();
  const int64_t bytes_per_block = first.stride(0) * first.element_size();
  const c10::cuda::CUDAGuard guard(first.device());
  raise_if_error(mini_vllm::launch_copy_blocks(
                     key_ptrs_t.data_ptr<int64_t>(), value_ptrs_t.data_ptr<int64_t>(),
                     mapping.data_ptr<int64_t>(), static_cast<int>(key_caches.size()),
                     static_cast<int>(mapping.size(0)), bytes_per_block,
                     c10::cuda::getCurrentCUDAStream()),
                 "copy_blocks");
}

void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping) {
  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) {
    TORCH_CHECK(src.device() == dst.device(), "src and dst must be on the same GPU");
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda() && dst.is_cpu()) {
    kind = cudaMemcpyDeviceToHost;
  } else if (src.is_cpu() && dst.is_cuda()) {
    kind = cudaMemcpyHostToDevice;
  } else {
    TORCH_CHECK(false, "swap_blocks copies between a GPU and a CPU cache (or within one GPU)");
  }
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && src.scalar_type() == dst.scalar_type() &&
                  src.dim() >= 1 && src.sizes().slice(1) == dst.sizes().slice(1),
              "src and dst must be contiguous caches with the same block shape and dtype");
  TORCH_CHECK(block_mapping.is_cpu() && block_mapping.scalar_type() == torch::kInt64 &&
                  block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                  block_mapping.is_contiguous(),
              "block_mapping must be a contiguous CPU int64 tensor [num_pairs, 2]");
  const torch::Device gpu = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(gpu);
  raise_if_error(mini_vllm::launch_swap_blocks(
                     static_cast<char*>(dst.data_ptr()), static_cast<const char*>(src.data_ptr()),
                     block_mapping.data_ptr<int64_t>(), static_cast<int>(block_mapping.size(0)),
                     src.stride(0) * src.element_size(), kind,
                     c10::cuda::getCurrentCUDAStream(gpu.index())),
                 "swap_blocks");
}

#endif  // MINI_VLLM_GQA_ONLY
#endif  // MINI_VLLM_ATTENTION_ONLY

#ifndef MINI_VLLM_GQA_ONLY

// Lab 02-06's probes (attention_probes.cuh): step 1 or step 2 of the decode kernels alone.
// mini_vllm/csrc/probes.py checks the inputs first; these checks only keep the probes in bounds.
void qk_logits_probe(torch::Tensor& logits, torch::Tensor& range_max, const torch::Tensor& query,
                     const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     int64_t num_kv_heads, double scale, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                     const std::optional<torch::Tensor>& alibi_slopes, int64_t range_tokens) {
  torch::Tensor unused_out = torch::empty_like(query, at::MemoryFormat::Contiguous);
  const PagedAttentionParams p =
      attention_params(unused_out, query, key_cache, value_cache, num_kv_heads, scale,
                       block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                       cache_dtype_of("auto", 1.0, 1.0));
  const int64_t padded = (max_seq_len + block_size - 1) / block_size * block_size;
  const int64_t ranges = (padded + range_tokens - 1) / std::max<int64_t>(range_tokens, 1);
  check_on(logits, query, "logits");
  check_on(range_max, query, "range_max");
  TORCH_CHECK(range_tokens >= block_size && range_tokens % block_size == 0,
              "range_tokens must be a positive multiple of block_size");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.dim() == 3 && logits.size(0) == p.num_seqs &&
                  logits.size(1) == p.num_heads && logits.size(2) >= padded,
              "logits must be contiguous float32 [num_seqs, num_heads, >= ", padded, "]");
  TORCH_CHECK(range_max.scalar_type() == torch::kFloat32 && range_max.is_contiguous() &&
                  range_max.dim() == 3 && range_max.size(0) == p.num_seqs &&
                  range_max.size(1) == p.num_heads && range_max.size(2) == ranges,
              "range_max must be contiguous float32 [num_seqs, num_heads, ", ranges, "]");
  const mini_vllm::QkLogitsProbe probe{logits.data_ptr<float>(), logits.size(2),
                                       range_max.data_ptr<float>(), static_cast<int>(ranges),
                                       static_cast<int>(range_tokens)};
  const c10::cuda::CUDAGuard guard(query.device());
  raise_if_error(mini_vllm::launch_qk_logits_probe(p, probe, c10::cuda::getCurrentCUDAStream()),
                 "qk_logits_probe");
}

void softmax_probe(torch::Tensor& rows, const torch::Tensor& lengths, torch::Tensor& stats) {
  TORCH_CHECK(rows.is_cuda(), "rows must be a CUDA tensor");
  check_on(lengths, rows, "lengths");
  check_on(stats, rows, "stats");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.dim() == 2,
              "rows must be contiguous float32 [num_rows, width]");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt32 && lengths.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == rows.size(0),
              "lengths must be contiguous int32 [num_rows]");
  TORCH_CHECK(stats.scalar_type() == torch::kFloat32 && stats.is_contiguous() &&
                  stats.dim() == 3 && stats.size(0) == rows.size(0) &&
                  stats.size(1) == mini_vllm::kProbeThreads && stats.size(2) == 2,
              "stats must be contiguous float32 [num_rows, ", mini_vllm::kProbeThreads, ", 2]");
  const mini_vllm::SoftmaxProbe probe{rows.data_ptr<float>(), lengths.data_ptr<int>(),
                                      stats.data_ptr<float>(), static_cast<int>(rows.size(0)),
                                      static_cast<int>(rows.size(1))};
  const c10::cuda::CUDAGuard guard(rows.device());
  raise_if_error(mini_vllm::launch_softmax_probe(probe, c10::cuda::getCurrentCUDAStream()),
                 "softmax_probe");
}

#endif  // MINI_VLLM_GQA_ONLY

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "mini_vllm CUDA ops (paged attention and cache kernels)";
#ifndef MINI_VLLM_GQA_ONLY
  m.def("paged_attention_naive", &paged_attention_naive, py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("num_kv_heads"), py::arg("scale"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"),
        py::arg("max_seq_len"), py::arg("alibi_slopes") = py::none());
  m.def("paged_attention_v1", &paged_attention_v1, py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("num_kv_heads"), py::arg("scale"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"),
        py::arg("max_seq_len"), py::arg("alibi_slopes") = py::none(),
        py::arg("kv_cache_dtype") = "auto", py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("paged_attention_v2", &partitioned_v2,
        py::arg("out"), py::arg("exp_sums"), py::arg("max_logits"), py::arg("tmp_out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("num_kv_heads"),
        py::arg("scale"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"),
        py::arg("max_seq_len"), py::arg("alibi_slopes") = py::none(),
        py::arg("kv_cache_dtype") = "auto", py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("qk_logits_probe", &qk_logits_probe, py::arg("logits"), py::arg("range_max"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("num_kv_heads"),
        py::arg("scale"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"),
        py::arg("max_seq_len"), py::arg("alibi_slopes"), py::arg("range_tokens"));
  m.def("softmax_probe", &softmax_probe, py::arg("rows"), py::arg("lengths"), py::arg("stats"));
#endif  // MINI_VLLM_GQA_ONLY
#ifndef MINI_VLLM_ATTENTION_ONLY
  m.def("paged_attention_gqa", &partitioned_gqa,
        py::arg("out"), py::arg("exp_sums"), py::arg("max_logits"), py::arg("tmp_out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("num_kv_heads"),
        py::arg("scale"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"),
        py::arg("max_seq_len"), py::arg("alibi_slopes") = py::none(),
        py::arg("partition_size") = 0, py::arg("kv_cache_dtype") = "auto",
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
#ifndef MINI_VLLM_GQA_ONLY
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("kv_cache_dtype") = "auto", py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("copy_blocks", &copy_blocks, py::arg("key_caches"), py::arg("value_caches"),
        py::arg("block_mapping"));
  m.def("swap_blocks", &swap_blocks, py::arg("src"), py::arg("dst"), py::arg("block_mapping"));
#endif  // MINI_VLLM_GQA_ONLY
#endif  // MINI_VLLM_ATTENTION_ONLY
}
