// Emulation stand-in for the CUDA toolkit's <cuda_fp8.h>: the e4m3 type the FP8 KV cache stores,
// with the two conversions the kernels use (float -> e4m3 saturating, e4m3 -> float). Written from
// the format's definition (OCP FP8 "E4M3", torch.float8_e4m3fn), not from the toolkit's code:
//   sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN, so the
//   largest finite value is 1.75 * 2^8 = 448; exponent 0 holds the subnormals m * 2^-9.
// The e5m2 format and the vector types (__nv_fp8x2_e4m3, ...) are left out: no kernel uses them.
#pragma once
#include "../cuda_emulation.h"

#include <cstdio>
#include <cstdlib>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

namespace mini_vllm_emu {

constexpr unsigned char kE4m3MaxFinite = 0x7e;  // 448
constexpr unsigned char kE4m3NaN = 0x7f;

inline float e4m3_to_float(unsigned char bits) {
  const bool negative = bits & 0x80u;
  const int exp = (bits >> 3) & 0xf;
  const int mant = bits & 0x7;
  float v;
  if (exp == 0xf && mant == 0x7) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant * 2^-9, exact
  } else {
    v = std::ldexp(static_cast<float>(8 + mant), exp - 7 - 3);  // (1 + mant/8) * 2^(exp-7)
  }
  return negative ? -v : v;
}

// Round to the nearest e4m3 value, ties to even. Past the largest finite value (448; infinities
// included) SATFINITE gives +-448 and NOSAT gives NaN (e4m3 has no infinity). NaN stays NaN.
inline unsigned char float_to_e4m3(float f, __nv_saturation_t saturate) {
  const uint32_t x = float_bits(f);
  const unsigned char sign = static_cast<unsigned char>((x >> 24) & 0x80u);
  const uint32_t abs_bits = x & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | kE4m3NaN;
  const float a = bits_float(abs_bits);
  unsigned code;
  if (a < 0.015625f) {  // below 2^-6, the smallest normal: a multiple of 2^-9, rounded
    const float steps = a * 512.f;  // exact (a power-of-two scaling of a small value)
    code = static_cast<unsigned>(steps);
    const float rest = steps - static_cast<float>(code);  // exact: steps < 8
    if (rest > 0.5f || (rest == 0.5f && (code & 1u))) ++code;  // 8 is the smallest normal
  } else {
    // Keep 3 of the float's 23 mantissa bits, rounding on the 20 dropped ones; a carry out of
    // the mantissa moves to the next exponent, as the encoding is monotonic.
    const int exp = static_cast<int>(abs_bits >> 23) - 127;  // -6 or more here
    const uint32_t mant = abs_bits & 0x7fffffu;
    code = (static_cast<unsigned>(exp + 7) << 3) | (mant >> 20);
    const uint32_t rest = mant & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
    if (exp > 8) code = 0xff;  // far out of range (the shift above overflowed 7 bits)
  }
  if (code > kE4m3MaxFinite) code = saturate == __NV_SATFINITE ? kE4m3MaxFinite : kE4m3NaN;
  return static_cast<unsigned char>(sign | code);
}

}  // namespace mini_vllm_emu

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                __nv_fp8_interpretation_t fp8_interpretation) {
  if (fp8_interpretation != __NV_E4M3) {
    std::fprintf(stderr, "the CPU emulation implements only the e4m3 format (__NV_E4M3)\n");
    std::abort();
  }
  return mini_vllm_emu::float_to_e4m3(x, saturate);
}

struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e4m3() = default;
  // As the toolkit's: converting a float saturates to +-448 (__NV_SATFINITE).
  explicit __nv_fp8_e4m3(float f) : __x(mini_vllm_emu::float_to_e4m3(f, __NV_SATFINITE)) {}
  explicit operator float() const { return mini_vllm_emu::e4m3_to_float(__x); }
};
