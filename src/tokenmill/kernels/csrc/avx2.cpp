// AVX2 + FMA kernels: the same ops as avx512.cpp on 8-lane vectors, for CPUs without
// AVX-512 BF16 (or when TOKENMILL_CPU_ISA=avx2 forces this path). Weights are converted
// to fp32 in registers and multiplied with FMA, so products match the AVX-512 path's
// bf16 dot products up to summation order.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"
#include "common.h"
#include "rope_kv.h"
#include "prefill.h"

namespace {

using tokenmill::GemmArgs;

struct Bf16Weights {
  const uint16_t* w; int64_t ldw, K;
  inline __m256 operator()(int64_t n, int64_t k) const { return Vec::load_bf16(w + n * ldw + k, (int)min64(8, K - k)); }
};

struct Int8Weights {
  const int8_t* w; int64_t ldw, K;
  inline __m256 operator()(int64_t n, int64_t k) const {
    const int8_t* p = w + n * ldw + k;
    int64_t buf = 0;
    std::memcpy(&buf, p, (size_t)min64(8, K - k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(buf)));
  }
};

struct Int4Weights {  // layout as in avx512.cpp
  const uint8_t* w; int64_t ldw; const float* scales; int64_t num_groups, group_size;
  inline __m256 operator()(int64_t n, int64_t k) const {
    int64_t buf;
    std::memcpy(&buf, w + n * ldw + (k >> 6) * 32 + (k & 31), 8);
    __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(buf));
    __m256i q = (k & 32) ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    __m256 f = _mm256_cvtepi32_ps(q);
    return _mm256_mul_ps(f, _mm256_set1_ps(scales[n * num_groups + k / group_size]));
  }
};

template <int MR, int NR, class WL>
inline void tile(const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][2]) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 8) {
    __m256 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = wl(n0 + r, k);
    const int kn = (int)min64(8, a.K - k);
    for (int m = 0; m < MR; ++m) {
      __m256 x = Vec::load_bf16(a.x + (m0 + m) * a.ldx + k, kn);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(x, w[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = Vec::reduce_add(acc[m][r]);
}

template <class WL>
inline void tile_any(int mr, int nr, const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][2]) {
#define TM_CASE(M, N) case (M - 1) * 2 + (N - 1): tile<M, N>(a, m0, n0, wl, out); break;
  switch ((mr - 1) * 2 + (nr - 1)) {
    TM_CASE(1, 1) TM_CASE(1, 2) TM_CASE(2, 1) TM_CASE(2, 2)
    TM_CASE(3, 1) TM_CASE(3, 2) TM_CASE(4, 1) TM_CASE(4, 2)
  }
#undef TM_CASE
}

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
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

template <Kind KIND, class WL>
void gemm_tiles(const GemmArgs& a, int64_t n0, int64_t n1, const WL& wl) {
  float out[4][2];
  for (int64_t n = n0; n < n1; n += 2) {
    const int nr = (int)min64(2, n1 - n);
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      tile_any(mr, nr, a, m, n, wl, out);
      for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) a.y[(m + i) * a.ldy + n + r] = to_bf16(finish<KIND>(a, m + i, n + r, out[i][r]));
    }
  }
}

void gemm_bf16(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_tiles<kBf16>(a, n0, n1, Bf16Weights{static_cast<const uint16_t*>(a.w), a.ldw, a.K});
}

void gemm_int8(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_tiles<kInt8>(a, n0, n1, Int8Weights{static_cast<const int8_t*>(a.w), a.ldw, a.K});
}

void gemm_int4(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_tiles<kInt4>(a, n0, n1, Int4Weights{static_cast<const uint8_t*>(a.w), a.ldw, a.scales, a.num_groups, a.group_size});
}

// bf16 GEMV over kernels/gemv_layout.py's blocks (see avx512.cpp): per 16-channel block and
// row, two halves of 8 channels; a line's 8 channels x 2 weights split into the even (k) and
// odd (k + 1) weights as fp32, each multiplied by its broadcast x (no horizontal sums).
inline float bf16_to_f32(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void gemv_bf16(const GemmArgs& a, int64_t b0, int64_t b1) {
  const int64_t kp = (a.K + 1) / 2;
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m = 0; m < a.M; ++m) {
      const uint16_t* x = a.x + m * a.ldx;
      for (int half = 0; half < 2; ++half) {
        const int64_t n = b * 16 + half * 8;
        const int nr = (int)min64(8, a.N - n);
        if (nr <= 0) break;
        __m256 acc0 = Vec::zero(), acc1 = Vec::zero();
        const uint16_t* p = w + b * kp * 32 + half * 16;
        for (int64_t i = 0; i < kp; ++i, p += 32) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)p);
          const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
          const float x1 = 2 * i + 1 < a.K ? bf16_to_f32(x[2 * i + 1]) : 0.0f;
          acc0 = Vec::fma(even, Vec::set1(bf16_to_f32(x[2 * i])), acc0);
          acc1 = Vec::fma(odd, Vec::set1(x1), acc1);
        }
        __m256 s = _mm256_add_ps(acc0, acc1);
        if (a.bias) s = _mm256_add_ps(s, Vec::load_f32(a.bias + n, nr));
        Vec::store_bf16(a.y + m * a.ldy + n, s, nr);
      }
    }
  }
}

// fp32 GEMV over the fp32 blocks (avx512.cpp): per block and row, two 8-channel halves of
// each 16-float line, x[k] broadcast.
void gemv_f32(const GemmArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* wb = static_cast<const float*>(a.w) + b * a.K * 16;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.xf + m * a.ldx;
      __m256 lo = Vec::zero(), hi = Vec::zero();
      for (int64_t k = 0; k < a.K; ++k) {
        const __m256 xv = Vec::set1(x[k]);
        lo = Vec::fma(_mm256_loadu_ps(wb + k * 16), xv, lo);
        hi = Vec::fma(_mm256_loadu_ps(wb + k * 16 + 8), xv, hi);
      }
      for (int half = 0; half < 2; ++half) {
        const int64_t n = b * 16 + half * 8;
        const int nr = (int)min64(8, a.N - n);
        if (nr <= 0) break;
        __m256 s = half ? hi : lo;
        if (a.bias) s = _mm256_add_ps(s, Vec::load_f32(a.bias + n, nr));
        Vec::store_f32(a.yf + m * a.ldy + n, s, nr);
      }
    }
  }
}

const tokenmill::KernelTable kTable = {
    "avx2", gemm_bf16, gemm_int8, gemm_int4, rms_norm_kernel, silu_mul_kernel, rope_kernel,
    attention_merge_kernel, nullptr, rope_kv_kernel, prefill_attention_kernel, gemv_bf16, gemv_f32,
};

}  // namespace

const tokenmill::KernelTable* tokenmill::avx2_kernels() { return &kTable; }
