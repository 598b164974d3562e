// AVX-512 kernels (F/BW/VL/DQ + BF16): bf16, int8 and int4 weight GEMMs on AVX512-BF16 dot
// products, plus common.h's kernels on 16-lane vectors. Only ever called on CPUs that
// report these features (ops.cpp checks); nothing here has external linkage but the table.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#include "vec_avx512.h"
#include "common.h"

namespace {

using tokenmill::GemmArgs;

inline __mmask32 mask32(int64_t n) { return n >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << n) - 1u); }

// Weight loaders: 32 consecutive weights of row n from column k, as bf16 pairs.
struct Bf16Weights {
  const uint16_t* w; int64_t ldw, K;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    const uint16_t* p = w + n * ldw + k;
    return (__m512bh)(K - k >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask32(K - k), p));
  }
};

inline __m512bh int16_to_bf16(__m512i v) {  // exact: |v| < 256
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512bh int16_to_bf16(__m512i v, __m512 scale) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale), _mm512_mul_ps(lo, scale));
}

struct Int8Weights {  // codes as they are; the per-channel scale is applied to the sum
  const int8_t* w; int64_t ldw, K;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    const int8_t* p = w + n * ldw + k;
    __m256i b = K - k >= 32 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi8(mask32(K - k), p);
    return int16_to_bf16(_mm512_cvtepi8_epi16(b));
  }
};

// int4 layout (see kernels/quant_layout.py): per row, per 64 columns, 32 bytes whose low
// nibbles are columns 0-31 and high nibbles columns 32-63; code q means (q - 8) * scale,
// and the group's zero is added through the activation sums. Rows are padded to whole
// 64-column chunks (codes 8, i.e. 0), so full loads never leave the row.
struct Int4Weights {
  const uint8_t* w; int64_t ldw; const float* scales; int64_t num_groups, group_size;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + n * ldw + (k >> 6) * 32)));
    __m512i q = (k & 32) ? _mm512_srli_epi16(b, 4) : _mm512_and_si512(b, _mm512_set1_epi16(15));
    q = _mm512_sub_epi16(q, _mm512_set1_epi16(8));
    return int16_to_bf16(q, _mm512_set1_ps(scales[n * num_groups + k / group_size]));
  }
};

struct PanelWeights {  // a 4-row panel already converted to bf16, rows from n0
  const uint16_t* panel; int64_t n0, kpad, K;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    const uint16_t* p = panel + (n - n0) * kpad + k;
    return (__m512bh)(K - k >= 32 ? _mm512_load_si512(p) : _mm512_maskz_loadu_epi16(mask32(K - k), p));
  }
};

// A tile of MR activation rows by NR weight rows: sums of products in fp32 lanes.
template <int MR, int NR, class WL>
inline void tile(const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][4]) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 32) {
    __m512bh w[NR];
    for (int r = 0; r < NR; ++r) w[r] = wl(n0 + r, k);
    const __mmask32 km = mask32(a.K - k);
    for (int m = 0; m < MR; ++m) {
      __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(km, a.x + (m0 + m) * a.ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], x, w[r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <class WL>
inline void tile_any(int mr, int nr, const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][4]) {
#define TM_CASE(M, N) case (M - 1) * 4 + (N - 1): tile<M, N>(a, m0, n0, wl, out); break;
  switch ((mr - 1) * 4 + (nr - 1)) {
    TM_CASE(1, 1) TM_CASE(1, 2) TM_CASE(1, 3) TM_CASE(1, 4)
    TM_CASE(2, 1) TM_CASE(2, 2) TM_CASE(2, 3) TM_CASE(2, 4)
    TM_CASE(3, 1) TM_CASE(3, 2) TM_CASE(3, 3) TM_CASE(3, 4)
    TM_CASE(4, 1) TM_CASE(4, 2) TM_CASE(4, 3) TM_CASE(4, 4)
  }
#undef TM_CASE
}

// Per-output epilogue: scale (int8), group zeros (int4), bias; rounded to bf16.
enum Kind { kBf16, kInt8, kInt4 };

template <Kind KIND>
inline float finish(const GemmArgs& a, int64_t m, int64_t n, float s) {
  if constexpr (KIND == kInt8) s *= a.scales[n];
  if constexpr (KIND == kInt4) {
    const float* z = a.zeros + n * a.num_groups;
    const float* xs = a.xsum + m * a.num_groups;
    for (int64_t g = 0; g < a.num_groups; ++g) s += z[g] * xs[g];
  }
  if (a.bias) s += a.bias[n];
  return s;
}

inline uint16_t to_bf16(float f) {
  return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(f)));
}

template <Kind KIND, class WL>
void gemm_tiles(const GemmArgs& a, int64_t n0, int64_t n1, const WL& wl) {
  float out[4][4];
  for (int64_t n = n0; n < n1; n += 4) {
    const int nr = (int)min64(4, n1 - n);
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      tile_any(mr, nr, a, m, n, wl, out);
      for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) a.y[(m + i) * a.ldy + n + r] = to_bf16(finish<KIND>(a, m + i, n + r, out[i][r]));
    }
  }
}

// Quantized weights with more than one 4-row tile of activations: each 4-channel panel is
// converted to bf16 once into a buffer that stays in L2, then every row tile reads it.
template <Kind KIND, class WL>
void gemm_panels(const GemmArgs& a, int64_t n0, int64_t n1, const WL& wl) {
  const int64_t kpad = (a.K + 31) / 32 * 32;
  uint16_t* panel = static_cast<uint16_t*>(std::aligned_alloc(64, 4 * kpad * sizeof(uint16_t)));
  for (int64_t n = n0; n < n1; n += 4) {
    const int nr = (int)min64(4, n1 - n);
    for (int r = 0; r < nr; ++r)
      for (int64_t k = 0; k < a.K; k += 32) _mm512_store_si512(panel + r * kpad + k, (__m512i)wl(n + r, k));
    PanelWeights pw{panel, n, kpad, a.K};
    float out[4][4];
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      tile_any(mr, nr, a, m, n, pw, out);
      for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) a.y[(m + i) * a.ldy + n + r] = to_bf16(finish<KIND>(a, m + i, n + r, out[i][r]));
    }
  }
  std::free(panel);
}

void gemm_bf16(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_tiles<kBf16>(a, n0, n1, Bf16Weights{static_cast<const uint16_t*>(a.w), a.ldw, a.K});
}

void gemm_int8(const GemmArgs& a, int64_t n0, int64_t n1) {
  Int8Weights wl{static_cast<const int8_t*>(a.w), a.ldw, a.K};
  if (a.M <= 4) gemm_tiles<kInt8>(a, n0, n1, wl); else gemm_panels<kInt8>(a, n0, n1, wl);
}

void gemm_int4(const GemmArgs& a, int64_t n0, int64_t n1) {
  Int4Weights wl{static_cast<const uint8_t*>(a.w), a.ldw, a.scales, a.num_groups, a.group_size};
  if (a.M <= 4) gemm_tiles<kInt4>(a, n0, n1, wl); else gemm_panels<kInt4>(a, n0, n1, wl);
}

const tokenmill::KernelTable kTable = {
    "avx512_bf16", gemm_bf16, gemm_int8, gemm_int4, rms_norm_kernel, silu_mul_kernel, rope_kernel, attention_kernel,
};

}  // namespace

const tokenmill::KernelTable* tokenmill::avx512_kernels() { return &kTable; }
