// 16-lane fp32 vector helpers for AVX-512 (F, BW, VL, DQ, BF16). Included after the
// target pragma of avx512.cpp only; every function has internal linkage.
#pragma once
#include <immintrin.h>
#include "vec_exp.h"

namespace {

struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static inline __mmask16 mask(int n) { return (__mmask16)((1u << n) - 1u); }
  // The first n of 32 16-bit words (all of them from 32 on).
  static inline __mmask32 mask32(int64_t n) { return n >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << n) - 1u); }
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R set1(float a) { return _mm512_set1_ps(a); }
  static inline R load_f32(const float* p, int n) {
    return n == W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask(n), p);
  }
  static inline R load_bf16(const uint16_t* p, int n) {
    __m256i h = n == W ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // fp8 bytes -> fp32 through fp16 (F16C, exact): e5m2 is the top byte of an fp16; e4m3's
  // 7 exponent+mantissa bits shifted under fp16's sign are the value / 256 (subnormals
  // included), so one multiply of a normal float finishes it.
  template <int EXP_BITS>
  static inline R load_fp8(const uint8_t* p, int n) {
    __m128i b = n == W ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8(mask(n), p);
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    if constexpr (EXP_BITS == 5) return _mm512_cvtph_ps(h);
    const __m256i sign = _mm256_set1_epi16((short)0x8000);
    h = _mm256_or_si256(_mm256_and_si256(h, sign), _mm256_srli_epi16(_mm256_andnot_si256(sign, h), 1));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  }
  // n floats from p, the other lanes ``fill``.
  static inline R load_masked_or(const float* p, int n, float fill) {
    return n == W ? _mm512_loadu_ps(p) : _mm512_mask_loadu_ps(_mm512_set1_ps(fill), mask(n), p);
  }
  // |t| with the sign of s.
  static inline R copysign(R t, R s) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(t)),
                                               _mm512_and_si512(sign, _mm512_castps_si512(s))));
  }
  // Lane t of the result: the sum of v[t]'s lanes, for W vectors (four rounds of pairwise
  // folds, then one permute back to token order).
  static inline R transpose_sum(const R* v) {
    R c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)
      d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)
      e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    R f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // f's lane i holds token (i % 4) * 4 + i / 4; the same map undoes it.
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, f);
  }
  static inline void store_f32(float* p, R v, int n) {
    if (n == W) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, mask(n), v);
  }
  static inline __m256i to_bf16(R v) { return (__m256i)_mm512_cvtneps_pbh(v); }
  static inline void store_bf16(uint16_t* p, R v, int n) {
    __m256i h = to_bf16(v);
    if (n == W) _mm256_storeu_si256((__m256i*)p, h); else _mm256_mask_storeu_epi16(p, mask(n), h);
  }
  // Round to bf16 precision and back (torch rounds every bf16 op's result).
  static inline R round_bf16(R v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
  // One float to bf16 bits (round to nearest even).
  static inline uint16_t bf16(float f) {
    return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(f)));
  }
  // v rounded to nearest even into int8 (saturated), + 128 if is_unsigned: W bytes at p.
  static inline void store_int8(uint8_t* p, R v, bool is_unsigned) {
    const __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
    _mm_storeu_si128((__m128i*)p, _mm_add_epi8(q, _mm_set1_epi8(is_unsigned ? (char)0x80 : 0)));
  }
  static inline R abs(R v) { return _mm512_abs_ps(v); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R div(R a, R b) { return _mm512_div_ps(a, b); }
  static inline R max(R a, R b) { return _mm512_max_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float reduce_add(R v) { return _mm512_reduce_add_ps(v); }
  static inline float reduce_max(R v) { return _mm512_reduce_max_ps(v); }
  static inline R min(R a, R b) { return _mm512_min_ps(a, b); }
  static inline R fnma(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline R round_nearest(R v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static inline R scale_pow2(R p, R n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
  static inline R exp(R x) { return exp_f32<Vec>(x); }
};

}  // namespace
