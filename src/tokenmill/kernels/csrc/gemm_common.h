// The GEMM pieces avx2.cpp and avx512.cpp share, written once over their Vec type: the
// int8 quantizer of the activations (W8A8, per row or group), the per-output epilogue and store, the
// walk over output tiles, and the dispatch of a tile's run-time shape to its template.
// Included by each ISA translation unit after common.h; internal linkage only (see there).
#pragma once
#include <cstdint>
#include "kernels.h"

namespace {

// x quantized per row to int8 (W8A8): scale = max |x| / 127, each value x / scale rounded to
// nearest even ([M, ldq] bytes, zeros past K up to ldq; is_unsigned: stored as x + 128).
// With a.x_group set, each group of x_group inputs has its own scale (a.x_group_scale
// [M, ldq / x_group], 0 for a group of zeros) and a.x_scale is not written.
void quantize_rows(const tokenmill::GemmArgs& a, bool is_unsigned, int64_t r0, int64_t r1) {
  const int64_t K = a.K, span = a.x_group > 0 ? a.x_group : a.ldq;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = a.x + r * a.ldx;
    uint8_t* out = a.xq + r * a.ldq;
    for (int64_t k0 = 0; k0 < a.ldq; k0 += span) {  // ldq: whole 64-byte chunks
      const int64_t k1 = min64(k0 + span, a.ldq);
      Vec::R amax = Vec::zero();
      for (int64_t k = k0; k < min64(k1, K); k += Vec::W)
        amax = Vec::max(amax, Vec::abs(Vec::load_bf16(x + k, (int)min64(Vec::W, K - k))));
      const float m = Vec::reduce_max(amax);
      const float scale = m > 0.0f ? m / 127.0f : 1.0f;
      const Vec::R inv = Vec::set1(1.0f / scale);
      if (a.x_group > 0)
        a.x_group_scale[r * (a.ldq / span) + k0 / span] = m > 0.0f ? scale : 0.0f;
      else
        a.x_scale[r] = scale;
      for (int64_t k = k0; k < k1; k += Vec::W) {
        const int n = (int)min64(Vec::W, K - k);
        const Vec::R v = n > 0 ? Vec::mul(Vec::load_bf16(x + k, n), inv) : Vec::zero();
        Vec::store_int8(out + k, v, is_unsigned);
      }
    }
  }
}

// What an output still needs after its tile's sum: kInt4 the group offsets times the row's
// activation sums over each group; both the bias. (The int tiles apply their scales.)
enum Kind { kBf16, kInt4 };

template <Kind KIND>
inline float finish(const tokenmill::GemmArgs& a, int64_t m, int64_t n, float s) {
  if constexpr (KIND == kInt4) {
    const float* z = a.zeros + n * a.num_groups;
    const float* xs = a.xsum + m * a.num_groups;
    for (int64_t g = 0; g < a.num_groups; ++g) s += z[g] * xs[g];
  }
  if (a.bias) s += a.bias[n];
  return s;
}

// Output (m, n): fp32 where the op returns fp32 (a.yf: logits, unrounded), else bf16.
inline void store_out(const tokenmill::GemmArgs& a, int64_t m, int64_t n, float v) {
  if (a.yf)
    a.yf[m * a.ldy + n] = v;
  else
    a.y[m * a.ldy + n] = Vec::bf16(v);
}

template <int V>
struct Const {
  static constexpr int value = V;
};

// f(Const<M>{}, Const<N>{}) for a tile of mr rows (1..MAX_M) x nr channels (1..MAX_N): a
// run-time shape to the template instantiated for it.
template <int MAX_M, int MAX_N, int M = 1, int N = 1, class F>
inline void with_tile_shape(int mr, int nr, const F& f) {
  if (mr == M && nr == N) {
    f(Const<M>{}, Const<N>{});
  } else if constexpr (N < MAX_N) {
    with_tile_shape<MAX_M, MAX_N, M, N + 1>(mr, nr, f);
  } else if constexpr (M < MAX_M) {
    with_tile_shape<MAX_M, MAX_N, M + 1, 1>(mr, nr, f);
  }
}

// Channels [n0, n1) in tiles of up to 4 rows x NB channels: tile(mr, nr, m, n, out) leaves
// each output's sum in out, finish<KIND> adds what the tile left out.
template <Kind KIND, int NB, class TileFn>
void gemm_tiles(const tokenmill::GemmArgs& a, int64_t n0, int64_t n1, const TileFn& tile) {
  float out[4][4];
  for (int64_t n = n0; n < n1; n += NB) {
    const int nr = (int)min64(NB, n1 - n);
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mr = (int)min64(4, a.M - m);
      tile(mr, nr, m, n, out);
      for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) store_out(a, m + i, n + r, finish<KIND>(a, m + i, n + r, out[i][r]));
    }
  }
}

}  // namespace
