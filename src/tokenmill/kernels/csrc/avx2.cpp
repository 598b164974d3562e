// AVX2 + FMA kernels: the same ops as avx512.cpp on 8-lane vectors, for CPUs without
// AVX-512 BF16 (or when TOKENMILL_CPU_ISA=avx2 forces this path). bf16 weights are
// converted to fp32 in registers and multiplied with FMA, so products match the AVX-512
// path's bf16 dot products up to summation order; int8 and int4 (groups of 32+) take
// activations quantized to int8 (W8A8), with vpmaddubsw for VNNI: int8 per group of 64
// inputs (AVX-512: per row), int4 per row, or per group of 32 for groups of 32.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"
#include "common.h"
#include "rope_kv.h"
#include "prefill.h"
#include "gemm_common.h"

namespace {

using tokenmill::GemmArgs;

struct Bf16Weights {
  const uint16_t* w; int64_t ldw, K;
  inline __m256 operator()(int64_t n, int64_t k) const { return Vec::load_bf16(w + n * ldw + k, (int)min64(8, K - k)); }
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
inline void tile(const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][4]) {
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
inline void tile_any(int mr, int nr, const GemmArgs& a, int64_t m0, int64_t n0, const WL& wl, float out[4][4]) {
  with_tile_shape<4, 2>(mr, nr, [&](auto M, auto N) { tile<decltype(M)::value, decltype(N)::value>(a, m0, n0, wl, out); });
}

inline float* row_buffer(int64_t floats) {  // per thread, grown on demand, never freed
  static thread_local float* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (floats > cap) {
    std::free(buf);
    buf = static_cast<float*>(std::malloc((size_t)floats * sizeof(float)));
    cap = floats;
  }
  return buf;
}

// ---- W8A8 without VNNI: activations quantized per row to int8 (quantize_rows, as on
// AVX-512), products by vpmaddubsw (u8 x s8 into saturating s16 pairs) and vpmaddwd
// (pairs into s32). For int8 weights the u8 side is |w| and the s8 side x with w's sign
// (|pair| <= 2 * 127 * 127, no saturation), as llama.cpp's AVX2 Q8_0 dot product does;
// int4 codes are u8 already (<= 15) against signed x. (quantize_rows: gemm_common.h.)

inline int32_t reduce_add_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// 32 weights of row wr from k (the last, shorter piece of a row through a zeroed buffer:
// the activations past K are zero, and a row may end the tensor).
inline __m256i load_w8(const int8_t* wr, int64_t k, int64_t K) {
  if (k + 32 <= K) return _mm256_loadu_si256((const __m256i*)(wr + k));
  alignas(32) int8_t buf[32] = {0};
  std::memcpy(buf, wr + k, (size_t)(K - k));
  return _mm256_load_si256((const __m256i*)buf);
}

// 32 activations, quantized as signed int8.
inline __m256i load_x_s8(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

// acc + the products of 32 int8 weights w (aw = |w|) and activations x, summed in pairs of
// pairs into 8 int32 lanes.
inline __m256i dot_s8(__m256i acc, __m256i aw, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The products of one group of 64: weights w0 | w1 against activations x0 | x1, exact in
// 8 int32 lanes (tile_w8a8_g64, gemv_w8a8_int8_g64).
inline __m256i dot_s8_64(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
  return dot_s8(dot_s8(_mm256_setzero_si256(), _mm256_abs_epi8(w0), w0, x0), _mm256_abs_epi8(w1), w1, x1);
}

// int8 weights [N, K] against int8 x: rows [m0, m0 + MR) x
// channels [n0, n0 + NR), x_scale and the channel scales applied.
template <int MR, int NR>
inline void tile_w8a8(const GemmArgs& a, int64_t m0, int64_t n0, float out[4][4]) {
  const int8_t* w = static_cast<const int8_t*>(a.w);
  __m256i acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < a.K; k += 32) {
    __m256i wv[NR], aw[NR];
    for (int r = 0; r < NR; ++r) {
      wv[r] = load_w8(w + (n0 + r) * a.ldw, k, a.K);
      aw[r] = _mm256_abs_epi8(wv[r]);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i xv = load_x_s8(a.xq + (m0 + m) * a.ldq + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = dot_s8(acc[m][r], aw[r], wv[r], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = (float)reduce_add_i32(acc[m][r]) * a.x_scale[m0 + m] * a.scales[n0 + r];
}

// tile_w8a8 over activations quantized per group of 64 (a.x_group): each group's int32 sums
// (two 32-byte steps) converted and multiplied by its activation scale into fp32
// accumulators, the channel scales applied at the end. Each output sums its groups in order
// in one accumulator, as gemv_w8a8_int8_g64 does, so a row's outputs are the same alone and
// in a batch. Groups of 64 rather than 32: the conversion and FMA a group cost a third more
// than the products they scale at 32 (1.6-1.9x the per-row kernel's time, SmolLM2's and
// Gemma 3's shapes, 2 threads), for KL 0.006 against 0.008 at 64 (0.035 per row).
template <int MR, int NR>
inline void tile_w8a8_g64(const GemmArgs& a, int64_t m0, int64_t n0, float out[4][4]) {
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const int64_t G = a.ldq / 64;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = Vec::zero();
  for (int64_t k = 0; k < a.K; k += 64) {
    __m256i wv[NR][2];
    for (int r = 0; r < NR; ++r) {
      wv[r][0] = load_w8(w + (n0 + r) * a.ldw, k, a.K);
      wv[r][1] = k + 32 < a.K ? load_w8(w + (n0 + r) * a.ldw, k + 32, a.K) : _mm256_setzero_si256();
    }
    for (int m = 0; m < MR; ++m) {
      const uint8_t* xr = a.xq + (m0 + m) * a.ldq + k;
      const __m256i x0 = load_x_s8(xr), x1 = load_x_s8(xr + 32);
      const __m256 xs = Vec::set1(a.x_group_scale[(m0 + m) * G + k / 64]);
      for (int r = 0; r < NR; ++r) {
        const __m256i d = dot_s8_64(wv[r][0], wv[r][1], x0, x1);
        acc[m][r] = Vec::fma(_mm256_cvtepi32_ps(d), xs, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = Vec::reduce_add(acc[m][r]) * a.scales[n0 + r];
}

// The horizontal sums of four accumulators at once, lane i for f_i (hadd pairs, then the
// two halves): each lane's order is the same whichever the other three are, so one row
// sums alike alone (gemv_w4a8_rows) and in a 4-row tile.
inline __m128 hsum4(__m256 f0, __m256 f1, __m256 f2, __m256 f3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(f0, f1), _mm256_hadd_ps(f2, f3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// int4's epilogue for ROWS (1 or 4) rows in lanes: sums * x scale + bias, then each group's
// offset times the rows' x sums over it (xs[g * ld], lanes the rows), in that order.
template <int ROWS>
inline __m128 int4_epilogue(__m128 sums, __m128 xscale, float bias, const float* z, const float* xs, int64_t G,
                            int64_t ld) {
  // Four partial sums over g mod 4, so the FMAs do not wait on each other: one chain of G
  // dependent FMAs cost ~4 cycles a group, more than the product itself at one row (groups
  // of 32 over 1536 inputs: 48 groups). Each lane's order is the same for ROWS 1 and 4.
  __m128 p[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  int64_t g = 0;
  for (; g + 4 <= G; g += 4)
    for (int j = 0; j < 4; ++j) {
      const __m128 x = ROWS == 1 ? _mm_load_ss(xs + (g + j) * ld) : _mm_loadu_ps(xs + (g + j) * ld);
      p[j] = _mm_fmadd_ps(_mm_set1_ps(z[g + j]), x, p[j]);
    }
  for (int j = 0; g < G; ++g, ++j) {
    const __m128 x = ROWS == 1 ? _mm_load_ss(xs + g * ld) : _mm_loadu_ps(xs + g * ld);
    p[j] = _mm_fmadd_ps(_mm_set1_ps(z[g]), x, p[j]);
  }
  const __m128 offsets = _mm_add_ps(_mm_add_ps(p[0], p[1]), _mm_add_ps(p[2], p[3]));
  return _mm_add_ps(_mm_fmadd_ps(sums, xscale, _mm_set1_ps(bias)), offsets);
}

// int4 codes in avx512.cpp's layout (per 64-code chunk, 32 bytes: low nibbles the first 32
// codes, high nibbles the next 32) against signed x: rows [m0, m0 + MR), channel n (from 2
// rows on; a one-row batch is gemv_w4a8_rows). Per
// group, the int32 sums are scaled by the group's scale; the offsets come in the epilogue.
template <int MR, int CH>
inline __m128 tile_w4a8(const GemmArgs& a, int64_t m0, int64_t n) {
  const uint8_t* wr = static_cast<const uint8_t*>(a.w) + n * a.ldw;
  const float* sc = a.scales + n * a.num_groups;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int64_t chunks = CH > 0 ? CH : a.group_size / 64;  // CH: known at compile time (unrolled)
  __m256 facc[MR];
  for (int m = 0; m < MR; ++m) facc[m] = Vec::zero();
  for (int64_t g = 0; g * a.group_size < a.K; ++g) {
    __m256i acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {  // int16 sums over <= 4 chunks, as gemv_w4a8_rows
      __m256i p16[MR];
      for (int m = 0; m < MR; ++m) p16[m] = _mm256_setzero_si256();
      for (int64_t c = c0; c < min64(chunks, c0 + 4); ++c) {
        const int64_t k = (g * chunks + c) * 64;
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wr + k / 2));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < MR; ++m) {
          const uint8_t* xr = a.xq + (m0 + m) * a.ldq + k;
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xr)),
                                             _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xr + 32))));
          p16[m] = _mm256_add_epi16(p16[m], p);
        }
      }
      for (int m = 0; m < MR; ++m) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p16[m], ones));
    }
    const __m256 s = Vec::set1(sc[g]);
    for (int m = 0; m < MR; ++m) facc[m] = Vec::fma(_mm256_cvtepi32_ps(acc[m]), s, facc[m]);
  }
  __m256 f[4];
  for (int m = 0; m < 4; ++m) f[m] = m < MR ? facc[m] : Vec::zero();
  return hsum4(f[0], f[1], f[2], f[3]);
}

// One activation row (the one-stream decode): each weight row read whole, in order, so a
// thread's channels are one sequential stream, 64 bytes a step into two accumulators, with
// the line kAhead bytes ahead requested early (a prefetch never faults, past the end too):
// measured 1.3-1.9x the bandwidth of one accumulator without it, at two threads.
void gemv_w8a8_int8(const GemmArgs& a, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = 2048;
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const float xs = a.x_scale[0];
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * a.ldw;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 64 <= a.K; k += 64) {
      _mm_prefetch((const char*)(wr + k + kAhead), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wr + k));
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wr + k + 32));
      acc0 = dot_s8(acc0, _mm256_abs_epi8(w0), w0, load_x_s8(a.xq + k));
      acc1 = dot_s8(acc1, _mm256_abs_epi8(w1), w1, load_x_s8(a.xq + k + 32));
    }
    for (; k < a.K; k += 32) {
      const __m256i w0 = load_w8(wr, k, a.K);
      acc0 = dot_s8(acc0, _mm256_abs_epi8(w0), w0, load_x_s8(a.xq + k));
    }
    const float v = (float)reduce_add_i32(_mm256_add_epi32(acc0, acc1)) * xs * a.scales[n];
    store_out(a, 0, n, finish<kBf16>(a, 0, n, v));  // fp32 out: the logits of an int8 head
  }
}

// gemv_w8a8_int8 over activations quantized per group of 64: the same stream and prefetch,
// each group's sum scaled into one fp32 accumulator in order (tile_w8a8_g64's sums exactly).
void gemv_w8a8_int8_g64(const GemmArgs& a, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = 2048;
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const float* xs = a.x_group_scale;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * a.ldw;
    __m256 acc = Vec::zero();
    for (int64_t k = 0; k < a.K; k += 64) {
      _mm_prefetch((const char*)(wr + k + kAhead), _MM_HINT_T0);
      const __m256i w0 = load_w8(wr, k, a.K);
      const __m256i w1 = k + 32 < a.K ? load_w8(wr, k + 32, a.K) : _mm256_setzero_si256();
      const __m256i d = dot_s8_64(w0, w1, load_x_s8(a.xq + k), load_x_s8(a.xq + k + 32));
      acc = Vec::fma(_mm256_cvtepi32_ps(d), Vec::set1(xs[k / 64]), acc);
    }
    store_out(a, 0, n, finish<kBf16>(a, 0, n, Vec::reduce_add(acc) * a.scales[n]));
  }
}

// Tiles of 4 activation rows x 2 channels (gemm_tiles) from 2 rows on; activations with one
// scale a row or (a.x_group, the table's int8_x_group) one a group of 64.
void gemm_int8(const GemmArgs& a, int64_t n0, int64_t n1) {
  const bool grouped = a.x_group > 0;
  if (a.M == 1) {
    if (grouped) gemv_w8a8_int8_g64(a, n0, n1); else gemv_w8a8_int8(a, n0, n1);
    return;
  }
  gemm_tiles<kBf16, 2>(a, n0, n1, [&](int mr, int nr, int64_t m, int64_t n, float (&out)[4][4]) {
    with_tile_shape<4, 2>(mr, nr, [&](auto M, auto N) {
      constexpr int MR = decltype(M)::value, NR = decltype(N)::value;
      if (grouped) tile_w8a8_g64<MR, NR>(a, m, n, out); else tile_w8a8<MR, NR>(a, m, n, out);
    });
  });
}

// Groups of 32 (GGUF's Q4_0, Q4_1, Q4_K blocks): each 64-code chunk holds two groups, its low
// nibbles (codes 0-31) and its high nibbles (32-63). One 128-bit lane is made of each half's
// first 16 codes and the other of their last 16, so one vpmaddubsw pair and one vpmaddwd
// leave the low group's sums in lanes 0-3 and the high group's in 4-7, and one conversion
// and one FMA by [low scale x4, high scale x4] (weight scale times the row's activation
// scale for that group) finish both groups. quantize_rows_g32 writes the quantized rows in
// that order (each chunk's middle 16-byte quarters swapped) and each row's group scales
// expanded to those 8 lanes (x_group_scale, [M, chunks, 8]). Against one vpmaddwd,
// conversion and FMA per group with scalar scale products, SmolLM2's projections ran 1.7x
// faster at 16 rows (one thread). Rows [m0, m0 + MR), channel n, lanes the rows.
template <int MR>
inline __m128 tile_w4a8_g32(const GemmArgs& a, int64_t m0, int64_t n) {
  constexpr int64_t kAhead = 1024;
  const uint8_t* wr = static_cast<const uint8_t*>(a.w) + n * a.ldw;
  const float* sc = a.scales + n * a.num_groups;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int64_t chunks = a.ldq / 64;  // the quantized rows' whole 64-value chunks, as the codes'
  __m256 facc[MR];
  for (int m = 0; m < MR; ++m) facc[m] = Vec::zero();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k = c * 64;
    if (c % 2 == 0) _mm_prefetch((const char*)(wr + k / 2 + kAhead), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(wr + k / 2));
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20), last = _mm256_permute2x128_si256(lo, hi, 0x31);
    // [low group's weight scale x4, high group's x4]
    const __m256 ws = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)(sc + 2 * c)))), spread);
    for (int m = 0; m < MR; ++m) {
      const uint8_t* xr = a.xq + (m0 + m) * a.ldq + k;
      const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(first, _mm256_loadu_si256((const __m256i*)xr)),
                                           _mm256_maddubs_epi16(last, _mm256_loadu_si256((const __m256i*)(xr + 32))));
      const __m256 s = _mm256_mul_ps(ws, _mm256_loadu_ps(a.x_group_scale + ((m0 + m) * chunks + c) * 8));
      facc[m] = Vec::fma(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), s, facc[m]);
    }
  }
  __m256 f[4];
  for (int m = 0; m < 4; ++m) f[m] = m < MR ? facc[m] : Vec::zero();
  return hsum4(f[0], f[1], f[2], f[3]);
}

// x quantized per row and group of 32 (scale = max |x| / 127 a group, each value x / scale
// rounded to nearest even, as quantize_rows does a row), for tile_w4a8_g32: each 64-value
// chunk's middle 16-byte quarters swapped, its two group scales as [low x4, high x4] in
// a.x_group_scale [M, chunks, 8], and a.xsum [M, G] the scaled sums of the quantized values
// (the offsets' share). a.xq holds ldq = chunks * 64 bytes a row; values past K are zero.
void quantize_rows_g32(const GemmArgs& a, int64_t r0, int64_t r1) {
  const int64_t K = a.K, chunks = a.ldq / 64, G = a.num_groups;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = a.x + r * a.ldx;
    uint8_t* out = a.xq + r * a.ldq;
    for (int64_t g = 0; g < 2 * chunks; ++g) {
      const int64_t k0 = g * 32;
      __m256 v[4];
      Vec::R amax = Vec::zero();
      for (int i = 0; i < 4; ++i) {
        const int n = (int)min64(8, K - k0 - 8 * i);
        v[i] = n > 0 ? Vec::load_bf16(x + k0 + 8 * i, n) : Vec::zero();
        amax = Vec::max(amax, Vec::abs(v[i]));
      }
      const float m = Vec::reduce_max(amax);
      const float scale = m / 127.0f;
      const Vec::R inv = Vec::set1(m > 0.0f ? 127.0f / m : 0.0f);
      __m256i sum = _mm256_setzero_si256();
      // quarters 0..3 of the chunk go to 0, 2, 1, 3: this group's two halves
      uint8_t* dst = out + (g / 2) * 64 + (g % 2) * 16;
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_cvtps_epi32(Vec::mul(v[i], inv));
        sum = _mm256_add_epi32(sum, q);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i*)(dst + (i / 2) * 32 + (i % 2) * 8), _mm_packs_epi16(q16, q16));
      }
      float* lanes = a.x_group_scale + (r * chunks + g / 2) * 8 + (g % 2) * 4;
      for (int i = 0; i < 4; ++i) lanes[i] = scale;
      if (g < G) a.xsum[r * G + g] = (float)reduce_add_i32(sum) * scale;
    }
  }
}

// One activation row (the one-stream decode) over int4 codes, NR channels a step (each x
// load serves them all). The code x activation pairs are summed in int16 over up to 4
// chunks (|sum| <= 4 * 2 * 2 * 15 * 127 = 30480) before one vpmaddwd widens them, and each
// group's int32 sum is scaled once. gemm_w4a8_ch runs one channel a step: on the AVX2 EPYC,
// over the 250M model's int4 layers, that read 1.3x faster than two (15-16 against 10-12
// GB/s at 2 threads; a standalone loop: 13.4 against 10.4 GB/s at one thread, against 15.8
// for a plain read), two rows' streams and prefetches apart costing more than the x loads
// they share.
template <int NR, int CH>
inline void gemv_w4a8_rows(const GemmArgs& a, int64_t n) {
  constexpr int64_t kAhead = 1024;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int64_t chunks = CH > 0 ? CH : a.group_size / 64, groups = (a.K + a.group_size - 1) / a.group_size;
  const uint8_t* w[NR];
  const float* sc[NR];
  __m256 f[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = static_cast<const uint8_t*>(a.w) + (n + r) * a.ldw;
    sc[r] = a.scales + (n + r) * a.num_groups;
    f[r] = Vec::zero();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i i32[NR];
    for (int r = 0; r < NR; ++r) i32[r] = _mm256_setzero_si256();
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      __m256i i16[NR];
      for (int r = 0; r < NR; ++r) i16[r] = _mm256_setzero_si256();
      for (int64_t c = c0; c < min64(chunks, c0 + 4); ++c) {
        const int64_t k = (g * chunks + c) * 64;
        const __m256i xl = _mm256_loadu_si256((const __m256i*)(a.xq + k));
        const __m256i xh = _mm256_loadu_si256((const __m256i*)(a.xq + k + 32));
        for (int r = 0; r < NR; ++r) {
          if (c % 2 == 0) _mm_prefetch((const char*)(w[r] + k / 2 + kAhead), _MM_HINT_T0);  // one line per 2 chunks
          const __m256i v = _mm256_loadu_si256((const __m256i*)(w[r] + k / 2));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          i16[r] = _mm256_add_epi16(i16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
        }
      }
      for (int r = 0; r < NR; ++r) i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(i16[r], ones));
    }
    for (int r = 0; r < NR; ++r) f[r] = Vec::fma(_mm256_cvtepi32_ps(i32[r]), Vec::set1(sc[r][g]), f[r]);
  }
  const __m256 zero = Vec::zero();
  for (int r = 0; r < NR; ++r) {
    const __m128 v = int4_epilogue<1>(hsum4(f[r], zero, zero, zero), _mm_set_ss(a.x_scale[0]),
                                      a.bias ? a.bias[n + r] : 0.0f, a.zeros + (n + r) * a.num_groups, a.xsum,
                                      a.num_groups, 1);
    a.y[n + r] = Vec::bf16(_mm_cvtss_f32(v));
  }
}

// CH: 64-code chunks per group, fixed for the common group sizes (64, 128, 256) so the
// chunk loops unroll (with a runtime count, each group of 128 paid more for its loop's
// entry and exit than for its two chunks); 0 for any other.
// CH -1: groups of 32 (tile_w4a8_g32).
template <int CH>
void gemm_w4a8_ch(const GemmArgs& a, int64_t n0, int64_t n1) {
  if (a.M == 1) {
    if constexpr (CH < 0) {
      for (int64_t n = n0; n < n1; ++n) {
        const __m128 v = int4_epilogue<1>(tile_w4a8_g32<1>(a, 0, n), _mm_set_ss(a.x_scale[0]),
                                          a.bias ? a.bias[n] : 0.0f, a.zeros + n * a.num_groups, a.xsum,
                                          a.num_groups, 1);
        a.y[n] = Vec::bf16(_mm_cvtss_f32(v));
      }
    } else {
      for (int64_t n = n0; n < n1; ++n) gemv_w4a8_rows<1, CH>(a, n);
    }
    return;
  }
  // Epilogue per 4-row tile in vectors: the rows' x scales and, per group, their x sums
  // side by side (this thread's transposed copy), so the offsets' share is one FMA a group.
  const int64_t G = a.num_groups, mp = (a.M + 3) / 4 * 4;
  float* xs_t = row_buffer(mp * (G + 1));
  float* xscale = xs_t + mp * G;
  for (int64_t m = 0; m < mp; ++m) {
    for (int64_t g = 0; g < G; ++g) xs_t[g * mp + m] = m < a.M ? a.xsum[m * G + g] : 0.0f;
    xscale[m] = m < a.M ? a.x_scale[m] : 0.0f;
  }
  alignas(16) float out[4];
  for (int64_t n = n0; n < n1; ++n) {
    const float* z = a.zeros + n * G;
    const float bias = a.bias ? a.bias[n] : 0.0f;
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      __m128 v;
      if constexpr (CH < 0) {
        switch (mr) {
          case 1: v = tile_w4a8_g32<1>(a, m, n); break;
          case 2: v = tile_w4a8_g32<2>(a, m, n); break;
          case 3: v = tile_w4a8_g32<3>(a, m, n); break;
          default: v = tile_w4a8_g32<4>(a, m, n); break;
        }
      } else {
        switch (mr) {
          case 1: v = tile_w4a8<1, CH>(a, m, n); break;
          case 2: v = tile_w4a8<2, CH>(a, m, n); break;
          case 3: v = tile_w4a8<3, CH>(a, m, n); break;
          default: v = tile_w4a8<4, CH>(a, m, n); break;
        }
      }
      _mm_store_ps(out, int4_epilogue<4>(v, _mm_loadu_ps(xscale + m), bias, z, xs_t + m, G, mp));
      for (int i = 0; i < mr; ++i) a.y[(m + i) * a.ldy + n] = Vec::bf16(out[i]);
    }
  }
}

void gemm_w4a8(const GemmArgs& a, int64_t n0, int64_t n1) {
  switch (a.group_size) {
    case 32: gemm_w4a8_ch<-1>(a, n0, n1); break;
    case 64: gemm_w4a8_ch<1>(a, n0, n1); break;
    case 128: gemm_w4a8_ch<2>(a, n0, n1); break;
    case 256: gemm_w4a8_ch<4>(a, n0, n1); break;
    default: gemm_w4a8_ch<0>(a, n0, n1); break;
  }
}

// ---- int4 groups of 32, 8 output channels interleaved (kernels/int4_layout.py's
// pack_channels8, llama.cpp's idea for Q4_0 on AVX2): per 8-channel block and group, 128
// bytes in four 32-byte words; word t holds, for each channel c, bytes 4c..4c+3 whose low
// nibbles are the codes of inputs 8t..8t+3 and high nibbles 8t+4..8t+7. One word's nibbles
// against 4 activations broadcast to every lane give, by vpmaddubsw and vpmaddwd, one int32
// partial sum per channel in lane c: the 8 channels share each activation load, nibble split,
// scale product and FMA, and no horizontal sum is left. The per-channel row kernel
// (tile_w4a8_g32) spent its time on that work per 64 codes of one channel: 5 GB/s of weights
// per thread, a third of a plain read. Scales and offsets come blocked as [blocks, G, 8], fp16.
//
// x is quantize_rows_g32's, read through kernels.h's x8_offset and x8_scale_index.

inline __m256i broadcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [m0, m0 + MR) against block b's 8 channels: out[m] lane c = output (m0 + m, 8b + c)
// before the bias. Each row's sum runs over groups in order with the same operations
// whatever MR is, so a row's result does not depend on the batch it came in.
template <int MR>
inline void tile_w4x8(const GemmArgs& a, int64_t m0, int64_t b, __m256 out[MR]) {
  // 2 KB ahead: SmolLM2's 120 projections of a token at one row, 2 threads, 6.7 ms against
  // 7.2-7.4 at 1 KB (alternating builds); 4 KB 7.9, and prefetching the scales' and
  // offsets' lines too, 7.1.
  constexpr int64_t kAhead = 2048;
  const int64_t G = a.num_groups, chunks = a.ldq / 64;
  const uint8_t* wb = static_cast<const uint8_t*>(a.w) + b * G * 128;
  const uint16_t* sb = a.scales_f16 + b * G * 8;  // fp16: 4 bytes a group of 32 for scale and offset
  const uint16_t* zb = a.offsets_f16 + b * G * 8;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MR], off[MR];
  for (int m = 0; m < MR; ++m) acc[m] = off[m] = Vec::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wb + g * 128;
    _mm_prefetch((const char*)(wg + kAhead), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + kAhead + 64), _MM_HINT_T0);
    __m256i i16[MR];  // |sum| <= 8 * 2 * 15 * 127 = 30480: int16 holds a group
    for (int m = 0; m < MR; ++m) i16[m] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(wg + 32 * t));
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const int64_t xo = tokenmill::x8_offset(g, t);
      for (int m = 0; m < MR; ++m) {
        const uint8_t* xr = a.xq + (m0 + m) * a.ldq + xo;
        i16[m] = _mm256_add_epi16(i16[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xr)),
                                                           _mm256_maddubs_epi16(hi, broadcast4(xr + 4))));
      }
    }
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sb + g * 8)));
    const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(zb + g * 8)));
    for (int m = 0; m < MR; ++m) {
      const float sx = a.x_group_scale[tokenmill::x8_scale_index(m0 + m, chunks, g)];
      acc[m] = Vec::fma(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[m], ones)), _mm256_mul_ps(ws, Vec::set1(sx)), acc[m]);
      off[m] = Vec::fma(z, Vec::set1(a.xsum[(m0 + m) * G + g]), off[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = _mm256_add_ps(acc[m], off[m]);
}

// Blocks [b0, b1) of 8 channels, every row of a.x (quantized by quantize_rows_g32), in
// tiles of up to 4 rows: a block's weights (G * 128 bytes) stay in L1 across its tiles.
void gemm_int4_x8(const GemmArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * 8, nc = min64(8, a.N - n0);
    __m256 bias = Vec::zero();
    if (a.bias) bias = Vec::load_f32(a.bias + n0, (int)nc);
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      __m256 out[4];
      switch (mr) {
        case 1: tile_w4x8<1>(a, m, b, out); break;
        case 2: tile_w4x8<2>(a, m, b, out); break;
        case 3: tile_w4x8<3>(a, m, b, out); break;
        default: tile_w4x8<4>(a, m, b, out); break;
      }
      for (int r = 0; r < mr; ++r) Vec::store_bf16(a.y + (m + r) * a.ldy + n0, _mm256_add_ps(out[r], bias), (int)nc);
    }
  }
}

// Blocks [b0, b1) of 8 channels dequantized to rows of y (fp32 yf, or bf16 yb, ldy values
// apart): w = q * scale + offset, a multiply then an add (two roundings, as the layer's
// dequantize computes it in torch), bf16 rounded to nearest even. Word t's nibbles, split
// and interleaved per 32-bit lane, leave each channel's 8 consecutive inputs in 8 bytes.
void dequantize_int4_x8(const GemmArgs& a, int64_t b0, int64_t b1, float* yf, uint16_t* yb, int64_t ldy,
                        bool blocks) {
  const int64_t kp = (a.K + 1) / 2;  // blocks: kernels/gemv_layout.py's [N / 16, K / 2, 16, 2]
  alignas(32) uint32_t pairs[8][4];
  const int64_t G = a.num_groups, K = a.K;
  const __m256i low4 = _mm256_set1_epi8(15);
  alignas(32) uint8_t bytes[2][32];
  alignas(32) float sc[8], off[8];
  for (int64_t b = b0; b < b1; ++b) {
    const int nc = (int)min64(8, a.N - b * 8);
    const uint8_t* wb = static_cast<const uint8_t*>(a.w) + b * G * 128;
    for (int64_t g = 0; g < G && g * 32 < K; ++g) {
      _mm256_store_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a.scales_f16 + (b * G + g) * 8))));
      _mm256_store_ps(off, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a.offsets_f16 + (b * G + g) * 8))));
      for (int t = 0; t < 4 && g * 32 + 8 * t < K; ++t) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + g * 128 + 32 * t));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        // lane 0: channels 0, 1 (unpacklo) and 2, 3 (unpackhi); lane 1: 4, 5 and 6, 7.
        _mm256_store_si256((__m256i*)bytes[0], _mm256_unpacklo_epi32(lo, hi));
        _mm256_store_si256((__m256i*)bytes[1], _mm256_unpackhi_epi32(lo, hi));
        const int n_k = (int)min64(8, K - g * 32 - 8 * t);
        for (int c = 0; c < nc; ++c) {
          const uint8_t* q8 = bytes[(c / 2) % 2] + (c / 4) * 16 + (c % 2) * 8;
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q8)));
          const __m256 w = _mm256_add_ps(_mm256_mul_ps(q, _mm256_set1_ps(sc[c])), _mm256_set1_ps(off[c]));
          const int64_t n = b * 8 + c;
          if (blocks) {  // K % 32 == 0 (n_k == 8): this channel's 4 (k, k + 1) pairs
            Vec::store_bf16(reinterpret_cast<uint16_t*>(pairs[c]), w, 8);
            continue;
          }
          const int64_t at = n * ldy + g * 32 + 8 * t;
          if (yb) Vec::store_bf16(yb + at, w, n_k);
          else Vec::store_f32(yf + at, w, n_k);
        }
        if (blocks) {  // each pair's 8 channels: half a 64-byte line of the 16-channel block
          for (int c = nc; c < 8; ++c) pairs[c][0] = pairs[c][1] = pairs[c][2] = pairs[c][3] = 0;
          uint32_t* line = reinterpret_cast<uint32_t*>(yb) + ((b / 2) * kp + g * 16 + 4 * t) * 16 + (b % 2) * 8;
          for (int q = 0; q < 4; ++q) {
            const __m256i v = _mm256_setr_epi32(pairs[0][q], pairs[1][q], pairs[2][q], pairs[3][q], pairs[4][q],
                                                pairs[5][q], pairs[6][q], pairs[7][q]);
            _mm256_storeu_si256((__m256i*)(line + q * 16), v);
          }
        }
      }
    }
  }
}

// The float tiles (tile_any) over weights that WL converts to fp32 in registers.
template <Kind KIND, class WL>
void gemm_float_tiles(const GemmArgs& a, int64_t n0, int64_t n1, const WL& wl) {
  gemm_tiles<KIND, 2>(a, n0, n1, [&](int mr, int nr, int64_t m, int64_t n, float (&out)[4][4]) {
    tile_any(mr, nr, a, m, n, wl, out);
  });
}

void gemm_bf16(const GemmArgs& a, int64_t n0, int64_t n1) {
  gemm_float_tiles<kBf16>(a, n0, n1, Bf16Weights{static_cast<const uint16_t*>(a.w), a.ldw, a.K});
}

// Every group size comes with quantized activations here (ops_linear.cpp; groups of 32 split each
// 64-code chunk in two: tile_w4a8_g32); the fp32 tiles remain for a table that sends none.
void gemm_int4(const GemmArgs& a, int64_t n0, int64_t n1) {
  if (a.xq) { gemm_w4a8(a, n0, n1); return; }
  gemm_float_tiles<kInt4>(a, n0, n1, Int4Weights{static_cast<const uint8_t*>(a.w), a.ldw, a.scales, a.num_groups, a.group_size});
}

// GEMV/GEMM over kernels/gemv_layout.py's 16-channel blocks (see avx512.cpp), as register
// tiles of MR rows x one block: every row's x[k] is broadcast from memory against a line's
// two 8-channel halves (no horizontal sums). A block is one sequential stream of weights; a
// thread runs each of its blocks over a chunk of rows before moving on, so a block is read
// from memory once per chunk and stays in L2 while the chunk's tiles pass over it.
//
// One accumulator per output and half, summed in k order whatever the row count, so a
// row's result does not depend on the batch it came in (a sequence embedded alone equals
// the same sequence in a batch, to the bit). One row is then bound by the FMA latency at
// about 16 (fp32) or 8 (bf16) bytes of weights a cycle, above what one core streams from
// memory; four or more rows keep both FMA units busy.
//
// bf16 lines hold 8 channels' (k, k + 1) pairs per half: the even weights are each 32-bit
// lane shifted up, the odd ones the lane with its low half cleared; x is converted to fp32
// once per chunk (a per-thread buffer) so each broadcast is a plain load.

// Output (m, half h) of a tile plus the bias, stored as STORE does. A macro copying the
// accumulators out first: with the array read under the stores' control flow (or through
// a reference), GCC stored every FMA's result to the stack inside the k loop.
#define TM_TILE_STORE(STORE, OUT)                                                     \
  __m256 sums[MR][2];                                                                 \
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m)                                \
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) sums[m][h] = acc[m][h];       \
  for (int m = 0; m < MR; ++m)                                                        \
    for (int h = 0; h < 2; ++h) {                                                     \
      const int64_t ch = b * 16 + h * 8;                                              \
      const int nr = (int)min64(8, a.N - ch);                                         \
      if (nr <= 0) continue; /* the padding half of the last block */                 \
      __m256 s = sums[m][h];                                                          \
      if (a.bias) s = _mm256_add_ps(s, Vec::load_f32(a.bias + ch, nr));               \
      STORE(OUT + (m0 + m) * a.ldy + ch, s, nr);                                      \
    }

// Rows [0, MR) of xf (fp32, stride ldxf, K padded to 2 with a zero) x block b, into y rows m0...
struct Bf16Tile {
  static constexpr int kMaxRows = 4;  // 8 accumulators + 4 weight vectors + 2 broadcasts
  template <int MR>
  static void run(const GemmArgs& a, const float* xf, int64_t ldxf, int64_t m0, int64_t b) {
    const int64_t kp = (a.K + 1) / 2;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = Vec::zero();
    const uint16_t* wb = static_cast<const uint16_t*>(a.w) + b * kp * 32;
    for (int64_t q = 0; q < kp; ++q) {
      if constexpr (MR == 1) _mm_prefetch((const char*)(wb + q * 32 + 1024), _MM_HINT_T0);  // 2 KB ahead
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wb + q * 32));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wb + q * 32 + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
      for (int m = 0; m < MR; ++m) {
        const __m256 xe = _mm256_broadcast_ss(xf + m * ldxf + 2 * q);
        const __m256 xo = _mm256_broadcast_ss(xf + m * ldxf + 2 * q + 1);
        acc[m][0] = _mm256_fmadd_ps(e0, xe, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(e1, xe, acc[m][1]);
        acc[m][0] = _mm256_fmadd_ps(o0, xo, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(o1, xo, acc[m][1]);
      }
    }
    if (a.yf) {  // fp32 out (logits): no rounding to bf16
      TM_TILE_STORE(Vec::store_f32, a.yf)
    } else {
      TM_TILE_STORE(Vec::store_bf16, a.y)
    }
  }
};

// fp32 lines: one input's 16 channels (two 8-channel halves), x[k] broadcast against both.
struct F32Tile {
  static constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast
  template <int MR>
  static void run(const GemmArgs& a, const float* xf, int64_t ldxf, int64_t m0, int64_t b) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = Vec::zero();
    const float* wb = static_cast<const float*>(a.w) + b * a.K * 16;
    for (int64_t k = 0; k < a.K; ++k) {
      const __m256 lo = _mm256_loadu_ps(wb + k * 16), hi = _mm256_loadu_ps(wb + k * 16 + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(xf + m * ldxf + k);
        acc[m][0] = _mm256_fmadd_ps(lo, xv, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(hi, xv, acc[m][1]);
      }
    }
    TM_TILE_STORE(Vec::store_f32, a.yf)
  }
};

#undef TM_TILE_STORE

template <class Tile>
void gemv_rows(const GemmArgs& a, const float* xf, int64_t ldxf, int64_t m0, int mr, int64_t b) {
  switch (mr) {
    case 1: Tile::template run<1>(a, xf, ldxf, m0, b); break;
    case 2: Tile::template run<2>(a, xf, ldxf, m0, b); break;
    case 3: Tile::template run<3>(a, xf, ldxf, m0, b); break;
    case 4: Tile::template run<4>(a, xf, ldxf, m0, b); break;
    case 5: if constexpr (Tile::kMaxRows >= 5) Tile::template run<5>(a, xf, ldxf, m0, b); break;
    default: if constexpr (Tile::kMaxRows >= 6) Tile::template run<6>(a, xf, ldxf, m0, b); break;
  }
}

// Rows in chunks of ~512 KB of fp32 x (at least one tile), blocks [b0, b1) per chunk: a block
// (K x 32 or 64 bytes) stays in L2 for the chunk's tiles while x streams from L2/L3, and the
// weights are read from memory once per chunk (enough rows per read to keep the FMAs busy).
template <class Tile, bool BF16_X>
void gemv_blocks(const GemmArgs& a, int64_t b0, int64_t b1) {
  constexpr int R = Tile::kMaxRows;
  const int64_t kx = BF16_X ? (a.K + 1) / 2 * 2 : a.K;  // x row length as the lines read it
  const int64_t rows = max64(R, 131072 / kx / R * R);
  for (int64_t c0 = 0; c0 < a.M; c0 += rows) {
    const int64_t c1 = min64(a.M, c0 + rows);
    const float* xf = a.xf + c0 * a.ldx;
    int64_t ldxf = a.ldx;
    if constexpr (BF16_X) {
      float* buf = row_buffer(rows * kx);
      for (int64_t m = c0; m < c1; ++m) {
        const uint16_t* src = a.x + m * a.ldx;
        float* dst = buf + (m - c0) * kx;
        int64_t k = 0;
        for (; k + 8 <= a.K; k += 8) _mm256_storeu_ps(dst + k, Vec::load_bf16(src + k, 8));
        for (; k < a.K; ++k) dst[k] = tokenmill::bf16_to_f32(src[k]);
        if (kx > a.K) dst[a.K] = 0.0f;
      }
      xf = buf;
      ldxf = kx;
    }
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = c0; m < c1; m += R)
        gemv_rows<Tile>(a, xf + (m - c0) * ldxf, ldxf, m, (int)min64(R, c1 - m), b);
  }
}

void gemv_bf16(const GemmArgs& a, int64_t b0, int64_t b1) { gemv_blocks<Bf16Tile, true>(a, b0, b1); }
void gemv_f32(const GemmArgs& a, int64_t b0, int64_t b1) { gemv_blocks<F32Tile, false>(a, b0, b1); }

const tokenmill::KernelTable kTable = {
    "avx2", gemm_bf16, gemm_int8, gemm_int4, rms_norm_kernel, silu_mul_kernel, gelu_tanh_mul_kernel,
    rope_kernel, attention_merge_kernel, quantize_rows, rope_kv_kernel, prefill_attention_kernel, gemv_bf16,
    gemv_f32,
    quantize_rows_g32, /*int8_x_group=*/64, row_max_kernel,
};

// The int4 group fit (ops_linear.cpp's quantize_int4_groups): a group is whole vectors of 8
// (group sizes are multiples of 8), summed per lane and then across lanes in a fixed order.
inline float lane_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.f;
  for (float x : lanes) sum += x;
  return sum;
}

// Codes round((w - o) / s) clamped to 0..15, to nearest even as torch.round.
inline __m256 codes_of(__m256 x, __m256 o, __m256 s) {
  const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_sub_ps(x, o), s), _mm256_setzero_ps()),
                                 _mm256_set1_ps(15.f));
  return _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Codes of one group against scale s and low end o (rounded to fp16 first where half, as
// the layout stores them), written to c; returns the squared error and the parameters used.
float fit_codes(const float* w, int64_t n, bool half, float& s, float& o, float* c) {
  if (half) {
    s = _cvtsh_ss(_cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT));  // as torch's .half(): to nearest even
    o = _cvtsh_ss(_cvtss_sh(o, _MM_FROUND_TO_NEAREST_INT));
  }
  s = std::max(s, 1e-8f);
  const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
  __m256 error = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(w + i), q = codes_of(x, vo, vs);
    _mm256_storeu_ps(c + i, q);
    const __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(q, vs), vo), x);
    error = _mm256_add_ps(error, _mm256_mul_ps(d, d));
  }
  return lane_sum(error);
}

void fit_int4_groups(const tokenmill::Int4Fit& f, int64_t r0, int64_t r1) {
  const int64_t n = f.group_size, G = f.K / n;
  float best[256], grid[256];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
        const float* w = f.w + r * f.ldw + g * n;
        __m256 lo = _mm256_loadu_ps(w), hi = lo, sum = lo;
        for (int64_t i = 8; i < n; i += 8) {
          const __m256 x = _mm256_loadu_ps(w + i);
          lo = _mm256_min_ps(lo, x);
          hi = _mm256_max_ps(hi, x);
          sum = _mm256_add_ps(sum, x);
        }
        alignas(32) float lows[8], highs[8];
        _mm256_store_ps(lows, lo);
        _mm256_store_ps(highs, hi);
        const float w_low = *std::min_element(lows, lows + 8), w_high = *std::max_element(highs, highs + 8);
        const float w_sum = lane_sum(sum);
        float s = (w_high - w_low) / 15.f, o = w_low;
        float error = fit_codes(w, n, f.half, s, o, best);
        float best_s = s, best_o = o;
        for (int64_t l = 0; l < f.num_levels; ++l) {
          const double step = f.levels[l];
          const float grid_s = std::max((w_high - w_low) / static_cast<float>(step), 1e-8f);
          for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(grid + i, codes_of(_mm256_loadu_ps(w + i), _mm256_set1_ps(w_low),
                                                _mm256_set1_ps(grid_s)));
          for (int64_t round = 0; round < f.rounds; ++round) {
            __m256 sum_c = _mm256_setzero_ps(), sum_cc = sum_c, sum_cw = sum_c;
            for (int64_t i = 0; i < n; i += 8) {
              const __m256 q = _mm256_loadu_ps(grid + i);
              sum_c = _mm256_add_ps(sum_c, q);
              sum_cc = _mm256_add_ps(sum_cc, _mm256_mul_ps(q, q));
              sum_cw = _mm256_add_ps(sum_cw, _mm256_mul_ps(q, _mm256_loadu_ps(w + i)));
            }
            const float c_sum = lane_sum(sum_c), cc = lane_sum(sum_cc), cw = lane_sum(sum_cw);
            const float det = static_cast<float>(n) * cc - c_sum * c_sum;
            float fs = best_s, fo = best_o;
            if (det > 0.f) {  // at least two distinct codes
              fs = (static_cast<float>(n) * cw - c_sum * w_sum) / det;
              fo = (w_sum - fs * c_sum) / static_cast<float>(n);
            }
            const float e = fit_codes(w, n, f.half, fs, fo, grid);
            if (e < error) {
              error = e;
              best_s = fs;
              best_o = fo;
              std::copy(grid, grid + n, best);
            }
          }
        }
        for (int64_t i = 0; i < n; ++i) f.codes[r * f.K + g * n + i] = static_cast<int32_t>(best[i]);
        f.scale[r * G + g] = best_s;
        f.low[r * G + g] = best_o;
    }
  }
}

}  // namespace

const tokenmill::KernelTable* tokenmill::avx2_kernels() { return &kTable; }

void tokenmill::avx2_gemm_int4_x8(const GemmArgs& a, int64_t b0, int64_t b1) { gemm_int4_x8(a, b0, b1); }

void tokenmill::avx2_dequantize_int4_x8(const GemmArgs& a, int64_t b0, int64_t b1, float* yf, uint16_t* yb,
                                        int64_t ldy, bool blocks) {
  dequantize_int4_x8(a, b0, b1, yf, yb, ldy, blocks);
}

void tokenmill::avx2_fit_int4_groups(const Int4Fit& f, int64_t r0, int64_t r1) { fit_int4_groups(f, r0, r1); }
