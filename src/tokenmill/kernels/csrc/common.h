// Kernels written once over a Vec type (vec_avx512.h or vec_avx2.h): RMSNorm with a fused
// residual add, SiLU*mul, RoPE, and decode attention over paged KV blocks read in place.
// Included by each ISA translation unit after its Vec; internal linkage only (no std
// templates here, so no weak symbol compiled for one ISA can be picked for the other).
#pragma once
#include <cstdint>
#include <cstdlib>
#include "kernels.h"

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
// statistics in fp32, the normalised row rounded before the weight multiply.
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
void silu_mul_impl(const tokenmill::SiluMulArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  const Vec::R one = Vec::set1(1.0f), zero = Vec::zero();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < D; j += Vec::W) {
      int n = chunk(D, j);
      Vec::R g = ld<FMT>(a.x, r * a.ldx + j, n);
      Vec::R u = ld<FMT>(a.x, r * a.ldx + D + j, n);
      Vec::R s = rnd<FMT>(Vec::div(g, Vec::add(one, Vec::exp(Vec::sub(zero, g)))));
      st<FMT>(a.out, r * D + j, Vec::mul(s, u), n);
    }
  }
}

void silu_mul_kernel(const tokenmill::SiluMulArgs& a, int64_t r0, int64_t r1) {
  if (a.fmt == tokenmill::BF16) silu_mul_impl<tokenmill::BF16>(a, r0, r1);
  else silu_mul_impl<tokenmill::F32>(a, r0, r1);
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

// One query per sequence over its KV blocks, read where they lie: for each (sequence, KV
// head) the group's query heads score every cached token (K converted to fp32 in
// registers, once for the whole group), softmax in fp32, then V accumulated in fp32.
constexpr int kMaxGroupTile = 8;

template <int QF, int KF>
void attention_impl(const tokenmill::AttnArgs& a, int64_t i0, int64_t i1) {
  const int64_t D = a.D, G = a.Hq / a.Hkv, bs = a.block_size;
  float* qf = static_cast<float*>(std::malloc(sizeof(float) * G * D));
  float* acc = static_cast<float*>(std::malloc(sizeof(float) * G * D));
  float* scores = nullptr;
  int64_t scores_cap = 0;
  for (int64_t idx = i0; idx < i1; ++idx) {
    const int64_t b = idx / a.Hkv, h = idx % a.Hkv;
    const int64_t ctx = a.context_lens[b];
    const int64_t start = a.window > 0 ? max64(0, ctx - a.window) : 0;
    const int64_t L = ctx - start;
    if (G * L > scores_cap) {
      std::free(scores);
      scores_cap = G * L;
      scores = static_cast<float*>(std::malloc(sizeof(float) * scores_cap));
    }
    const int64_t* table = a.block_tables + b * a.ldbt;
    const Vec::R qscale = Vec::set1(a.scale * a.k_scale);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < D; j += Vec::W) {
        int n = chunk(D, j);
        Vec::store_f32(qf + g * D + j, Vec::mul(ld<QF>(a.q, b * a.ldq + (h * G + g) * D + j, n), qscale), n);
      }
    for (int64_t t = start; t < ctx; ++t) {
      const int64_t row = ((table[t / bs] * bs + t % bs) * a.Hkv + h) * D;
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroupTile) {
        const int64_t gn = min64(kMaxGroupTile, G - g0);
        Vec::R s[kMaxGroupTile];
        for (int64_t gi = 0; gi < gn; ++gi) s[gi] = Vec::zero();
        for (int64_t j = 0; j < D; j += Vec::W) {
          int n = chunk(D, j);
          Vec::R kv = ld<KF>(a.k_cache, row + j, n);
          for (int64_t gi = 0; gi < gn; ++gi)
            s[gi] = Vec::fma(Vec::load_f32(qf + (g0 + gi) * D + j, n), kv, s[gi]);
        }
        for (int64_t gi = 0; gi < gn; ++gi) scores[(g0 + gi) * L + (t - start)] = Vec::reduce_add(s[gi]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sc = scores + g * L;
      Vec::R m = Vec::set1(-3.0e38f);
      for (int64_t t = 0; t < L; t += Vec::W) {
        int n = chunk(L, t);
        Vec::R v = Vec::load_f32(sc + t, n);
        if (n < Vec::W) {  // lanes past the end load as 0; keep them from raising the max
          float tmp[Vec::W];
          Vec::store_f32(tmp, v, Vec::W);
          for (int i = n; i < Vec::W; ++i) tmp[i] = -3.0e38f;
          v = Vec::load_f32(tmp, Vec::W);
        }
        m = Vec::max(m, v);
      }
      const Vec::R vmax = Vec::set1(Vec::reduce_max(m));
      Vec::R sum = Vec::zero();
      for (int64_t t = 0; t < L; t += Vec::W) {
        int n = chunk(L, t);
        Vec::R e = Vec::exp(Vec::sub(Vec::load_f32(sc + t, n), vmax));
        Vec::store_f32(sc + t, e, n);
        sum = Vec::add(sum, Vec::load_f32(sc + t, n));  // reload: drops the tail lanes
      }
      const float inv = a.v_scale / Vec::reduce_add(sum);
      for (int64_t t = 0; t < L; t += Vec::W) {
        int n = chunk(L, t);
        Vec::store_f32(sc + t, Vec::mul(Vec::load_f32(sc + t, n), Vec::set1(inv)), n);
      }
    }
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.0f;
    for (int64_t t = start; t < ctx; ++t) {
      const int64_t row = ((table[t / bs] * bs + t % bs) * a.Hkv + h) * D;
      for (int64_t j = 0; j < D; j += Vec::W) {
        int n = chunk(D, j);
        Vec::R vv = ld<KF>(a.v_cache, row + j, n);
        for (int64_t g = 0; g < G; ++g) {
          float* o = acc + g * D + j;
          Vec::store_f32(o, Vec::fma(Vec::set1(scores[g * L + (t - start)]), vv, Vec::load_f32(o, n)), n);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < D; j += Vec::W) {
        int n = chunk(D, j);
        st<QF>(a.out, b * a.Hq * D + (h * G + g) * D + j, Vec::load_f32(acc + g * D + j, n), n);
      }
  }
  std::free(scores);
  std::free(acc);
  std::free(qf);
}

template <int QF>
void attention_for_q(const tokenmill::AttnArgs& a, int64_t i0, int64_t i1) {
  switch (a.kv_fmt) {
    case tokenmill::F32: attention_impl<QF, tokenmill::F32>(a, i0, i1); break;
    case tokenmill::BF16: attention_impl<QF, tokenmill::BF16>(a, i0, i1); break;
    case tokenmill::E4M3: attention_impl<QF, tokenmill::E4M3>(a, i0, i1); break;
    default: attention_impl<QF, tokenmill::E5M2>(a, i0, i1); break;
  }
}

void attention_kernel(const tokenmill::AttnArgs& a, int64_t i0, int64_t i1) {
  if (a.q_fmt == tokenmill::BF16) attention_for_q<tokenmill::BF16>(a, i0, i1);
  else attention_for_q<tokenmill::F32>(a, i0, i1);
}

}  // namespace
