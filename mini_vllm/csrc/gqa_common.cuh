// What the GQA-aware scalar kernel and its two steps share (mini_vllm/csrc/paged_attention_gqa.cu
// and lab 02-06's stretch starter, stretch_gqa.cu, both include it before gqa_logits and
// gqa_values, and gqa_scalar_kernel.cuh after them).
#pragma once

#include "common.cuh"

namespace mini_vllm {

constexpr int kGqaThreads = 128;
constexpr int kMaxGroup = 8;  // query heads computed by one thread block
// Thread blocks that must fit on one SM at once: with 4, ptxas keeps the kernel within
// 65536 / (4 * 128) = 128 registers per thread. Without it ptxas takes 148 on sm_90 (fp16, d128,
// block 16), 3 blocks per SM, and the default shape's 512 blocks need 1.29 waves of 396 slots.
// scripts/gqa_sass_report.py shows registers, spills and occupancy per instantiation.
// Head size 256 with blocks of 16 or 32 tokens keeps more values in flight per lane (its value
// loop holds 32 or 64 of them); it gets up to 255 registers (2 blocks per SM) so that nothing
// spills (with 3, ptxas spills at block size 16).
template <int HEAD_SIZE, int BLOCK_SIZE>
constexpr int gqa_min_blocks_per_sm() {
  return HEAD_SIZE < 256 || BLOCK_SIZE == 8 ? 4 : 2;
}

// What one thread block of the scalar kernel works on: query heads [head0, head0 + num_q) of
// KV head kv_head, over the KV blocks [first_block, end_block) of sequence seq.
struct GqaWork {
  int kv_head;
  int head0;
  int num_q;        // query heads of this chunk, at most kMaxGroup
  int seq;
  int part;
  int seq_len;
  int first_block;
  int end_block;
  int start_token;  // first_block * BLOCK_SIZE: logits[g][i] is token start_token + i
  int num_tokens;   // tokens of the range that exist
  const int* block_table;
};

}  // namespace mini_vllm
