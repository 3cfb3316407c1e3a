// The emulator's counterpart of ../bindings.cpp: request in, the kernels' plain-C++ launchers
// (kernel_params.h) called, status out. The Python side (EmulatedOps in __init__.py) has already
// checked the inputs exactly as the CUDA ops do, and computed the sizes and strides.
//
// With MINI_VLLM_ATTENTION_ONLY defined it binds only paged_attention_naive/v1/v2 and the probes
// of their steps 1 and 2, which is what the lab 02-06 starter build (the student's starter.cu)
// provides; with MINI_VLLM_GQA_ONLY, only paged_attention_gqa (the lab's stretch build,
// stretch_gqa.cu).
#include <cstdint>
#include <vector>

#include "driver.h"
#include "kernel_params.h"
#include "runtime.h"

namespace {

using mini_vllm::DType;
using mini_vllm::KVCacheDType;
using mini_vllm::PagedAttentionParams;
using mini_vllm::Status;
using mini_vllm_emu::Request;

void finish(const Status& status) {
  mini_vllm_emu::report_status(static_cast<int>(status.code), status.message);
}

// The cache dtype and its scales; a request without them has a cache in the model's dtype.
template <typename Params>
void cache_dtype(const Request& req, Params& p) {
  p.kv_cache_dtype = KVCacheDType::kAuto;
  p.k_scale = p.v_scale = 1.f;
  if (req.scalars.count("kv_cache_dtype")) {
    p.kv_cache_dtype = static_cast<KVCacheDType>(req.integer("kv_cache_dtype"));
    p.k_scale = static_cast<float>(req.real("k_scale"));
    p.v_scale = static_cast<float>(req.real("v_scale"));
  }
}

PagedAttentionParams attention_params(const Request& req) {
  PagedAttentionParams p{};
  if (req.has("out")) p.out = req.buffer("out");  // the step-1 probe writes no output row
  p.query = req.buffer("query");
  p.key_cache = req.buffer("key_cache");
  p.value_cache = req.buffer("value_cache");
  p.block_tables = static_cast<const int*>(req.buffer("block_tables"));
  p.seq_lens = static_cast<const int*>(req.buffer("seq_lens"));
  if (req.has("alibi_slopes")) p.alibi_slopes = static_cast<const float*>(req.buffer("alibi_slopes"));
  if (req.has("exp_sums")) {
    p.exp_sums = static_cast<float*>(req.buffer("exp_sums"));
    p.max_logits = static_cast<float*>(req.buffer("max_logits"));
    p.tmp_out = req.buffer("tmp_out");
    p.max_num_partitions = static_cast<int>(req.integer("max_num_partitions"));
  }
  p.dtype = static_cast<DType>(req.integer("dtype"));
  cache_dtype(req, p);
  p.num_seqs = static_cast<int>(req.integer("num_seqs"));
  p.num_heads = static_cast<int>(req.integer("num_heads"));
  p.num_kv_heads = static_cast<int>(req.integer("num_kv_heads"));
  p.head_size = static_cast<int>(req.integer("head_size"));
  p.block_size = static_cast<int>(req.integer("block_size"));
  p.max_num_blocks_per_seq = static_cast<int>(req.integer("max_num_blocks_per_seq"));
  p.max_seq_len = static_cast<int>(req.integer("max_seq_len"));
  p.q_stride = req.integer("q_stride");
  p.kv_block_stride = req.integer("kv_block_stride");
  p.kv_head_stride = req.integer("kv_head_stride");
  p.scale = static_cast<float>(req.real("scale"));
  if (req.scalars.count("partition_size")) p.partition_size = static_cast<int>(req.integer("partition_size"));
  return p;
}

}  // namespace

#ifndef MINI_VLLM_GQA_ONLY  // lab 02-06's stretch build binds the GQA kernel only

MINI_VLLM_EMU_OP(paged_attention_naive) {
  finish(mini_vllm::launch_paged_attention_naive(attention_params(req), nullptr));
}

MINI_VLLM_EMU_OP(paged_attention_v1) {
  finish(mini_vllm::launch_paged_attention_v1(attention_params(req), nullptr));
}

MINI_VLLM_EMU_OP(paged_attention_v2) {
  finish(mini_vllm::launch_paged_attention_v2(attention_params(req), nullptr));
}

MINI_VLLM_EMU_OP(qk_logits_probe) {
  mini_vllm::QkLogitsProbe probe{};
  probe.logits = static_cast<float*>(req.buffer("logits"));
  probe.logits_stride = req.integer("logits_stride");
  probe.range_max = static_cast<float*>(req.buffer("range_max"));
  probe.num_ranges = static_cast<int>(req.integer("num_ranges"));
  probe.range_tokens = static_cast<int>(req.integer("range_tokens"));
  finish(mini_vllm::launch_qk_logits_probe(attention_params(req), probe, nullptr));
}

MINI_VLLM_EMU_OP(softmax_probe) {
  mini_vllm::SoftmaxProbe probe{};
  probe.rows = static_cast<float*>(req.buffer("rows"));
  probe.lengths = static_cast<const int*>(req.buffer("lengths"));
  probe.stats = static_cast<float*>(req.buffer("stats"));
  probe.num_rows = static_cast<int>(req.integer("num_rows"));
  probe.width = static_cast<int>(req.integer("width"));
  finish(mini_vllm::launch_softmax_probe(probe, nullptr));
}

#endif  // MINI_VLLM_GQA_ONLY

#ifndef MINI_VLLM_ATTENTION_ONLY

MINI_VLLM_EMU_OP(paged_attention_gqa) {
  finish(mini_vllm::launch_paged_attention_gqa(attention_params(req), nullptr));
}

#ifndef MINI_VLLM_GQA_ONLY

MINI_VLLM_EMU_OP(reshape_and_cache) {
  mini_vllm::ReshapeAndCacheParams p{};
  p.key = req.buffer("key");
  p.value = req.buffer("value");
  p.key_cache = req.buffer("key_cache");
  p.value_cache = req.buffer("value_cache");
  p.slot_mapping = static_cast<const int64_t*>(req.buffer("slot_mapping"));
  p.dtype = static_cast<DType>(req.integer("dtype"));
  cache_dtype(req, p);
  p.num_tokens = static_cast<int>(req.integer("num_tokens"));
  p.num_kv_heads = static_cast<int>(req.integer("num_kv_heads"));
  p.head_size = static_cast<int>(req.integer("head_size"));
  p.block_size = static_cast<int>(req.integer("block_size"));
  p.num_blocks = req.integer("num_blocks");
  p.key_stride = req.integer("key_stride");
  p.value_stride = req.integer("value_stride");
  finish(mini_vllm::launch_reshape_and_cache(p, nullptr));
}

MINI_VLLM_EMU_OP(copy_blocks) {
  // As bindings.cpp does on the GPU: arrays of every layer's cache base address.
  const int layers = static_cast<int>(req.integer("num_layers"));
  std::vector<int64_t> key_ptrs, value_ptrs;
  for (int i = 0; i < layers; ++i) {
    key_ptrs.push_back(reinterpret_cast<int64_t>(req.buffer("key_cache_" + std::to_string(i))));
    value_ptrs.push_back(reinterpret_cast<int64_t>(req.buffer("value_cache_" + std::to_string(i))));
  }
  mini_vllm_emu::register_region("key_cache_ptrs", key_ptrs.data(), key_ptrs.size() * 8);
  mini_vllm_emu::register_region("value_cache_ptrs", value_ptrs.data(), value_ptrs.size() * 8);
  finish(mini_vllm::launch_copy_blocks(key_ptrs.data(), value_ptrs.data(),
                                       static_cast<const int64_t*>(req.buffer("block_mapping")),
                                       layers, static_cast<int>(req.integer("num_pairs")),
                                       req.integer("bytes_per_block"), nullptr));
}

MINI_VLLM_EMU_OP(swap_blocks) {
  finish(mini_vllm::launch_swap_blocks(
      static_cast<char*>(req.buffer("dst")), static_cast<const char*>(req.buffer("src")),
      static_cast<const int64_t*>(req.buffer("block_mapping")),
      static_cast<int>(req.integer("num_pairs")), req.integer("bytes_per_block"),
      static_cast<cudaMemcpyKind>(req.integer("kind")), nullptr));
}

#endif  // MINI_VLLM_GQA_ONLY
#endif  // MINI_VLLM_ATTENTION_ONLY
