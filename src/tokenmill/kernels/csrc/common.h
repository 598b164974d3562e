// Kernels written once over a Vec type (vec_avx512.h or vec_avx2.h): RMSNorm with a fused
// residual add, SiLU*mul and GELU-tanh*mul, RoPE, and the parts of paged attention
// prefill.h builds on.
// Included by each ISA translation unit after its Vec; internal linkage only (no std
// templates here, so no weak symbol compiled for one ISA can be picked for the other).
#pragma once
#include <cstdint>
#include <cstdlib>
#include "kernels.h"
#include "activation.h"

namespace {

using tokenmill::Fmt;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

template <int FMT>
inline Vec::R ld(const void* p, int64_t i, int n) {
  if constexpr (FMT == tokenmill::F32) return Vec::load_f32(static_cast<const float*>(p) + i, n);
  else if constexpr (FMT == tokenmill::BF16) return Vec::load_bf16(static_cast<const uint16_t*>(p) + i, n);
  else if constexpr (FMT == tokenmill::E4M3) return Vec::load_fp8<4>(static_cast<const uint8_t*>(p) + i, n);
  else return Vec::load_fp8<5>(static_cast<const uint8_t*>(p) + i, n);
}

template <int FMT>
inline void st(void* p, int64_t i, Vec::R v, int n) {
  if constexpr (FMT == tokenmill::F32) Vec::store_f32(static_cast<float*>(p) + i, v, n);
  else Vec::store_bf16(static_cast<uint16_t*>(p) + i, v, n);
}

// The rounding torch applies after each elementwise op in the activation dtype.
template <int FMT>
inline Vec::R rnd(Vec::R v) {
  if constexpr (FMT == tokenmill::BF16) return Vec::round_bf16(v);
  else return v;
}

inline int chunk(int64_t total, int64_t j) { return (int)min64(Vec::W, total - j); }

// out = weight * norm(x [+ residual]), as transformers: the sum rounded to the dtype,
// statistics in fp32, the normalised row rounded before the weight multiply. With a.offset
// (Gemma) the scale is 1 + weight, applied in fp32 before the one rounding.
template <int FMT>
void rms_norm_impl(const tokenmill::NormArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  for (int64_t r = r0; r < r1; ++r) {
    Vec::R ss = Vec::zero();
    const void* src = a.x;
    int64_t base = r * a.ldx;
    for (int64_t j = 0; j < D; j += Vec::W) {
      int n = chunk(D, j);
      Vec::R v = ld<FMT>(a.x, r * a.ldx + j, n);
      if (a.residual) {
        v = rnd<FMT>(Vec::add(v, ld<FMT>(a.residual, r * a.ldr + j, n)));
        st<FMT>(a.residual_out, r * D + j, v, n);
      }
      ss = Vec::fma(v, v, ss);
    }
    if (a.residual) { src = a.residual_out; base = r * D; }
    float inv = 1.0f / __builtin_sqrtf(Vec::reduce_add(ss) / (float)D + a.eps);
    Vec::R vinv = Vec::set1(inv);
    if (a.offset) {  // Gemma: (x * inv) * (1 + weight) in fp32, rounded once
      const Vec::R one = Vec::set1(1.0f);
      for (int64_t j = 0; j < D; j += Vec::W) {
        int n = chunk(D, j);
        Vec::R v = Vec::mul(ld<FMT>(src, base + j, n), vinv);
        st<FMT>(a.out, r * D + j, Vec::mul(v, Vec::add(one, ld<FMT>(a.weight, j, n))), n);
      }
      continue;
    }
    for (int64_t j = 0; j < D; j += Vec::W) {
      int n = chunk(D, j);
      Vec::R v = rnd<FMT>(Vec::mul(ld<FMT>(src, base + j, n), vinv));
      st<FMT>(a.out, r * D + j, Vec::mul(v, ld<FMT>(a.weight, j, n)), n);
    }
  }
}

void rms_norm_kernel(const tokenmill::NormArgs& a, int64_t r0, int64_t r1) {
  if (a.fmt == tokenmill::BF16) rms_norm_impl<tokenmill::BF16>(a, r0, r1);
  else rms_norm_impl<tokenmill::F32>(a, r0, r1);
}

template <int FMT>
void silu_mul_impl(const tokenmill::ActMulArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < D; j += Vec::W) {
      int n = chunk(D, j);
      Vec::R g = ld<FMT>(a.x, r * a.ldx + j, n);
      Vec::R u = ld<FMT>(a.x, r * a.ldx + D + j, n);
      st<FMT>(a.out, r * D + j, Vec::mul(rnd<FMT>(silu(g)), u), n);
    }
  }
}

void silu_mul_kernel(const tokenmill::ActMulArgs& a, int64_t r0, int64_t r1) {
  if (a.fmt == tokenmill::BF16) silu_mul_impl<tokenmill::BF16>(a, r0, r1);
  else silu_mul_impl<tokenmill::F32>(a, r0, r1);
}

// GeGLU with GELU's tanh form (Gemma's gelu_pytorch_tanh), in torch's order of operations:
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in fp32, rounded to the dtype, times up.
template <int FMT>
void gelu_tanh_mul_impl(const tokenmill::ActMulArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < D; j += Vec::W) {
      int n = chunk(D, j);
      Vec::R g = ld<FMT>(a.x, r * a.ldx + j, n);
      Vec::R u = ld<FMT>(a.x, r * a.ldx + D + j, n);
      st<FMT>(a.out, r * D + j, Vec::mul(rnd<FMT>(gelu_tanh(g)), u), n);
    }
  }
}

void gelu_tanh_mul_kernel(const tokenmill::ActMulArgs& a, int64_t r0, int64_t r1) {
  if (a.fmt == tokenmill::BF16) gelu_tanh_mul_impl<tokenmill::BF16>(a, r0, r1);
  else gelu_tanh_mul_impl<tokenmill::F32>(a, r0, r1);
}

// Rotate-half RoPE: out[j] = x[j] cos[j] - x[j+h] sin[j], out[j+h] = x[j+h] cos[j+h] + x[j] sin[j+h],
// each product and the sum rounded to the dtype as torch's elementwise ops do.
template <int FMT>
inline void rope_head(const void* x, int64_t xi, void* out, int64_t oi, const float* c,
                      const float* s, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; j += Vec::W) {
    int n = chunk(h, j);
    Vec::R x1 = ld<FMT>(x, xi + j, n), x2 = ld<FMT>(x, xi + h + j, n);
    Vec::R c1 = rnd<FMT>(Vec::load_f32(c + j, n)), c2 = rnd<FMT>(Vec::load_f32(c + h + j, n));
    Vec::R s1 = rnd<FMT>(Vec::load_f32(s + j, n)), s2 = rnd<FMT>(Vec::load_f32(s + h + j, n));
    Vec::R o1 = Vec::sub(rnd<FMT>(Vec::mul(x1, c1)), rnd<FMT>(Vec::mul(x2, s1)));
    Vec::R o2 = Vec::add(rnd<FMT>(Vec::mul(x2, c2)), rnd<FMT>(Vec::mul(x1, s2)));
    st<FMT>(out, oi + j, o1, n);
    st<FMT>(out, oi + h + j, o2, n);
  }
}

template <int FMT>
void rope_impl(const tokenmill::RopeArgs& a, int64_t t0, int64_t t1) {
  const int64_t D = a.D;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = a.cos + a.positions[t] * D;
    const float* s = a.sin + a.positions[t] * D;
    for (int64_t hd = 0; hd < a.Hq; ++hd)
      rope_head<FMT>(a.q, t * a.ldq + hd * D, a.q_out, (t * a.Hq + hd) * D, c, s, D);
    for (int64_t hd = 0; hd < a.Hk; ++hd)
      rope_head<FMT>(a.k, t * a.ldk + hd * D, a.k_out, (t * a.Hk + hd) * D, c, s, D);
  }
}

void rope_kernel(const tokenmill::RopeArgs& a, int64_t t0, int64_t t1) {
  if (a.fmt == tokenmill::BF16) rope_impl<tokenmill::BF16>(a, t0, t1);
  else rope_impl<tokenmill::F32>(a, t0, t1);
}

// Attention over paged KV blocks read in place: the building blocks prefill.h's kernel
// (prompt chunks, and decode as one query row per sequence) is made of where the cache is
// not bf16 or the CPU has no bf16 dot products: scores of a few query vectors for a run of
// keys (K converted to fp32 in registers once for all of them), V accumulated into fp32
// registers, the softcap; and the merge of split-K partial outputs (log-sum-exp).
constexpr int kHeadTile = 4;    // query vectors per V tile
constexpr int kVecTile = Vec::W == 16 ? 4 : 2;  // vectors of head_dim per V tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Softcap (Gemma 2): c * tanh(s / c).
inline Vec::R softcap_vec(Vec::R s, float cap) {
  const Vec::R inv = Vec::set1(1.0f / cap), c = Vec::set1(cap);
  return Vec::mul(tanh_vec(Vec::mul(s, inv)), c);
}

// The next key tile's K and V lines, asked for (into L2) a few at a time between the
// current tile's dot products (pump), where they were asked for all at once at the tile's
// start. A line that misses holds a fill buffer until it arrives, and a core has a few
// dozen: a tile's thousand requests in a row stalled the core until most of them had
// arrived, so the tile's arithmetic waited on memory instead of running beside it (perf: the
// prefetch loop held ~55% of decode attention's samples with the cache beyond L3).
struct TilePrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* rows = nullptr;  // byte offset of each of the tile's token rows (the item's heads)
  int64_t lines = 0;              // 64-byte lines of a row, in K (and as many in V)
  int64_t n = 0;                  // rows
  int64_t t = 0, j = 0;           // next: row t, line j of its 2 * lines (K's, then V's)
  inline void pump(int count) {
    for (; count > 0 && t < n; --count) {
      __builtin_prefetch((j < lines ? k + j * 64 : v + (j - lines) * 64) + rows[t], 0, 2);
      if (++j == 2 * lines) { j = 0; ++t; }
    }
  }
  inline void finish() { pump(1 << 30); }
};

// Scores of GN heads (fp32 q rows of stride dq, padded to W) for the block's n tokens:
// per token one K row converted once, GN vectors of partial sums kept aside, then W
// tokens' partials folded at once (transpose_sum) instead of one horizontal sum each.
template <int KF, int GN>
inline void score_block(const void* kc, const int64_t* rows, int n, int64_t D, const float* qf, int64_t dq,
                        float* out, int64_t out_stride, TilePrefetch& pf) {
  alignas(64) float part[GN][Vec::W][Vec::W];
  for (int t0 = 0; t0 < n; t0 += Vec::W) {
    const int tn = (int)min64(Vec::W, n - t0);
    for (int t = 0; t < Vec::W; ++t) {
      Vec::R s[GN];
      for (int g = 0; g < GN; ++g) s[g] = Vec::zero();
      if (t < tn)
        for (int64_t j = 0; j < D; j += Vec::W) {
          pf.pump(1);
          Vec::R kv = ld<KF>(kc, rows[t0 + t] + j, chunk(D, j));
          for (int g = 0; g < GN; ++g) s[g] = Vec::fma(Vec::load_f32(qf + g * dq + j, Vec::W), kv, s[g]);
        }
      for (int g = 0; g < GN; ++g) Vec::store_f32(part[g][t], s[g], Vec::W);
    }
    for (int g = 0; g < GN; ++g) {
      Vec::R r[Vec::W];
      for (int t = 0; t < Vec::W; ++t) r[t] = Vec::load_f32(part[g][t], Vec::W);
      Vec::store_f32(out + g * out_stride + t0, Vec::transpose_sum(r), tn);
    }
  }
}

template <int KF>
inline void score_block_any(int gn, const void* kc, const int64_t* rows, int n, int64_t D, const float* qf,
                            int64_t dq, float* out, int64_t out_stride, TilePrefetch& pf) {
  switch (gn) {
    case 1: score_block<KF, 1>(kc, rows, n, D, qf, dq, out, out_stride, pf); break;
    case 2: score_block<KF, 2>(kc, rows, n, D, qf, dq, out, out_stride, pf); break;
    case 3: score_block<KF, 3>(kc, rows, n, D, qf, dq, out, out_stride, pf); break;
    default: score_block<KF, 4>(kc, rows, n, D, qf, dq, out, out_stride, pf); break;
  }
}

// acc[g][j0 .. j0 + NV * W) += sum over the block's n tokens of p[g][t] * V[t]: heads
// [0, GN) of the tile, NV vectors of head_dim, all in registers for the whole block.
template <int KF, int GN, int NV>
inline void accumulate_v(const void* vc, const int64_t* rows, int n, int64_t j0, int64_t D, const float* p,
                         int64_t ps, float* acc, int64_t da) {
  Vec::R o[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < NV; ++v) o[g][v] = Vec::load_f32(acc + g * da + j0 + v * Vec::W, Vec::W);
  for (int t = 0; t < n; ++t) {
    Vec::R vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = ld<KF>(vc, rows[t] + j0 + v * Vec::W, chunk(D, j0 + v * Vec::W));
    for (int g = 0; g < GN; ++g) {
      const Vec::R w = Vec::set1(p[g * ps + t]);
      for (int v = 0; v < NV; ++v) o[g][v] = Vec::fma(w, vv[v], o[g][v]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < NV; ++v) Vec::store_f32(acc + g * da + j0 + v * Vec::W, o[g][v], Vec::W);
}

template <int KF, int GN>
inline void accumulate_v_heads(const void* vc, const int64_t* rows, int n, int64_t D, const float* p, int64_t ps,
                               float* acc, int64_t da) {
  const int64_t step = kVecTile * Vec::W;
  int64_t j = 0;
  for (; j + step <= D; j += step) accumulate_v<KF, GN, kVecTile>(vc, rows, n, j, D, p, ps, acc, da);
  for (; j < D; j += Vec::W) accumulate_v<KF, GN, 1>(vc, rows, n, j, D, p, ps, acc, da);
}

template <int KF>
inline void accumulate_v_any(int gn, const void* vc, const int64_t* rows, int n, int64_t D, const float* p,
                             int64_t ps, float* acc, int64_t da) {
  switch (gn) {
    case 1: accumulate_v_heads<KF, 1>(vc, rows, n, D, p, ps, acc, da); break;
    case 2: accumulate_v_heads<KF, 2>(vc, rows, n, D, p, ps, acc, da); break;
    case 3: accumulate_v_heads<KF, 3>(vc, rows, n, D, p, ps, acc, da); break;
    default: accumulate_v_heads<KF, 4>(vc, rows, n, D, p, ps, acc, da); break;
  }
}

// Sequences [b0, b1) of a split step: out = sum_s w_s o_s / sum_s w_s, w_s = l_s exp(m_s - M).
template <int QF>
void merge_impl(const tokenmill::AttnArgs& a, int64_t b0, int64_t b1) {
  const int64_t Hq = a.Hq, D = a.D;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s0 = a.seq_slots[b], s1 = a.seq_slots[b + 1];
    for (int64_t hq = 0; hq < Hq; ++hq) {
      float m = -3.0e38f;
      for (int64_t s = s0; s < s1; ++s) m = m > a.partial_ml[2 * (s * Hq + hq)] ? m : a.partial_ml[2 * (s * Hq + hq)];
      float total = 0.0f;
      for (int64_t s = s0; s < s1; ++s)
        total += a.partial_ml[2 * (s * Hq + hq) + 1] * __builtin_expf(a.partial_ml[2 * (s * Hq + hq)] - m);
      for (int64_t j = 0; j < D; j += Vec::W) {
        const int c = chunk(D, j);
        Vec::R o = Vec::zero();
        for (int64_t s = s0; s < s1; ++s) {
          const float w = a.partial_ml[2 * (s * Hq + hq) + 1] * __builtin_expf(a.partial_ml[2 * (s * Hq + hq)] - m) / total;
          o = Vec::fma(Vec::set1(w), Vec::load_f32(a.partial + (s * Hq + hq) * D + j, c), o);
        }
        st<QF>(a.out, b * Hq * D + hq * D + j, o, c);
      }
    }
  }
}

void attention_merge_kernel(const tokenmill::AttnArgs& a, int64_t b0, int64_t b1) {
  if (a.q_fmt == tokenmill::BF16) merge_impl<tokenmill::BF16>(a, b0, b1);
  else merge_impl<tokenmill::F32>(a, b0, b1);
}

// Two maxima in flight (a max's latency is longer than a load's throughput); x - x is 0 for
// a finite x and NaN for a NaN or an infinity, so one sum says whether the chunk had one.
void row_max_kernel(const tokenmill::RowMaxArgs& a, int64_t t0, int64_t t1) {
  constexpr float kLowest = -3.40282347e38f;  // below every finite float: the tail's fill
  for (int64_t t = t0; t < t1; ++t) {
    const float* x = a.x + (t / a.chunks) * a.ldx;
    const int64_t c0 = (t % a.chunks) * a.chunk, c1 = min64(a.cols, c0 + a.chunk);
    Vec::R m0 = Vec::set1(kLowest), m1 = m0, bad = Vec::zero();
    int64_t j = c0;
    for (; j + 2 * Vec::W <= c1; j += 2 * Vec::W) {
      const Vec::R u = Vec::load_f32(x + j, Vec::W), v = Vec::load_f32(x + j + Vec::W, Vec::W);
      m0 = Vec::max(m0, u);
      m1 = Vec::max(m1, v);
      bad = Vec::add(bad, Vec::add(Vec::sub(u, u), Vec::sub(v, v)));
    }
    for (; j < c1; j += Vec::W) {
      const Vec::R u = Vec::load_masked_or(x + j, chunk(c1, j), kLowest);
      m0 = Vec::max(m0, u);
      bad = Vec::add(bad, Vec::sub(u, u));
    }
    a.max[t] = Vec::reduce_max(Vec::max(m0, m1));
    a.nonfinite[t] = Vec::reduce_add(bad) == 0.0f ? 0 : 1;
  }
}

}  // namespace
