// AVX-512 kernels (F/BW/VL/DQ + BF16 + VNNI): the bf16 GEMM on AVX512-BF16 dot products;
// int8 and int4 GEMMs on VNNI integer dot products over activations quantized per row
// (int4) or per row and group of 64 (int8) (W8A8 dynamic, as llama.cpp's Q8_0 dot products); common.h's kernels on 16 lanes. Only ever called on CPUs that
// report these features (ops.cpp checks); nothing here has external linkage but the table.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

// amx-tile and amx-bf16 only for prefill.h's AMX attention, run where PrefillArgs::amx says
// the tiles are granted (the compiler emits no AMX instruction unless asked).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c,amx-tile,amx-bf16")
#include "vec_avx512.h"
#include "common.h"
#include "rope_kv.h"
#define TOKENMILL_BF16_DOT 1
#define TOKENMILL_AMX_TILES 1
#include "prefill.h"
#include "gemm_common.h"

namespace {

using tokenmill::GemmArgs;

// Weight loaders: 32 consecutive weights of row n from column k, as bf16 pairs.
struct Bf16Weights {
  const uint16_t* w; int64_t ldw, K;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    const uint16_t* p = w + n * ldw + k;
    return (__m512bh)(K - k >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(Vec::mask32(K - k), p));
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

// int4 layout (see kernels/int4_layout.py): per row, per 64 columns, 32 bytes whose low
// nibbles are columns 0-31 and high nibbles columns 32-63; code q means q * scale + offset
// of its group, the offsets added through the activation sums. Rows are padded to whole
// 64-column chunks, so full loads never leave the row.
struct Int4Weights {
  const uint8_t* w; int64_t ldw; const float* scales; int64_t num_groups, group_size;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + n * ldw + (k >> 6) * 32)));
    __m512i q = (k & 32) ? _mm512_srli_epi16(b, 4) : _mm512_and_si512(b, _mm512_set1_epi16(15));
    return int16_to_bf16(q, _mm512_set1_ps(scales[n * num_groups + k / group_size]));
  }
};

struct PanelWeights {  // a 4-row panel already converted to bf16, rows from n0
  const uint16_t* panel; int64_t n0, kpad, K;
  inline __m512bh operator()(int64_t n, int64_t k) const {
    const uint16_t* p = panel + (n - n0) * kpad + k;
    return (__m512bh)(K - k >= 32 ? _mm512_load_si512(p) : _mm512_maskz_loadu_epi16(Vec::mask32(K - k), p));
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
    const __mmask32 km = Vec::mask32(a.K - k);
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
  with_tile_shape<4, 4>(mr, nr, [&](auto M, auto N) { tile<decltype(M)::value, decltype(N)::value>(a, m0, n0, wl, out); });
}

// The bf16 tiles (tile_any) over weights that WL gives as bf16 pairs.
template <Kind KIND, class WL>
void gemm_float_tiles(const GemmArgs& a, int64_t n0, int64_t n1, const WL& wl) {
  gemm_tiles<KIND, 4>(a, n0, n1, [&](int mr, int nr, int64_t m, int64_t n, float (&out)[4][4]) {
    tile_any(mr, nr, a, m, n, wl, out);
  });
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
        for (int r = 0; r < nr; ++r) store_out(a, m + i, n + r, finish<KIND>(a, m + i, n + r, out[i][r]));
    }
  }
  std::free(panel);
}

void gemm_bf16(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_float_tiles<kBf16>(a, n0, n1, Bf16Weights{static_cast<const uint16_t*>(a.w), a.ldw, a.K});
}

// ---- W8A8: activations quantized per row or group (gemm_common.h's quantize_rows), integer
// dot products (VPDPBUSD: u8 x s8) ----

// The exact signed dot products of 64 int8 weights w and 64 signed activations x, in 16
// lanes of 4: VPDPBUSD takes u8 x s8, so the weights go in + 128 (their sign bit flipped,
// flip = 0x80 bytes) and the accumulator starts at x_start(x), -128 x the lanes' sums of x
// (x alone: computed once per activation group for every weight row).
inline __m512i x_start(__m512i x, __m512i flip) {
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, x));
}

inline __m512i dot_s8(__m512i start, __m512i w, __m512i x, __m512i flip) {
  return _mm512_dpbusd_epi32(start, _mm512_xor_si512(w, flip), x);
}

// int8 weights [N, K] against x quantized per row and group of 64 (a.x_group_scale): each
// group's exact integer lanes converted and scaled into fp32 lanes, in group order, the
// channel scale applied after the horizontal sum (gemv_int8_seq takes the same steps).
template <int MR, int NR>
inline void tile_int8(const GemmArgs& a, int64_t m0, int64_t n0, float out[4][4]) {
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const int64_t G = a.ldq / 64;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 64) {
    const __mmask64 km = a.K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (a.K - k)) - 1);
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_epi8(km, w + (n0 + r) * a.ldw + k);
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(a.xq + (m0 + m) * a.ldq + k), start = x_start(xv, flip);
      const __m512 xs = _mm512_set1_ps(a.x_group_scale[(m0 + m) * G + k / 64]);
      for (int r = 0; r < NR; ++r)
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_s8(start, wv[r], xv, flip)), xs, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]) * a.scales[n0 + r];
}

// int4 codes (u8 0..15) against signed x: per group, the integer dot times the group's scale,
// accumulated in fp32; the offsets join in finish() through the activation sums.
template <int MR, int NR>
inline void tile_int4(const GemmArgs& a, int64_t m0, int64_t n0, float out[4][4]) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  __m512 facc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) facc[m][r] = _mm512_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15);
  const int64_t chunks_per_group = a.group_size / 64;
  for (int64_t g = 0; g * a.group_size < a.K; ++g) {
    __m512i acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks_per_group; ++c) {
      const int64_t k = (g * chunks_per_group + c) * 64;
      if (k >= a.K) break;
      __m512i wv[NR];
      for (int r = 0; r < NR; ++r) {
        __m256i b = _mm256_loadu_si256((const __m256i*)(w + (n0 + r) * a.ldw + k / 2));
        __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        wv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      for (int m = 0; m < MR; ++m) {
        __m512i xv = _mm512_loadu_si512(a.xq + (m0 + m) * a.ldq + k);
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv[r], xv);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(a.scales[(n0 + r) * a.num_groups + g]);
      for (int m = 0; m < MR; ++m) facc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), s, facc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(facc[m][r]) * a.x_scale[m0 + m];
}

// int4 with groups of 128+ codes, the GEMV shape (llama.cpp's Q4_0 trade): one 64-byte load
// per weight row holds two 64-code chunks, so its low nibbles are columns [0, 32) and
// [64, 96) of a 128-column block and its high nibbles [32, 64) and [96, 128). The
// activations are put in that order once per block (two lane shuffles shared by every
// weight row) instead of each row's nibbles being reassembled: per 128 codes and row, one
// load, two ANDs, a shift and two dot products. Four weight rows at a time keep eight
// independent accumulators in flight; MR <= 2 keeps all of them in registers.
template <int MR, int NR>
inline void tile_int4_wide(const GemmArgs& a, int64_t m0, int64_t n0, float out[4][4]) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  __m512 facc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) facc[m][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  const int64_t blocks = a.group_size / 128;
  const uint8_t* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + (n0 + r) * a.ldw;
  for (int64_t g = 0; g * a.group_size < a.K; ++g) {
    __m512i acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k = (g * blocks + b) * 128;
      __m512i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) {
        const __m512i v = _mm512_loadu_si512(wr[r] + k / 2);
        lo[r] = _mm512_and_si512(v, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int m = 0; m < MR; ++m) {
        const uint8_t* xr = a.xq + (m0 + m) * a.ldq + k;
        const __m512i x0 = _mm512_loadu_si512(xr), x1 = _mm512_loadu_si512(xr + 64);
        const __m512i xa = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));  // [0,32) [64,96)
        const __m512i xb = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));  // [32,64) [96,128)
        for (int r = 0; r < NR; ++r) {
          acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], lo[r], xa);
          acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], hi[r], xb);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(a.scales[(n0 + r) * a.num_groups + g]);
      for (int m = 0; m < MR; ++m) facc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), s, facc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(facc[m][r]) * a.x_scale[m0 + m];
}

// The int4 epilogue: offsets x activation sums (the scales are already in), bias, bf16.
inline void store_int4(const GemmArgs& a, int64_t m, int64_t n, int mr, int nr, const float out[4][4]) {
  for (int i = 0; i < mr; ++i)
    for (int r = 0; r < nr; ++r) store_out(a, m + i, n + r, finish<kInt4>(a, m + i, n + r, out[i][r]));
}

// Needs a.xq zero-padded to whole 128-column blocks (ops_linear.cpp passes the weight's K_pad).
void gemm_int4_wide(const GemmArgs& a, int64_t n0, int64_t n1) {
  float out[4][4];
  for (int64_t n = n0; n < n1; n += 4) {
    const int nr = (int)min64(4, n1 - n);
    for (int64_t m = 0; m < a.M; m += 2) {
      const int mr = (int)min64(2, a.M - m);
      with_tile_shape<2, 4>(mr, nr, [&](auto M, auto N) {
        tile_int4_wide<decltype(M)::value, decltype(N)::value>(a, m, n, out);
      });
      store_int4(a, m, n, mr, nr, out);
    }
  }
}

template <bool INT4>
void gemm_w8a8(const GemmArgs& a, int64_t n0, int64_t n1) {
  constexpr int NB = INT4 ? 2 : 4;  // int4 keeps a second set of accumulators per group
  // int4: the offsets x activation sums in finish (the scales are already in)
  gemm_tiles<INT4 ? kInt4 : kBf16, NB>(a, n0, n1, [&](int mr, int nr, int64_t m, int64_t n, float (&out)[4][4]) {
    with_tile_shape<4, NB>(mr, nr, [&](auto M, auto N) {
      constexpr int MR = decltype(M)::value, NR = decltype(N)::value;
      if constexpr (INT4) tile_int4<MR, NR>(a, m, n, out); else tile_int8<MR, NR>(a, m, n, out);
    });
  });
}

// One activation row (the one-stream decode): each weight row is read whole before the
// next, so a thread's range of rows is one sequential stream (rows [N, K] lie one after
// another). The tiles above read 2-4 rows side by side, several short streams that the
// hardware prefetcher follows badly (the same loss as row-major bf16, see gemv_bf16);
// rows are independent, so out-of-order execution still overlaps their dot products.
// Weight rows [n, n + R) against the one activation row, R accumulators side by side (one
// dependency chain each; the activation group, its start lanes and scale loaded once for
// all R), each row's sum then exactly as tile_int8's.
template <int R>
inline void gemv_int8_rows(const GemmArgs& a, int64_t n, const int32_t* starts, __m512i flip) {
  const int8_t* w = static_cast<const int8_t*>(a.w) + n * a.ldw;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 64) {
    const __mmask64 km = a.K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (a.K - k)) - 1);
    const __m512i xv = _mm512_loadu_si512(a.xq + k), start = _mm512_loadu_si512(starts + k / 4);
    const __m512 xs = _mm512_set1_ps(a.x_group_scale[k / 64]);
    for (int r = 0; r < R; ++r) {
      const __m512i d = dot_s8(start, _mm512_maskz_loadu_epi8(km, w + r * a.ldw + k), xv, flip);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store_out(a, 0, n + r, finish<kBf16>(a, 0, n + r, _mm512_reduce_add_ps(acc[r]) * a.scales[n + r]));
}

void gemv_int8_seq(const GemmArgs& a, int64_t n0, int64_t n1) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  // x_start per group, once for every weight row
  static thread_local std::vector<int32_t> starts;
  const int64_t G = (a.K + 63) / 64;
  starts.resize((size_t)G * 16);
  for (int64_t g = 0; g < G; ++g) _mm512_storeu_si512(starts.data() + g * 16, x_start(_mm512_loadu_si512(a.xq + g * 64), flip));
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) gemv_int8_rows<4>(a, n, starts.data(), flip);
  for (; n < n1; ++n) gemv_int8_rows<1>(a, n, starts.data(), flip);
}

void gemm_int8(const GemmArgs& a, int64_t n0, int64_t n1) {
  if (a.M == 1) gemv_int8_seq(a, n0, n1);
  else gemm_w8a8<false>(a, n0, n1);
}

// int4, one row, groups of 128+ (see gemv_int8_seq and tile_int4_wide): x is put in the
// nibbles' order once per call, then every weight row is read whole, in order.
void gemv_int4_seq(const GemmArgs& a, int64_t n0, int64_t n1) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  uint8_t* xp = static_cast<uint8_t*>(std::aligned_alloc(64, a.ldq));
  for (int64_t k = 0; k < a.ldq; k += 128) {
    const __m512i x0 = _mm512_loadu_si512(a.xq + k), x1 = _mm512_loadu_si512(a.xq + k + 64);
    _mm512_store_si512(xp + k, _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_store_si512(xp + k + 64, _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512i low4 = _mm512_set1_epi8(15);
  const int64_t blocks = a.group_size / 128;
  float out[4][4];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * a.ldw;
    const float* sc = a.scales + n * a.num_groups;
    __m512 f = _mm512_setzero_ps();
    for (int64_t g = 0; g * a.group_size < a.K; ++g) {
      __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k = (g * blocks + b) * 128;
        const __m512i v = _mm512_loadu_si512(wr + k / 2);
        acc0 = _mm512_dpbusd_epi32(acc0, _mm512_and_si512(v, low4), _mm512_load_si512(xp + k));
        acc1 = _mm512_dpbusd_epi32(acc1, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_load_si512(xp + k + 64));
      }
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)), _mm512_set1_ps(sc[g]), f);
    }
    out[0][0] = _mm512_reduce_add_ps(f) * a.x_scale[0];
    store_int4(a, 0, n, 1, 1, out);
  }
  std::free(xp);
}

void gemm_int4(const GemmArgs& a, int64_t n0, int64_t n1) {
  // Groups of 128+: one row streams; up to 4 rows the two-chunk tiles (measured 5-20% faster
  // than gemm_w8a8 at 4 rows, 20-40% slower at 16, where gemm_w8a8's 4-row tiles win).
  if (a.group_size % 128 == 0 && a.ldq % 128 == 0 && a.M <= 4) {
    if (a.M == 1) gemv_int4_seq(a, n0, n1);
    else gemm_int4_wide(a, n0, n1);
    return;
  }
  if (a.group_size % 64 == 0) { gemm_w8a8<true>(a, n0, n1); return; }
  // 32-channel groups split a 64-code chunk: weights converted to bf16 in registers instead.
  Int4Weights wl{static_cast<const uint8_t*>(a.w), a.ldw, a.scales, a.num_groups, a.group_size};
  if (a.M <= 4) gemm_float_tiles<kInt4>(a, n0, n1, wl); else gemm_panels<kInt4>(a, n0, n1, wl);
}

// bf16 GEMV/GEMM over weights packed for it (kernels/gemv_layout.py): a 16-channel block is
// ceil(K/2) lines of 64 bytes, line p holding the 16 channels' weights k = 2p and 2p + 1 (the
// pairs one AVX512-BF16 dot product takes). A block is one contiguous stream, so a thread
// reads its range of blocks sequentially at every batch size: row-major weights are read
// several short rows side by side, a stream pattern the hardware prefetcher follows badly,
// which left one-row products at a fraction of a plain sequential read's bandwidth. Each
// row's x pair is broadcast against a whole line (16 outputs per dot product, no horizontal
// sums): a register-tiled GEMM of MR rows x NR blocks of accumulators.

inline __m512bh x_pair(const uint16_t* x, int64_t p, int64_t K) {
  int32_t v;
  if (2 * p + 1 < K) std::memcpy(&v, x + 2 * p, 4);
  else v = x[2 * p];  // odd K: the last pair's second weight is zero padding
  return (__m512bh)_mm512_set1_epi32(v);
}

// The C chains of accumulators of output (m, n) summed, with the bias of channels [ch, ch + nr).
template <int MR, int NR, int C>
inline __m512 block_sum(const GemmArgs& a, __m512 (&acc)[C][MR][NR], int m, int n, int64_t ch, int nr) {
  __m512 s = acc[0][m][n];
  for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, acc[c][m][n]);
  if (a.bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(Vec::mask(nr), a.bias + ch));
  return s;
}

// Rows [m0, m0 + MR) x blocks [b, b + NR) over all of K.
struct Bf16Tile {
  template <int MR, int NR, int C>
  static void run(const GemmArgs& a, int64_t m0, int64_t b) {
    const int64_t kp = (a.K + 1) / 2;
    __m512 acc[C][MR][NR];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[c][m][n] = _mm512_setzero_ps();
    const uint16_t* wb = static_cast<const uint16_t*>(a.w) + b * kp * 32;
    const uint16_t* x = a.x + m0 * a.ldx;
    const int64_t full = a.K / 2;  // pairs with both weights real
    int64_t p = 0;
    for (; p + C <= full; p += C)
      for (int c = 0; c < C; ++c) {
        __m512bh wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(wb + n * kp * 32 + (p + c) * 32);
        for (int m = 0; m < MR; ++m) {
          int32_t v;
          std::memcpy(&v, x + m * a.ldx + 2 * (p + c), 4);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(v);
          for (int n = 0; n < NR; ++n) acc[c][m][n] = _mm512_dpbf16_ps(acc[c][m][n], xv, wv[n]);
        }
      }
    for (; p < kp; ++p) {
      for (int n = 0; n < NR; ++n) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + n * kp * 32 + p * 32);
        for (int m = 0; m < MR; ++m) acc[0][m][n] = _mm512_dpbf16_ps(acc[0][m][n], x_pair(x + m * a.ldx, p, a.K), wv);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) {
        const int64_t ch = (b + n) * 16;
        const int nr = (int)min64(16, a.N - ch);
        const __m512 sum = block_sum<MR, NR, C>(a, acc, m, n, ch, nr);
        if (a.yf)  // fp32 out (logits): no rounding to bf16
          _mm512_mask_storeu_ps(a.yf + (m0 + m) * a.ldy + ch, Vec::mask(nr), sum);
        else
          _mm256_mask_storeu_epi16(a.y + (m0 + m) * a.ldy + ch, Vec::mask(nr), (__m256i)_mm512_cvtneps_pbh(sum));
      }
  }
};

// fp32 weights as 16-channel blocks of K lines (one input each, 64 bytes): each row's x[k]
// broadcast against line k, one FMA per 16 outputs, so a block is again one sequential stream.
struct F32Tile {
  template <int MR, int NR, int C>
  static void run(const GemmArgs& a, int64_t m0, int64_t b) {
    __m512 acc[C][MR][NR];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[c][m][n] = _mm512_setzero_ps();
    const float* wb = static_cast<const float*>(a.w) + b * a.K * 16;
    const float* x = a.xf + m0 * a.ldx;
    int64_t k = 0;
    for (; k + C <= a.K; k += C)
      for (int c = 0; c < C; ++c) {
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_ps(wb + n * a.K * 16 + (k + c) * 16);
        for (int m = 0; m < MR; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * a.ldx + k + c]);
          for (int n = 0; n < NR; ++n) acc[c][m][n] = _mm512_fmadd_ps(xv, wv[n], acc[c][m][n]);
        }
      }
    for (; k < a.K; ++k)
      for (int n = 0; n < NR; ++n) {
        const __m512 wv = _mm512_loadu_ps(wb + n * a.K * 16 + k * 16);
        for (int m = 0; m < MR; ++m)
          acc[0][m][n] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * a.ldx + k]), wv, acc[0][m][n]);
      }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) {
        const int64_t ch = (b + n) * 16;
        const int nr = (int)min64(16, a.N - ch);
        _mm512_mask_storeu_ps(a.yf + (m0 + m) * a.ldy + ch, Vec::mask(nr), block_sum<MR, NR, C>(a, acc, m, n, ch, nr));
      }
  }
};

// Tiles of up to 8 rows x 3 blocks (24 accumulators; fewer rows chain over alternating lines
// so the dot product's latency is covered); a thread's blocks are taken three at a time, three
// sequential streams, in 64-row chunks so x stays in L2 while the blocks pass. Measured (bf16)
// against prepacked oneDNN at one thread (the 250M model's MLP shapes, interleaved, minimum
// of 31 rounds on a loaded machine): 1.3-1.8x faster at 1-8 rows, 1.1-1.3x at 12-64 and
// 0.9-1.05x at 256. One tile of all rows against one block (every line read from memory
// once) was slower from 4 rows on: 0.64-0.83x at 16, with 16 broadcasts per line.
template <class Tile, int NR>
void gemv_rows(const GemmArgs& a, int64_t m0, int mr, int64_t b) {
  switch (mr) {
    case 1: Tile::template run<1, NR, (NR == 1 ? 8 : 2)>(a, m0, b); break;
    case 2: Tile::template run<2, NR, (NR == 1 ? 4 : 1)>(a, m0, b); break;
    case 3: Tile::template run<3, NR, (NR == 1 ? 3 : 1)>(a, m0, b); break;
    case 4: Tile::template run<4, NR, (NR == 1 ? 2 : 1)>(a, m0, b); break;
    case 5: Tile::template run<5, NR, (NR == 1 ? 2 : 1)>(a, m0, b); break;
    case 6: Tile::template run<6, NR, (NR == 1 ? 2 : 1)>(a, m0, b); break;
    case 7: Tile::template run<7, NR, 1>(a, m0, b); break;
    default: Tile::template run<8, NR, 1>(a, m0, b); break;
  }
}

template <class Tile>
void gemv_blocks(const GemmArgs& a, int64_t b0, int64_t b1) {
  constexpr int64_t kChunk = 64;
  for (int64_t c0 = 0; c0 < a.M; c0 += kChunk) {
    const int64_t c1 = min64(a.M, c0 + kChunk);
    int64_t b = b0;
    for (; b + 3 <= b1; b += 3)
      for (int64_t m0 = c0; m0 < c1; m0 += 8) gemv_rows<Tile, 3>(a, m0, (int)min64(8, c1 - m0), b);
    for (; b < b1; ++b)
      for (int64_t m0 = c0; m0 < c1; m0 += 8) gemv_rows<Tile, 1>(a, m0, (int)min64(8, c1 - m0), b);
  }
}

void gemv_bf16(const GemmArgs& a, int64_t b0, int64_t b1) { gemv_blocks<Bf16Tile>(a, b0, b1); }
void gemv_f32(const GemmArgs& a, int64_t b0, int64_t b1) { gemv_blocks<F32Tile>(a, b0, b1); }

// ---- int4 groups of 32 in 8 interleaved channels (avx2.cpp's gemm_int4_x8, its layout and
// its x quantization) two blocks at a time: block b's word t in the low half of a zmm and
// block b + 1's in the high half, so one broadcast of 4 activation bytes feeds 16 channels,
// and VPDPBUSD sums nibble x byte products straight into int32 (AVX2 needs vpmaddubsw,
// an int16 add and vpmaddwd per word). Each group's integer sum is exact either way, and the
// float work after it is the AVX2 kernel's, operation for operation: the outputs are its bits.

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 16 fp16 values: block b's 8 then block b + 1's 8 (hi; lo again for a lone last block).
inline __m512 halves_f16(const uint16_t* lo, const uint16_t* hi) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)lo)),
                                            _mm_loadu_si128((const __m128i*)hi), 1);
  return _mm512_cvtph_ps(h);
}

// fp32 -> bf16 bits, round to nearest even by integer arithmetic (as the AVX2 table's store,
// so the two tables agree on every value, subnormals included).
inline __m256i bf16_rne(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16));
}

// Rows a tile: each group's 16 channels' nibbles are split once for all of them (24 of the
// 32 zmm registers hold the rows' sums at 8).
constexpr int kX8Rows = 8;

template <int MR>
void tile_w4x16(const tokenmill::GemmArgs& a, int64_t m0, int64_t b, bool pair, __m512 out[MR]) {
  constexpr int64_t kAhead = 2048;
  const int64_t G = a.num_groups, chunks = a.ldq / 64;
  const uint8_t* w0 = static_cast<const uint8_t*>(a.w) + b * G * 128;
  const uint8_t* w1 = pair ? w0 + G * 128 : w0;
  const uint16_t* s0 = a.scales_f16 + b * G * 8;
  const uint16_t* s1 = pair ? s0 + G * 8 : s0;
  const uint16_t* z0 = a.offsets_f16 + b * G * 8;
  const uint16_t* z1 = pair ? z0 + G * 8 : z0;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[MR], off[MR];
  for (int m = 0; m < MR; ++m) acc[m] = off[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    _mm_prefetch((const char*)(w0 + g * 128 + kAhead), _MM_HINT_T0);
    _mm_prefetch((const char*)(w0 + g * 128 + kAhead + 64), _MM_HINT_T0);
    if (pair) {
      _mm_prefetch((const char*)(w1 + g * 128 + kAhead), _MM_HINT_T0);
      _mm_prefetch((const char*)(w1 + g * 128 + kAhead + 64), _MM_HINT_T0);
    }
    __m512i sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + g * 128 + 32 * t))),
                                           _mm256_loadu_si256((const __m256i*)(w1 + g * 128 + 32 * t)), 1);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const int64_t xo = tokenmill::x8_offset(g, t);
      for (int m = 0; m < MR; ++m) {
        const uint8_t* xr = a.xq + (m0 + m) * a.ldq + xo;
        sum[m] = _mm512_dpbusd_epi32(sum[m], lo, _mm512_set1_epi32(load4(xr)));
        sum[m] = _mm512_dpbusd_epi32(sum[m], hi, _mm512_set1_epi32(load4(xr + 4)));
      }
    }
    const __m512 ws = halves_f16(s0 + g * 8, s1 + g * 8), z = halves_f16(z0 + g * 8, z1 + g * 8);
    for (int m = 0; m < MR; ++m) {
      const float sx = a.x_group_scale[tokenmill::x8_scale_index(m0 + m, chunks, g)];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_mul_ps(ws, _mm512_set1_ps(sx)), acc[m]);
      off[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(a.xsum[(m0 + m) * G + g]), off[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = _mm512_add_ps(acc[m], off[m]);
}

// One group's word t (8 inputs) of 16 channels (blocks b and b + 1) widened to fp32, w = q *
// scale + offset (a multiply, then an add, as avx2.cpp's dequantize_int4_x8), bf16 rounded,
// and stored as 4 lines of kernels/gemv_layout.py's blocks: line q holds the 16 channels'
// inputs (2q, 2q + 1) as pairs. sc / of: per pair of channels c, c + 1 (c even) the vector
// [scale c x 8, scale c + 1 x 8], in the order the nibble split leaves them (see below).
inline void dequantize_word_w4x16(__m512i v, const __m512 sc[8], const __m512 of[8], uint32_t* line) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  // Per 128-bit lane, the AVX2 split's order: a = channels (0, 1), (4, 5) of block b, then of
  // block b + 1; bb = (2, 3), (6, 7). Each lane: 8 inputs of one channel, 8 of the next.
  const __m512i a = _mm512_unpacklo_epi32(lo, hi), bb = _mm512_unpackhi_epi32(lo, hi);
  __m256i r[8];  // bf16: lanes a0 a1 a2 a3 then bb0 .. bb3
  for (int l = 0; l < 8; ++l) {
    const __m512i src = l < 4 ? a : bb;
    const __m128i lane = l % 4 == 0   ? _mm512_extracti32x4_epi32(src, 0)
                         : l % 4 == 1 ? _mm512_extracti32x4_epi32(src, 1)
                         : l % 4 == 2 ? _mm512_extracti32x4_epi32(src, 2)
                                      : _mm512_extracti32x4_epi32(src, 3);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane));
    r[l] = bf16_rne(_mm512_add_ps(_mm512_mul_ps(q, sc[l]), of[l]));
  }
  // Four channels a register, 8 bf16 (4 pairs) each: channels 0-3, 4-7, 8-11, 12-15.
  const __m512i z[4] = {
      _mm512_inserti64x4(_mm512_castsi256_si512(r[0]), r[4], 1),  // (0, 1), (2, 3)
      _mm512_inserti64x4(_mm512_castsi256_si512(r[1]), r[5], 1),  // (4, 5), (6, 7)
      _mm512_inserti64x4(_mm512_castsi256_si512(r[2]), r[6], 1),  // (8, 9), (10, 11)
      _mm512_inserti64x4(_mm512_castsi256_si512(r[3]), r[7], 1),  // (12, 13), (14, 15)
  };
  // Channel-major [4 channels][4 pairs] dwords to pair-major [4 pairs][4 channels]: 128-bit
  // lane q then holds pair q of the register's 4 channels.
  const __m512i by_pair = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i t[4];
  for (int k = 0; k < 4; ++k) t[k] = _mm512_permutexvar_epi32(by_pair, z[k]);
  // Line q: lane q of t[0], t[1], t[2], t[3] (a 4 x 4 transpose of 128-bit lanes).
  const __m512i u0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_i32x4(t[0], t[1], 0xee);
  const __m512i u2 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), u3 = _mm512_shuffle_i32x4(t[2], t[3], 0xee);
  _mm512_storeu_si512(line, _mm512_shuffle_i32x4(u0, u2, 0x88));
  _mm512_storeu_si512(line + 16, _mm512_shuffle_i32x4(u0, u2, 0xdd));
  _mm512_storeu_si512(line + 32, _mm512_shuffle_i32x4(u1, u3, 0x88));
  _mm512_storeu_si512(line + 48, _mm512_shuffle_i32x4(u1, u3, 0xdd));
}

}  // namespace

// avx2_dequantize_int4_x8's blocks (bf16, kernels/gemv_layout.py) for pairs [p0, p1) of
// 8-channel blocks, a whole 16-channel line per store: the AVX2 code widens and stores one
// channel's 8 inputs at a time and gathers each line from 8 scalars, which ran a prompt
// step's dequantization at ~4 GB/s (a quarter of SmolLM2's int4 prompt step on AMX). The
// same bits. A lone last block (odd count) leaves the upper half of its line as it is.
void tokenmill::avx512_dequantize_int4_x8_blocks(const GemmArgs& a, int64_t p0, int64_t p1, uint16_t* yb) {
  const int64_t G = a.num_groups, kp = a.K / 2, blocks = (a.N + 7) / 8;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = 2 * p;
    const bool pair = b + 1 < blocks;
    const uint8_t* w0 = static_cast<const uint8_t*>(a.w) + b * G * 128;
    const uint8_t* w1 = pair ? w0 + G * 128 : w0;
    // Channels past N: zero lines (the scales' pad channels are 0, their codes too, but
    // say so rather than rely on it).
    const int nc = (int)min64(pair ? 16 : 8, a.N - b * 8);
    // r[l]'s channels (see dequantize_word_w4x16): a0 = 0, 1; a1 = 4, 5; a2 = 8, 9; a3 = 12, 13;
    // bb0 = 2, 3; bb1 = 6, 7; bb2 = 10, 11; bb3 = 14, 15: the lanes of the group's 16 scales
    // (and offsets) each takes, the channels past N zero.
    __m512i idx[8];
    __mmask16 keep[8];
    for (int l = 0; l < 8; ++l) {
      const int c = l < 4 ? 4 * l : 4 * (l - 4) + 2;
      idx[l] = _mm512_inserti64x4(_mm512_set1_epi32(c), _mm256_set1_epi32(c + 1), 1);
      keep[l] = (__mmask16)((c < nc ? 0x00FFu : 0u) | (c + 1 < nc ? 0xFF00u : 0u));
    }
    const int64_t b1 = pair ? b + 1 : b;
    for (int64_t g = 0; g * 32 < a.K; ++g) {
      const __m512 ws = halves_f16(a.scales_f16 + (b * G + g) * 8, a.scales_f16 + (b1 * G + g) * 8);
      const __m512 wz = halves_f16(a.offsets_f16 + (b * G + g) * 8, a.offsets_f16 + (b1 * G + g) * 8);
      __m512 sc[8], of[8];
      for (int l = 0; l < 8; ++l) {
        sc[l] = _mm512_maskz_permutexvar_ps(keep[l], idx[l], ws);
        of[l] = _mm512_maskz_permutexvar_ps(keep[l], idx[l], wz);
      }
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + g * 128 + 32 * t))),
                                             _mm256_loadu_si256((const __m256i*)(w1 + g * 128 + 32 * t)), 1);
        uint32_t* line = reinterpret_cast<uint32_t*>(yb) + (p * kp + g * 16 + 4 * t) * 16;
        if (pair) {
          dequantize_word_w4x16(v, sc, of, line);
        } else {
          alignas(64) uint32_t full[64];
          dequantize_word_w4x16(v, sc, of, full);
          for (int q = 0; q < 4; ++q) _mm256_storeu_si256((__m256i*)(line + 16 * q), _mm256_load_si256((const __m256i*)(full + 16 * q)));
        }
      }
    }
  }
}

// Pairs [p0, p1) of 8-channel blocks (blocks 2p, 2p + 1; the last alone where their count is
// odd), every row, in tiles of up to kX8Rows rows.
void tokenmill::avx512_gemm_int4_x8(const GemmArgs& a, int64_t p0, int64_t p1) {
  const int64_t blocks = (a.N + 7) / 8;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = 2 * p, n0 = b * 8;
    const bool pair = b + 1 < blocks;
    const int nc = (int)min64(pair ? 16 : 8, a.N - n0);
    const __mmask16 mask = (__mmask16)((1u << nc) - 1);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int64_t m = 0; m < a.M; m += kX8Rows) {
      const int mr = (int)min64(kX8Rows, a.M - m);
      __m512 out[kX8Rows];
      switch (mr) {
        case 1: tile_w4x16<1>(a, m, b, pair, out); break;
        case 2: tile_w4x16<2>(a, m, b, pair, out); break;
        case 3: tile_w4x16<3>(a, m, b, pair, out); break;
        case 4: tile_w4x16<4>(a, m, b, pair, out); break;
        case 5: tile_w4x16<5>(a, m, b, pair, out); break;
        case 6: tile_w4x16<6>(a, m, b, pair, out); break;
        case 7: tile_w4x16<7>(a, m, b, pair, out); break;
        default: tile_w4x16<kX8Rows>(a, m, b, pair, out); break;
      }
      for (int r = 0; r < mr; ++r)
        _mm256_mask_storeu_epi16(a.y + (m + r) * a.ldy + n0, mask, bf16_rne(_mm512_add_ps(out[r], bias)));
    }
  }
}

namespace {

const tokenmill::KernelTable kTable = {
    "avx512_bf16", gemm_bf16, gemm_int8, gemm_int4, rms_norm_kernel, silu_mul_kernel, gelu_tanh_mul_kernel,
    rope_kernel, attention_merge_kernel, quantize_rows, rope_kv_kernel, prefill_attention_kernel, gemv_bf16,
    gemv_f32,
    /*quantize_rows_g32=*/nullptr, /*int8_x_group=*/64, row_max_kernel,
};

}  // namespace

const tokenmill::KernelTable* tokenmill::avx512_kernels() { return &kTable; }
