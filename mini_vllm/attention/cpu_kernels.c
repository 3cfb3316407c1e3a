/* The engine's CPU hot path in C: the paged cache write and PagedAttention decode (fp32), and
 * the linear layers' products for a decode step's few rows (fp32 or bf16 weights, or GGUF's
 * Q4_1 and Q8_0 blocks). OpenMP spreads each over the threads PyTorch is set to (the same
 * runtime: PyTorch loads it first).
 *
 * Same contract as lab 02-04's PyTorch ops (mini_vllm/attention/cache_ops.py and paged_attn.py)
 * and the same layouts: key_cache [num_blocks, num_kv_heads, head_size / 4, block_size, 4] (x = 4
 * floats = 16 bytes), value_cache [num_blocks, num_kv_heads, head_size, block_size]. What differs
 * is how the cache is read: the PyTorch op gathers each sequence's context into a contiguous copy
 * and multiplies that; here each (sequence, query head) walks its block table and reads every
 * block where it lies, as lab 02-06's CUDA kernel does, so nothing is copied or allocated.
 *
 * Both functions check every input before they write anything and return an MV_* code (0: done);
 * `*bad` then names the offending row (token or sequence). Python turns a code into ValueError.
 *
 * upstream: csrc/cpu/attention.cpp:256 @ v0.11.0 (the same loop nest, also for block size 16
 * only: logits a block at a time, the softmax over the row, then the values accumulated per head
 * element across the block's 16 lanes and summed once at the end)
 * upstream: csrc/cpu/cache.cpp:42 @ v0.11.0 (the write)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MV_AVX2 1
#else
#define MV_AVX2 0
#endif

enum { MV_OK = 0, MV_BAD_SEQ_LEN = 1, MV_BAD_BLOCK = 2, MV_BAD_SLOT = 3, MV_NO_MEMORY = 4 };
enum { X = 4, BS = 16 };        /* the decode's layout: fp32 (x = 4) and block size 16 */
#define MV_MAX_HEAD_SIZE 256    /* the query's lane pairs live on the stack */

/* key[t, h, d] -> key_cache[b, h, d / x, o, d % x] and value[t, h, d] -> value_cache[b, h, d, o]
 * for slot = b * block_size + o = slots[t] >= 0; a negative slot is a padding token, skipped.
 * key and value are [num_tokens, num_kv_heads, head_size] with heads and dims contiguous; their
 * token strides may be longer (slices of a fused QKV projection's output). */
int mv_reshape_and_cache_f32(const float *key, int64_t key_token_stride, const float *value,
                             int64_t value_token_stride, float *key_cache, float *value_cache,
                             const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                             int64_t head_size, int64_t block_size, int64_t num_slots,
                             int64_t *bad) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] >= num_slots) {
      *bad = t;
      return MV_BAD_SLOT;
    }
  }
  const int64_t head_elems = head_size * block_size; /* one KV head of one block */
  /* (token, head) pairs write disjoint slots: spread over the threads when there is enough. */
#pragma omp parallel for collapse(2) schedule(static) \
    if (num_tokens * num_kv_heads * head_size >= 32768)
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      const float *k = key + t * key_token_stride + h * head_size;
      const float *v = value + t * value_token_stride + h * head_size;
      float *kc = key_cache + (block * num_kv_heads + h) * head_elems + offset * X;
      float *vc = value_cache + (block * num_kv_heads + h) * head_elems + offset;
      for (int64_t d = 0; d < head_size; ++d) {
        kc[(d / X) * block_size * X + d % X] = k[d];
        vc[d * block_size] = v[d];
      }
    }
  }
  return MV_OK;
}

/* GCC/Clang vectors of 8 floats (one AVX register, or two SSE ones), so that the accumulators
 * stay in registers: a key block's chunk (16 tokens x 4 lanes) is 8 of them, a value block's row
 * (16 tokens) 2. v8u loads from any float address. A comparison of two v8 gives a v8i mask
 * (-1 where true). */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* mask ? a : b, lane by lane. */
static inline v8 select8(v8i mask, v8 a, v8 b) {
  return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* exp(v) for v <= 0 (a logit minus its row's maximum), 8 at a time in plain arithmetic (a call
 * to expf would run one at a time, and branches keep a loop from vectorizing): v = k ln 2 + r
 * with |r| <= ln(2) / 2, exp(r) by Cephes' degree-6 polynomial (relative error about 1e-7, as
 * expf's), times 2^k written into the exponent bits. Below -87 the result is 0 (expf's would be
 * a subnormal, far below what a softmax weight can add to a sum near 1); NaN stays NaN. */
static inline v8 exp_nonpositive8(v8 v) {
  const v8i low = v < splat(-87.0f);
  const v8 clamped = select8(low, splat(-87.0f), v);
  /* Adding 1.5 * 2^23 rounds to an integer held in the low mantissa bits: k, and its bits. */
  const v8 shifted = clamped * 1.44269504088896341f + 12582912.0f;
  const v8 k = shifted - 12582912.0f;
  const v8 two_k = (v8)(((v8i)shifted - 0x4B400000 + 127) << 23);
  const v8 r = clamped - k * 0.693359375f + k * 2.12194440e-4f; /* ln 2 in two parts */
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 e = p * r * r + r + 1.0f;
  return select8(low, splat(0.0f), e * two_k);
}

/* One number, the same bits as its lane of exp_nonpositive8 (for the ends of rows). */
static inline float exp_nonpositive(float v) { return exp_nonpositive8(splat(v))[0]; }

static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* out[i] = the sum of vector i's 8 lanes, for 4 vectors at once. */
static inline void hsum4(float *out, v8 a, v8 b, v8 c, v8 d) {
#if MV_AVX2
  /* Pairs, then quads, then the two halves: [a b c d] in 5 instructions. */
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b),
                                      _mm256_hadd_ps((__m256)c, (__m256)d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(quads),
                                _mm256_extractf128_ps(quads, 1)));
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

/* The 16 logits of a key block: acc[r] holds token 2r's 4 partial sums in lanes 0-3 and token
 * 2r + 1's in lanes 4-7; row[t] = scale * ((l0 + l1) + (l2 + l3)) of token t. */
static inline void block_logits(float *row, const v8 *acc, float scale) {
#if MV_AVX2
  /* Three rounds of pairwise sums leave tokens 0 2 4 6 | 1 3 5 7 (the same sums, the same
   * order); one permutation puts them in order. */
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int half = 0; half < 2; ++half) {
    const __m256 *a = (const __m256 *)acc + 4 * half;
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm256_storeu_ps(row + 8 * half,
                     _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_permutevar8x32_ps(sums, order)));
  }
#else
  for (int t = 0; t < BS; ++t) {
    const v8 a = acc[t / 2];
    const int o = X * (t % 2);
    row[t] = scale * ((a[o] + a[o + 1]) + (a[o + 2] + a[o + 3]));
  }
#endif
}

/* Decode G query heads that share one KV head (G = 1 or 2; GQA groups go two at a time, so
 * each key and value vector loaded serves both): out[g] = softmax(scale * K q[g]) V over the
 * first len tokens of the blocks `table` names. q and out point at the first of the G heads
 * (consecutive, head_size apart); logits has G rows of `stride` floats (len rounded up to BS).
 * Inlined with G a constant, so that the per-head loops unroll into registers. */
static inline __attribute__((always_inline)) void decode_heads(
    const int G, float *restrict out, const float *restrict q, const float *restrict key_cache,
    const float *restrict value_cache, const int32_t *restrict table, int64_t len,
    int64_t kv_head, int64_t num_kv_heads, int64_t head_size, float scale,
    float *restrict logits, int64_t stride) {
  const int64_t head_elems = head_size * BS, chunks = head_size / X;
  const int64_t used = (len + BS - 1) / BS, full = len / BS, tail = len - full * BS;
  if (len == 0) {
    memset(out, 0, sizeof(float) * head_size * G);
    return;
  }
  /* Chunk c of each query, twice: it meets two tokens' lanes at once. */
  v8 q_pairs[2][MV_MAX_HEAD_SIZE / X];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      const float *qc = q + g * head_size + X * c;
      q_pairs[g][c] = (v8){qc[0], qc[1], qc[2], qc[3], qc[0], qc[1], qc[2], qc[3]};
    }
  float row_max[2] = {-INFINITY, -INFINITY};
  for (int64_t j = 0; j < used; ++j) {
    const float *kb = key_cache + ((int64_t)table[j] * num_kv_heads + kv_head) * head_elems;
    /* The next block lies elsewhere in the cache: ask for it while this one is summed. */
    const float *next = j + 1 < used
        ? key_cache + ((int64_t)table[j + 1] * num_kv_heads + kv_head) * head_elems : kb;
    v8 acc[2][BS / 2] = {{0}}; /* acc[g][r]: token 2r's lanes (0-3), token 2r + 1's (4-7) */
    for (int64_t c = 0; c < chunks; ++c) {
      for (int line = 0; line < 4; ++line) __builtin_prefetch(next + BS * X * c + 16 * line);
      for (int r = 0; r < BS / 2; ++r) {
        const v8 k = *(const v8u *)(kb + BS * X * c + 8 * r);
        for (int g = 0; g < G; ++g) acc[g][r] += q_pairs[g][c] * k;
      }
    }
    /* Every token's 4 lanes summed, all 16 stored (the last block's slots past len are stale:
     * their logits are never used); the maximum over the real ones. */
    for (int g = 0; g < G; ++g) {
      float *row = logits + g * stride + j * BS;
      block_logits(row, acc[g], scale);
      const int64_t n = j < full ? BS : tail;
      for (int64_t t = 0; t < n; ++t)
        if (row[t] > row_max[g]) row_max[g] = row[t];
    }
  }
  float total[2] = {0.0f, 0.0f};
  for (int g = 0; g < G; ++g) {
    float *row = logits + g * stride;
    int64_t t = 0;
    for (; t + 8 <= len; t += 8)
      *(v8u *)(row + t) = exp_nonpositive8(*(const v8u *)(row + t) - row_max[g]);
    for (; t < len; ++t) row[t] = exp_nonpositive(row[t] - row_max[g]);
    for (int64_t t = 0; t < len; ++t) total[g] += row[t];
    for (t = len; t < used * BS; ++t) row[t] = 0.0f; /* the stale slots weigh nothing */
  }
  /* Values, four head elements at a time (per head, 8 accumulators: 8 of a dim's 16 token lanes
   * each) over every block; in a last, partial block the stale slots' values are zeroed before
   * they are weighed (NaN times a zero weight would still be NaN). */
  const v8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8i real0 = lane < splat((float)tail), real1 = lane + 8.0f < splat((float)tail);
  for (int64_t d0 = 0; d0 < head_size; d0 += 4) {
    v8 acc[2][8] = {{0}};
    for (int64_t j = 0; j < used; ++j) {
      const float *vb = value_cache
          + ((int64_t)table[j] * num_kv_heads + kv_head) * head_elems + d0 * BS;
      if (j + 1 < used) {
        const float *next = value_cache
            + ((int64_t)table[j + 1] * num_kv_heads + kv_head) * head_elems + d0 * BS;
        for (int line = 0; line < 4; ++line) __builtin_prefetch(next + 16 * line);
      }
      v8 w0[2], w1[2];
      for (int g = 0; g < G; ++g) {
        w0[g] = *(const v8u *)(logits + g * stride + j * BS);
        w1[g] = *(const v8u *)(logits + g * stride + j * BS + 8);
      }
      const int partial = j == full;
      for (int dd = 0; dd < 4; ++dd) {
        v8 v0 = *(const v8u *)(vb + BS * dd), v1 = *(const v8u *)(vb + BS * dd + 8);
        if (partial) {
          v0 = select8(real0, v0, splat(0.0f));
          v1 = select8(real1, v1, splat(0.0f));
        }
        for (int g = 0; g < G; ++g) {
          acc[g][2 * dd] += w0[g] * v0;
          acc[g][2 * dd + 1] += w1[g] * v1;
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      float sums[4];
      hsum4(sums, acc[g][0] + acc[g][1], acc[g][2] + acc[g][3], acc[g][4] + acc[g][5],
            acc[g][6] + acc[g][7]);
      for (int dd = 0; dd < 4; ++dd) out[g * head_size + d0 + dd] = sums[dd] / total[g];
    }
  }
}

/* out[s, h] = softmax_t(scale * q[s, h] . k_t) v_t over the seq_lens[s] tokens of sequence s,
 * read through block_tables[s] (row stride table_cols) from KV head h / (num_heads /
 * num_kv_heads). Block size 16, fp32, head_size a multiple of 4 up to MV_MAX_HEAD_SIZE (Python
 * checks these). Only tokens below seq_len are read, so a stale slot, even NaN, never reaches
 * the output. A sequence of length 0 gets zeros. q and out: contiguous [num_seqs, num_heads,
 * head_size]. */
int mv_paged_decode_f32(float *out, const float *q, const float *key_cache,
                        const float *value_cache, const int32_t *block_tables, int64_t table_cols,
                        const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_size, int64_t num_blocks, float scale,
                        int64_t *bad) {
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens[s];
    if (len < 0 || len > table_cols * BS) {
      *bad = s;
      return MV_BAD_SEQ_LEN;
    }
    for (int64_t j = 0; j * BS < len; ++j) {
      const int64_t b = block_tables[s * table_cols + j];
      if (b < 0 || b >= num_blocks) {
        *bad = s;
        return MV_BAD_BLOCK;
      }
    }
    if (len > longest) longest = len;
  }
  const int64_t stride = (longest + BS - 1) / BS * BS + 1; /* a logits row, and one spare */
  const int64_t group = num_heads / num_kv_heads;
  int failed = 0;
  /* Each (sequence, KV head, pair of its query heads) is independent: the threads share them
   * out, each with its own logits rows; a short batch stays on one thread (a thread's start
   * costs more than it). Pairs, not whole GQA groups, so that one sequence's 3 groups of 3
   * heads split 5:4 over two threads, not 6:3. */
  const int64_t pairs = (group + 1) / 2;
#pragma omp parallel if (num_seqs * num_kv_heads * pairs > 1 && num_seqs * longest * group >= 128)
  {
    float *logits = malloc(sizeof(float) * 2 * stride);
    if (!logits) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        for (int64_t pair = 0; pair < pairs; ++pair) {
          if (!logits) continue; /* every thread still takes part in the loop */
          const int64_t g = 2 * pair, at = (s * num_heads + kv * group + g) * head_size;
          const int32_t *table = block_tables + s * table_cols;
          if (g + 2 <= group)
            decode_heads(2, out + at, q + at, key_cache, value_cache, table, seq_lens[s], kv,
                         num_kv_heads, head_size, scale, logits, stride);
          else
            decode_heads(1, out + at, q + at, key_cache, value_cache, table, seq_lens[s], kv,
                         num_kv_heads, head_size, scale, logits, stride);
        }
      }
    }
    free(logits);
  }
  return failed ? MV_NO_MEMORY : MV_OK;
}

/* ---------------------------------------------------------------- the linear layers' matmul
 * out[m, n] = x[m, :] . w[n, :] (+ bias[n]): nn.Linear's y = x W^T + b, x fp32 [M, K] with rows
 * x_stride apart, out fp32 [M, N] contiguous, w [N, K] contiguous in one of these formats:
 *   fp32; bf16 (the top half of an fp32 number);
 *   Q4_1 and Q8_0, the GGUF file's (llama.cpp's) blocks of 32 consecutive weights of a row (K a
 *   multiple of 32): Q4_1 = fp16 scale d, fp16 minimum m, 16 bytes of 4-bit codes (byte j holds
 *   weight j in its low nibble, weight j + 16 in its high one), weight = d * code + m, 20 bytes;
 *   Q8_0 = fp16 scale d, 32 int8 codes, weight = d * code, 34 bytes.
 * Every weight is widened to fp32 in registers, rounded as gguf's dequantize rounds it (d * code,
 * then + m: two roundings, never fused), so a product with quantized weights equals the fp32
 * product with the dequantized weights bit for bit.
 *
 * Decode reads every weight once per step for a handful of rows, so the loop is built to stream
 * w at the memory's speed: one weight row at a time, front to back, for 4 tokens at once (each
 * weight vector loaded once for 4 tokens), the rows split over the OpenMP threads in groups of 4.
 * One loop serves every format; only
 * the load differs (load_w). Every output is the same sum in the same order whatever M and the
 * thread count are, so a token's result does not depend on what else is in the batch. */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint8_t v8b __attribute__((vector_size(8), aligned(1), may_alias));
typedef int8_t v8c __attribute__((vector_size(8), aligned(1), may_alias));

/* W_BF16_UNPACK: bf16 on AVX2, 16 at a time: interleaving zeros below each bf16 number (unpack)
 * makes fp32 numbers in two instructions, no shifts, but in the column order 0-3 8-11 | 4-7
 * 12-15; the tokens' x is read from a copy in that same order (see permute_x). */
enum { W_F32, W_BF16, W_BF16_UNPACK, W_Q4_1, W_Q8_0 };
enum { QBLOCK = 32, Q4_1_BYTES = 20, Q8_0_BYTES = 34 };

/* Columns one load_w covers: a quantized block (four vectors of 8), or two vectors of 8. */
#define STEP(F) ((F) >= W_Q4_1 ? QBLOCK : 16)

/* IEEE half -> float, exactly (normal, subnormal, zero, infinity, NaN). */
static inline float half_to_float(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fff;
  uint32_t bits;
  if (em >= 0x7c00) {
    bits = sign | 0x7f800000 | (em & 0x3ff) << 13;
  } else if (em >= 0x0400) {
    bits = sign | ((em << 13) + ((127 - 15) << 23));
  } else {
    const float f = (float)em * 5.9604644775390625e-8f; /* em * 2^-24: exact */
    memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* 8 bytes as 8 int32, unsigned (Q4_1's code pairs) or signed (Q8_0's codes): one instruction on
 * AVX2, which gcc does not find from __builtin_convertvector (it builds the vector a lane at a
 * time). */
static inline __attribute__((always_inline)) v8i widen8(const int is_signed, const uint8_t *p) {
#if MV_AVX2
  const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
  return (v8i)(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  return is_signed ? __builtin_convertvector(*(const v8c *)p, v8i)
                   : __builtin_convertvector(*(const v8b *)p, v8i);
#endif
}

/* Row `row`'s weights at columns k .. k + STEP(F) - 1 as fp32 vectors of 8, wv[0] first. */
static inline __attribute__((always_inline)) void load_w(const int F, v8 *restrict wv,
                                                          const void *restrict w, int64_t row,
                                                          int64_t K, int64_t k) {
  if (F == W_F32) {
    wv[0] = *(const v8u *)((const float *)w + row * K + k);
    wv[1] = *(const v8u *)((const float *)w + row * K + k + 8);
  } else if (F == W_BF16) {
    for (int s = 0; s < 2; ++s) {
      const v8i wide = __builtin_convertvector(
          *(const v8h *)((const uint16_t *)w + row * K + k + 8 * s), v8i);
      wv[s] = (v8)(wide << 16);
    }
  } else if (F == W_BF16_UNPACK) {
#if MV_AVX2
    const __m256i zero = _mm256_setzero_si256();
    const __m256i packed = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + row * K + k));
    wv[0] = (v8)_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, packed));
    wv[1] = (v8)_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, packed));
#endif
  } else if (F == W_Q4_1) {
    const uint8_t *blk = (const uint8_t *)w + (row * (K / QBLOCK) + k / QBLOCK) * Q4_1_BYTES;
    const float d = half_to_float(blk), m = half_to_float(blk + 2);
    for (int h = 0; h < 2; ++h) { /* bytes 8h .. 8h + 7: weights 8h.. (low), 16 + 8h.. (high) */
      const v8i codes = widen8(0, blk + 4 + 8 * h);
      wv[h] = __builtin_convertvector(codes & 15, v8) * d + m;
      wv[h + 2] = __builtin_convertvector(codes >> 4, v8) * d + m;
    }
  } else { /* W_Q8_0 */
    const uint8_t *blk = (const uint8_t *)w + (row * (K / QBLOCK) + k / QBLOCK) * Q8_0_BYTES;
    const float d = half_to_float(blk);
    for (int s = 0; s < 4; ++s)
      wv[s] = __builtin_convertvector(widen8(1, blk + 2 + 8 * s), v8) * d;
  }
}

/* One weight for the columns past the last whole STEP (fp32 and bf16 only: a quantized row is
 * whole blocks). */
static inline __attribute__((always_inline)) float scalar_w(const int F, const void *w,
                                                             int64_t i) {
  if (F == W_F32) return ((const float *)w)[i];
  const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* a * b + c: one fused instruction where the CPU has one (an explicit FMA rounds once,
 * wherever it stands; the file is compiled with -ffp-contract=off so nothing else is fused). */
static inline v8 madd(v8 a, v8 b, v8 c) {
#if MV_AVX2
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* Weight row n x T tokens (from m); F and T are constants once inlined. Each output is summed
 * in two accumulators of 8 lanes, the even 8-column groups of the row in one and the odd ones in
 * the other: two independent chains of multiply-adds, and the row read front to back, one
 * sequential stream (what the memory's prefetchers serve fastest; four rows read side by side
 * were 10-20% slower here). The whole STEPs read x from xs (x itself, or its permuted copy for
 * W_BF16_UNPACK), the rest from x. */
static inline __attribute__((always_inline)) void linear_block(
    const int F, const int T, float *restrict out, const float *restrict x, int64_t x_stride,
    const float *restrict xs, int64_t xs_stride, const void *restrict w,
    const float *restrict bias, int64_t N, int64_t K, int64_t n, int64_t m) {
  const int64_t whole = K / STEP(F) * STEP(F);
  v8 acc[4][2] = {{{0}}};
  for (int64_t k = 0; k < whole; k += STEP(F)) {
    v8 wv[4];
    load_w(F, wv, w, n, K, k);
    for (int t = 0; t < T; ++t)
      for (int s = 0; s < STEP(F) / 8; ++s)
        acc[t][s % 2] = madd(wv[s], *(const v8u *)(xs + (m + t) * xs_stride + k + 8 * s),
                             acc[t][s % 2]);
  }
  for (int t = 0; t < T; ++t) {
    float sum = hsum(acc[t][0] + acc[t][1]);
    for (int64_t k = whole; k < K; ++k)
      sum += scalar_w(F, w, n * K + k) * x[(m + t) * x_stride + k];
    out[(m + t) * N + n] = bias ? sum + bias[n] : sum;
  }
}

/* Weight rows 4b .. 4b + 3 (fewer at the end) for every token: a row at a time, its tokens four
 * at a time (the row is read from memory once and from the L1 cache for the next four). */
static inline __attribute__((always_inline)) void linear_rows(
    const int F, float *out, const float *x, int64_t x_stride, const float *xs,
    int64_t xs_stride, int64_t M, const void *w, const float *bias, int64_t N, int64_t K,
    int64_t b) {
  const int64_t last = 4 * b + 4 < N ? 4 * b + 4 : N;
  for (int64_t n = 4 * b; n < last; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      linear_block(F, 4, out, x, x_stride, xs, xs_stride, w, bias, N, K, n, m);
    for (; m < M; ++m)
      linear_block(F, 1, out, x, x_stride, xs, xs_stride, w, bias, N, K, n, m);
  }
}

/* xp[m, 16j + 0..7] = x[m, 16j + (0-3, 8-11)], xp[m, 16j + 8..15] = x[m, 16j + (4-7, 12-15)]. */
static void permute_x(float *xp, const float *x, int64_t x_stride, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j + 16 <= K; j += 16) {
      const float *src = x + m * x_stride + j;
      float *dst = xp + m * K + j;
      memcpy(dst, src, 4 * sizeof(float));
      memcpy(dst + 4, src + 8, 4 * sizeof(float));
      memcpy(dst + 8, src + 4, 4 * sizeof(float));
      memcpy(dst + 12, src + 12, 4 * sizeof(float));
    }
}

/* The parallel loop is a macro, expanded in each entry point (not a shared inline function), so
 * that OpenMP outlines it with F a constant: one branch-free inner loop per weight format.
 * Below about 64k multiply-adds a thread's start costs more than it saves. */
#define LINEAR_ALL(F, XS, XS_STRIDE)                                                \
  _Pragma("omp parallel for schedule(static) if (M * N * K >= 65536)")             \
  for (int64_t b = 0; b < (N + 3) / 4; ++b)                                         \
    linear_rows(F, out, x, x_stride, XS, XS_STRIDE, M, w, bias, N, K, b)

void mv_linear_f32(float *out, const float *x, int64_t x_stride, int64_t M, const float *w,
                   const float *bias, int64_t N, int64_t K) {
  LINEAR_ALL(W_F32, x, x_stride);
}

void mv_linear_bf16(float *out, const float *x, int64_t x_stride, int64_t M, const uint16_t *w,
                    const float *bias, int64_t N, int64_t K) {
#if MV_AVX2
  float *xp = malloc(sizeof(float) * (M * K > 0 ? M * K : 1));
  if (xp) {
    permute_x(xp, x, x_stride, M, K);
    LINEAR_ALL(W_BF16_UNPACK, xp, K);
    free(xp);
    return;
  }
#endif
  LINEAR_ALL(W_BF16, x, x_stride);
}

/* w: N rows of K / 32 blocks each (Python checks K % 32 == 0). */
void mv_linear_q4_1(float *out, const float *x, int64_t x_stride, int64_t M, const uint8_t *w,
                    const float *bias, int64_t N, int64_t K) {
  LINEAR_ALL(W_Q4_1, x, x_stride);
}

void mv_linear_q8_0(float *out, const float *x, int64_t x_stride, int64_t M, const uint8_t *w,
                    const float *bias, int64_t N, int64_t K) {
  LINEAR_ALL(W_Q8_0, x, x_stride);
}

/* out [N, K] fp32 = the blocks' weights, as gguf's dequantize gives them (for products of many
 * rows, which PyTorch's GEMM computes). */
static inline __attribute__((always_inline)) void dequantize_row(const int F, float *restrict out,
                                                                  const void *restrict w,
                                                                  int64_t n, int64_t K) {
  for (int64_t k = 0; k < K; k += QBLOCK) {
    v8 wv[4];
    load_w(F, wv, w, n, K, k);
    memcpy(out + n * K + k, wv, sizeof wv);
  }
}

void mv_dequantize_q4_1(float *out, const uint8_t *w, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t n = 0; n < N; ++n) dequantize_row(W_Q4_1, out, w, n, K);
}

void mv_dequantize_q8_0(float *out, const uint8_t *w, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t n = 0; n < N; ++n) dequantize_row(W_Q8_0, out, w, n, K);
}

/* ---------------------------------------------------------------- the fused decode step
 * A decode step of a Llama model (one new token per sequence) as one call: for each layer,
 *   h = rmsnorm(x) ; q, k, v = h Wqkv^T (+ b) ; rotate q and k (NeoX halves) ; write k, v into
 *   the layer's paged cache ; a = PagedAttention(q) ; x += a Wo^T (+ b) ;
 *   h = rmsnorm(x) ; g, u = h Wgu^T (+ b) ; x += (silu(g) * u) Wdown^T (+ b)
 * then out = rmsnorm(x) with the final norm. The same operations, in the same order, as
 * mini_vllm/model_executor/models/llama.py's PyTorch modules; the products and the attention are the functions above.
 * On a small model each of those ~40 PyTorch operations a layer costs more in the interpreter
 * than in arithmetic: calling them from here is the CPU's answer to a GPU's CUDA graph. */
typedef struct {
  int32_t qkv_format, o_format, gate_up_format, down_format; /* MV_FMT_* */
  const void *qkv, *o, *gate_up, *down;                       /* weights [N, K] */
  const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;  /* NULL: none */
  const float *input_norm, *post_norm;                        /* [hidden] */
  float *key_cache, *value_cache;
} mv_layer;

typedef struct {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_size, intermediate;
  int64_t num_blocks, max_position;
  float eps, scale;
  const float *cos, *sin; /* [max_position, head_size / 2] */
  const float *final_norm;
} mv_model;

enum { MV_FMT_F32 = 0, MV_FMT_BF16 = 1, MV_FMT_Q4_1 = 2, MV_FMT_Q8_0 = 3 };
enum { MV_BAD_POSITION = 5 };

static void linear_any(int32_t fmt, float *out, const float *x, int64_t x_stride, int64_t M,
                       const void *w, const float *bias, int64_t N, int64_t K) {
  switch (fmt) {
    case MV_FMT_BF16: mv_linear_bf16(out, x, x_stride, M, w, bias, N, K); break;
    case MV_FMT_Q4_1: mv_linear_q4_1(out, x, x_stride, M, w, bias, N, K); break;
    case MV_FMT_Q8_0: mv_linear_q8_0(out, x, x_stride, M, w, bias, N, K); break;
    default: mv_linear_f32(out, x, x_stride, M, w, bias, N, K);
  }
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, as RMSNorm.forward (fp32): the product
 * by the reciprocal root, then by the weight. */
static void rms_norm(float *restrict out, const float *restrict x, const float *restrict weight,
                     int64_t T, int64_t n, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float *row = x + t * n;
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const v8 v = *(const v8u *)(row + i);
      acc += v * v;
    }
    float sum = hsum(acc);
    for (; i < n; ++i) sum += row[i] * row[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; ++i) out[t * n + i] = row[i] * r * weight[i];
  }
}

/* silu(g) * u = g * sigmoid(g) * u, 8 at a time, with the exponential of -|g| only:
 * sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|). */
static inline v8 silu_mul8(v8 g, v8 u) {
  const v8i neg = g < splat(0.0f);
  const v8 e = exp_nonpositive8(select8(neg, g, -g));
  return g * (select8(neg, e, splat(1.0f)) / (1.0f + e)) * u;
}

/* act[i] = silu(gate[i]) * up[i] for n numbers (the rest one at a time, the same bits). */
static void silu_mul(float *restrict act, const float *restrict gate, const float *restrict up,
                     int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    *(v8u *)(act + i) = silu_mul8(*(const v8u *)(gate + i), *(const v8u *)(up + i));
  for (; i < n; ++i) act[i] = silu_mul8(splat(gate[i]), splat(up[i]))[0];
}

/* Rotate `heads` heads of head_size at x (heads contiguous) by position pos, in place. */
static void rotate(float *x, int64_t heads, int64_t head_size, const float *cos_row,
                   const float *sin_row) {
  const int64_t half = head_size / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float *x1 = x + h * head_size, *x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos_row[i] - b * sin_row[i];
      x2[i] = b * cos_row[i] + a * sin_row[i];
    }
  }
}

/* x[T, hidden]: the step's embedded tokens, the residual stream (overwritten). out[T, hidden]:
 * the final norm's output. work: T * (2 * hidden + 3 * q + 2 * kv + 3 * intermediate) floats,
 * with q = num_heads * head_size and kv = num_kv_heads * head_size. Sequence t's token is at
 * positions[t], goes to slots[t], and attends over seq_lens[t] tokens (its own included) through
 * block_tables[t]. Every position, slot, length and used block is checked before anything is
 * written (MV_* code, *bad = the token); after that only the attention's logits allocation can
 * fail (MV_NO_MEMORY), with earlier layers' caches already written. */
int mv_decode_step(const mv_model *model, const mv_layer *layers, float *x, float *out,
                   float *work, int64_t T, const int64_t *positions, const int64_t *slots,
                   const int32_t *block_tables, int64_t table_cols, const int32_t *seq_lens,
                   int64_t *bad) {
  const int64_t hidden = model->hidden, hs = model->head_size, inter = model->intermediate;
  const int64_t q_size = model->num_heads * hs, kv_size = model->num_kv_heads * hs;
  const int64_t qkv_size = q_size + 2 * kv_size;
  for (int64_t t = 0; t < T; ++t) {
    if (positions[t] < 0 || positions[t] >= model->max_position) {
      *bad = t;
      return MV_BAD_POSITION;
    }
    if (slots[t] < 0 || slots[t] >= model->num_blocks * BS) {
      *bad = t;
      return MV_BAD_SLOT;
    }
    const int64_t len = seq_lens[t];
    if (len < 1 || len > table_cols * BS) {
      *bad = t;
      return MV_BAD_SEQ_LEN;
    }
    for (int64_t j = 0; j * BS < len; ++j) {
      const int64_t b = block_tables[t * table_cols + j];
      if (b < 0 || b >= model->num_blocks) {
        *bad = t;
        return MV_BAD_BLOCK;
      }
    }
  }
  float *h = work, *tmp = h + T * hidden, *qkv = tmp + T * hidden;
  float *q = qkv + T * qkv_size, *attn = q + T * q_size, *gate_up = attn + T * q_size;
  float *act = gate_up + T * 2 * inter;
  for (int64_t l = 0; l < model->num_layers; ++l) {
    const mv_layer *L = layers + l;
    rms_norm(h, x, L->input_norm, T, hidden, model->eps);
    linear_any(L->qkv_format, qkv, h, hidden, T, L->qkv, L->qkv_bias, qkv_size, hidden);
    for (int64_t t = 0; t < T; ++t) {
      const float *c = model->cos + positions[t] * (hs / 2);
      const float *s = model->sin + positions[t] * (hs / 2);
      float *row = qkv + t * qkv_size;
      rotate(row, model->num_heads + model->num_kv_heads, hs, c, s); /* q and k, adjacent */
      memcpy(q + t * q_size, row, sizeof(float) * q_size);
    }
    int64_t unused;
    mv_reshape_and_cache_f32(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size,
                             L->key_cache, L->value_cache, slots, T, model->num_kv_heads, hs, BS,
                             model->num_blocks * BS, &unused);
    if (mv_paged_decode_f32(attn, q, L->key_cache, L->value_cache, block_tables, table_cols,
                            seq_lens, T, model->num_heads, model->num_kv_heads, hs,
                            model->num_blocks, model->scale, bad) != MV_OK)
      return MV_NO_MEMORY;
    linear_any(L->o_format, tmp, attn, q_size, T, L->o, L->o_bias, hidden, q_size);
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += tmp[i];
    rms_norm(h, x, L->post_norm, T, hidden, model->eps);
    linear_any(L->gate_up_format, gate_up, h, hidden, T, L->gate_up, L->gate_up_bias,
               2 * inter, hidden);
    for (int64_t t = 0; t < T; ++t)
      silu_mul(act + t * inter, gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, inter);
    linear_any(L->down_format, tmp, act, inter, T, L->down, L->down_bias, hidden, inter);
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += tmp[i];
  }
  rms_norm(out, x, model->final_norm, T, hidden, model->eps);
  return MV_OK;
}
