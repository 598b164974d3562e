// 8-lane fp32 vector helpers for AVX2 + FMA. Included after the target pragma of avx2.cpp
// only; every function has internal linkage. Partial vectors go through a stack buffer.
#pragma once
#include <immintrin.h>
#include <cstring>
#include "vec_exp.h"

namespace {

struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R set1(float a) { return _mm256_set1_ps(a); }
  static inline R load_f32(const float* p, int n) {
    if (n == W) return _mm256_loadu_ps(p);
    float buf[W] = {0};
    std::memcpy(buf, p, n * sizeof(float));
    return _mm256_loadu_ps(buf);
  }
  static inline R bf16_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline R load_bf16(const uint16_t* p, int n) {
    if (n == W) return bf16_to_f32(_mm_loadu_si128((const __m128i*)p));
    uint16_t buf[W] = {0};
    std::memcpy(buf, p, n * sizeof(uint16_t));
    return bf16_to_f32(_mm_loadu_si128((const __m128i*)buf));
  }
  template <int EXP_BITS>  // as vec_avx512.h: through fp16
  static inline R load_fp8(const uint8_t* p, int n) {
    int64_t buf = 0;
    std::memcpy(&buf, p, n);
    __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(buf)), 8);
    if constexpr (EXP_BITS == 5) return _mm256_cvtph_ps(h);
    const __m128i sign = _mm_set1_epi16((short)0x8000);
    h = _mm_or_si128(_mm_and_si128(h, sign), _mm_srli_epi16(_mm_andnot_si128(sign, h), 1));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  }
  static inline R transpose_sum(const R* v) {
    R t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    R t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    R u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  static inline R load_masked_or(const float* p, int n, float fill) {
    if (n == W) return _mm256_loadu_ps(p);
    float buf[W];
    for (int i = 0; i < W; ++i) buf[i] = i < n ? p[i] : fill;
    return _mm256_loadu_ps(buf);
  }
  static inline R copysign(R t, R s) {
    const R sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, t), _mm256_and_ps(sign, s));
  }
  static inline void store_f32(float* p, R v, int n) {
    if (n == W) { _mm256_storeu_ps(p, v); return; }
    float buf[W];
    _mm256_storeu_ps(buf, v);
    std::memcpy(p, buf, n * sizeof(float));
  }
  // fp32 -> bf16 bits, round to nearest even (NaN inputs are not expected here).
  static inline __m256i bf16_bits(R v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  }
  static inline void store_bf16(uint16_t* p, R v, int n) {
    __m256i b = bf16_bits(v);
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (n == W) { _mm_storeu_si128((__m128i*)p, h); return; }
    uint16_t buf[W];
    _mm_storeu_si128((__m128i*)buf, h);
    std::memcpy(p, buf, n * sizeof(uint16_t));
  }
  static inline R round_bf16(R v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
  // One float to bf16 bits, round to nearest even, as bf16_bits.
  static inline uint16_t bf16(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  // v rounded to nearest even into int8 (saturated), + 128 if is_unsigned: W bytes at p.
  static inline void store_int8(uint8_t* p, R v, bool is_unsigned) {
    const __m256i q = _mm256_cvtps_epi32(v);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i*)p, _mm_add_epi8(_mm_packs_epi16(q16, q16), _mm_set1_epi8(is_unsigned ? (char)0x80 : 0)));
  }
  static inline R abs(R v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R div(R a, R b) { return _mm256_div_ps(a, b); }
  static inline R max(R a, R b) { return _mm256_max_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float reduce_add(R v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float reduce_max(R v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline R min(R a, R b) { return _mm256_min_ps(a, b); }
  static inline R fnma(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }
  static inline R round_nearest(R v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n: n in [-127, 128] (exp's clamp); the exponent built in two halves so 2^128 holds.
  static inline R scale_pow2(R p, R n) {
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i half = _mm256_srai_epi32(ni, 1);
    R s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    R s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  }
  static inline R exp(R x) { return exp_f32<Vec>(x); }
};

}  // namespace
