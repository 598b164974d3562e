// Prefill attention over paged KV blocks read in place: a chunk of a request's queries (its
// last positions) attends everything the request has in the cache, its own chunk causally.
// Included by each ISA translation unit after common.h (score_block, accumulate_v, the
// softcap); internal linkage only.
//
// A work item is (sequence, KV heads, query tile): for a prompt chunk one KV head and up to
// 16 query vectors (rows x its G query heads; 128 on AMX), so each K/V row read from the
// cache serves all of them; for decode (ops_attention.cpp's paged_decode_attention) one
// query row and every KV head, over the item's share of the keys when a long context is
// split (split-K, merged by common.h's attention_merge). The item walks the keys its rows
// can see in tiles of PrefillArgs::key_tile tokens (kernels.h), across block boundaries:
// scores for every query vector of the tile (K converted in registers once per group of
// score_tile vectors), masked per row (causal, sliding window), an online softmax per
// vector (running max and sum in fp32), and V accumulated into fp32 registers. No gather
// into contiguous K/V, no [queries, context] mask, no scores buffer longer than a key tile.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include "kernels.h"

namespace {

constexpr int kPrefillScoreTile = Vec::W == 16 ? 8 : 4;  // vectors scored per pass over K
constexpr int kLaneVectors = 4;  // query vectors a decode item scores in place (qk_lanes16)

#ifdef TOKENMILL_BF16_DOT
// bf16 queries over a bf16 cache (AVX512-BF16): Q.K and P.V as bf16 pair dot products with
// fp32 accumulation (_mm512_dpbf16_ps), torch's flash kernel's precision (it too rounds the
// softmax weights to bf16 before P.V). Keys are packed 16 at a time transposed (lane t:
// token t), so one dot product scores 16 keys of one query vector with no horizontal sums;
// V is packed by token pairs (word = the same channel of two tokens).
constexpr bool kBf16Dot = true;

// 16 x 16 32-bit transpose in registers.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + j] now holds, in each 128-bit lane L, column 4L + j of rows 4i .. 4i + 3.
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);       // lanes 0, 2 of rows 0-3 | 4-7
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);   // lanes 1, 3
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);         // column j
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);     // column 8 + j
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);  // column 4 + j
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd); // column 12 + j
  }
}

// kt[p * 16 + t] = word p (channels 2p, 2p + 1) of key t's row, for the n <= 16 keys at
// rows (zero words for missing keys and past head_dim); P words per row, padded to 16.
inline void pack_keys16(const uint16_t* kc, const int64_t* rows, int n, int64_t D, int64_t P, uint32_t* kt) {
  for (int64_t p0 = 0; p0 < P; p0 += 16) {
    __m512i r[16];
    const __mmask32 m = Vec::mask32(D - 2 * p0);
    for (int t = 0; t < 16; ++t) r[t] = t < n ? _mm512_maskz_loadu_epi16(m, kc + rows[t] + 2 * p0) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (p0 + i) * 16, r[i]);
  }
}

// s[g][16 j .. 16 j + 16) = scale * (q_g . k_t) for NG packed groups j of 16 keys (group j
// at kt + j * P * 16), GN query vectors of P words. Two groups at once (decode) give twice
// the independent accumulators, each query word broadcast once for both: with one group a
// decode item's few query vectors (SmolLM2: 3 a KV head) leave as few dot-product chains,
// each waiting on the last's latency. Every score's chain is the same for any NG.
template <int GN, int NG = 1>
inline void qk16(const uint32_t* qw, int64_t P, const uint32_t* kt, float scale, float* s, int64_t ss,
                 TilePrefetch& pf) {
  __m512 acc[NG][GN];
  for (int j = 0; j < NG; ++j)
    for (int g = 0; g < GN; ++g) acc[j][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {  // P: the row stride, in words; the pad words are 0
    pf.pump(2 * NG);
    __m512bh k[NG];
    for (int j = 0; j < NG; ++j) k[j] = (__m512bh)_mm512_load_si512(kt + (j * P + p) * 16);
    for (int g = 0; g < GN; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32((int)qw[g * P + p]);
      for (int j = 0; j < NG; ++j) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], w, k[j]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int j = 0; j < NG; ++j)
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(s + g * ss + 16 * j, _mm512_mul_ps(acc[j][g], vs));
}

template <int NG>
inline void qk16_gn(int gn, const uint32_t* qw, int64_t P, const uint32_t* kt, float scale, float* s, int64_t ss,
                    TilePrefetch& pf) {
  switch (gn) {
    case 1: qk16<1, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 2: qk16<2, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 3: qk16<3, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 4: qk16<4, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 5: qk16<5, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 6: qk16<6, NG>(qw, P, kt, scale, s, ss, pf); break;
    case 7: qk16<7, NG>(qw, P, kt, scale, s, ss, pf); break;
    default: qk16<8, NG>(qw, P, kt, scale, s, ss, pf); break;
  }
}

// s[g][0 .. 16 * groups) for groups (1 or 2) packed groups of 16 keys, gn query vectors.
inline void qk16_any(int gn, int groups, const uint32_t* qw, int64_t P, const uint32_t* kt, float scale, float* s,
                     int64_t ss, TilePrefetch& pf) {
  if (groups == 2) qk16_gn<2>(gn, qw, P, kt, scale, s, ss, pf);
  else qk16_gn<1>(gn, qw, P, kt, scale, s, ss, pf);
}

// Decode's Q.K with the keys read where they lie, for up to 4 query vectors (a decode item's
// query heads of one KV head: 3 on SmolLM2, 4 on Llama-style 4:1 groups and Gemma 3). Each
// vector owns a 128-bit lane of a register that holds 4 of its words (8 channels) per chunk
// (ql: qk_lanes_query), and a key's same 4 words, loaded once and broadcast to the 4 lanes,
// advance the 4 vectors' scores of that key by 8 channels in one dot product. The 4 partial
// sums in each lane are added by shuffles shared by 4 keys, and 4 keys' results are
// transposed by 128-bit lanes into each vector's 16 scores: 32 shuffles per 16 keys for any
// head_dim, where packing the keys (pack_keys16) costs 96 per 32 channels, redone every step
// since the cache keeps tokens in rows. Lanes of vectors past gn hold zero queries.

// ql[c * 16 + 4 g + j] = word 4c + j of query vector g (qw rows P words apart), 0 past gn.
inline void qk_lanes_query(const uint32_t* qw, int gn, int64_t P, int64_t chunks, uint32_t* ql) {
  for (int64_t c = 0; c < chunks; ++c)
    for (int g = 0; g < kLaneVectors; ++g)
      for (int j = 0; j < 4; ++j) ql[c * 16 + 4 * g + j] = g < gn ? qw[g * P + 4 * c + j] : 0u;
}

// Lane g of the result: the scores of keys r[0 .. 4) for query vector g (acc[u]: key u's
// dot products, 4 partial sums a lane).
inline __m512 qk_lanes_sum4(const __m512* acc) {
  const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)), _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
}

// s[g * ss + t] = scale * (q_g . k_t) for the n <= 16 keys at rows (bf16 elements into kc),
// g < gn <= 4, chunks = head_dim / 8; the lanes past n hold scores nobody reads (of key 0).
inline void qk_lanes16(const uint32_t* ql, int64_t chunks, const uint16_t* kc, const int64_t* rows, int n, int gn,
                       float scale, float* s, int64_t ss, TilePrefetch& pf) {
  __m512 z[4];
  for (int h = 0; h < 2; ++h) {  // 8 keys a pass: 8 independent dot-product chains
    const uint16_t* r[8];
    for (int u = 0; u < 8; ++u) r[u] = kc + rows[8 * h + u < n ? 8 * h + u : 0];
    __m512 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh q = (__m512bh)_mm512_load_si512(ql + c * 16);
      pf.pump(2);
      for (int u = 0; u < 8; ++u) {
        const __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[u] + 8 * c)));
        acc[u] = _mm512_dpbf16_ps(acc[u], q, (__m512bh)k);
      }
    }
    z[2 * h] = qk_lanes_sum4(acc);
    z[2 * h + 1] = qk_lanes_sum4(acc + 4);
  }
  // z[i] lane g = vector g's scores of keys 4i .. 4i + 3: transpose by 128-bit lanes.
  const __m512 t0 = _mm512_shuffle_f32x4(z[0], z[1], 0x44), t1 = _mm512_shuffle_f32x4(z[0], z[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(z[2], z[3], 0x44), t3 = _mm512_shuffle_f32x4(z[2], z[3], 0xEE);
  const __m512 w[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                       _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
  const __m512 vs = _mm512_set1_ps(scale);
  for (int g = 0; g < gn; ++g) _mm512_storeu_ps(s + g * ss, _mm512_mul_ps(w[g], vs));
}

// vp[tp * dp + j] = channel j of keys 2tp (low half) and 2tp + 1 (high half), zero past n.
inline void pack_values(const uint16_t* vc, const int64_t* rows, int n, int64_t D, int64_t dp, uint32_t* vp) {
  for (int t = 0; t < n; t += 2) {
    uint32_t* o = vp + (t / 2) * dp;
    for (int64_t j = 0; j < dp; j += 16) {
      const __mmask16 m = j + 16 <= D ? (__mmask16)0xFFFF : j < D ? (__mmask16)((1u << (D - j)) - 1u) : (__mmask16)0;
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, vc + rows[t] + j));
      const __m512i b = t + 1 < n ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, vc + rows[t + 1] + j)) : _mm512_setzero_si512();
      _mm512_store_si512(o + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// acc[g][j0 .. j0 + 16 NV) += sum over key pairs of the weights (bf16 pairs pw) times V.
template <int GN, int NV>
inline void pv_pairs(const uint32_t* vp, int64_t pairs, int64_t dp, int64_t j0, const uint32_t* pw, int64_t ps,
                     float* acc, TilePrefetch& pf) {
  __m512 o[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < NV; ++v) o[g][v] = _mm512_loadu_ps(acc + g * dp + j0 + 16 * v);
  for (int64_t tp = 0; tp < pairs; ++tp) {
    pf.pump(4);
    __m512bh vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_load_si512(vp + tp * dp + j0 + 16 * v);
    for (int g = 0; g < GN; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[g * ps + tp]);
      for (int v = 0; v < NV; ++v) o[g][v] = _mm512_dpbf16_ps(o[g][v], w, vv[v]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * dp + j0 + 16 * v, o[g][v]);
}

template <int GN>
inline void pv_heads(const uint32_t* vp, int64_t pairs, int64_t dp, const uint32_t* pw, int64_t ps, float* acc,
                     TilePrefetch& pf) {
  int64_t j = 0;
  for (; j + 64 <= dp; j += 64) pv_pairs<GN, 4>(vp, pairs, dp, j, pw, ps, acc, pf);
  for (; j < dp; j += 16) pv_pairs<GN, 1>(vp, pairs, dp, j, pw, ps, acc, pf);
}

inline void pv_any(int gn, const uint32_t* vp, int64_t pairs, int64_t dp, const uint32_t* pw, int64_t ps, float* acc,
                   TilePrefetch& pf) {
  switch (gn) {
    case 1: pv_heads<1>(vp, pairs, dp, pw, ps, acc, pf); break;
    case 2: pv_heads<2>(vp, pairs, dp, pw, ps, acc, pf); break;
    case 3: pv_heads<3>(vp, pairs, dp, pw, ps, acc, pf); break;
    default: pv_heads<4>(vp, pairs, dp, pw, ps, acc, pf); break;
  }
}

// The weights p[0 .. n) as bf16 pairs, the odd tail padded with 0.
inline void pack_weights(const float* p, int n, uint32_t* pw) {
  uint16_t* h = reinterpret_cast<uint16_t*>(pw);
  for (int t = 0; t < n; t += 16) {
    const int c = n - t < 16 ? n - t : 16;
    Vec::store_bf16(h + t, Vec::load_f32(p + t, c), c);
  }
  if (n % 2) h[n] = 0;
}
// Lanes t .. t + 15 that lie in [ta, te).
inline __mmask16 lanes_in(int t, int ta, int te) {
  const int lo = ta > t ? ta - t : 0, hi = te - t < 16 ? te - t : 16;
  return hi <= lo ? (__mmask16)0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// exp(x) for attention weights that are rounded to bf16 (8 significant bits) before P.V: a
// degree-4 polynomial on [-ln2/2, ln2/2], relative error 3.6e-6 (500x under bf16's half
// ulp), where Vec::exp's degree 6 keeps fp32's last bit for two more FMAs and a clamp. The
// arguments are scores less their row's max: <= 0, and any far below underflow to 0 in
// scalef, so there is nothing to clamp.
inline __m512 exp_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0419175290f), r, _mm512_set1_ps(0.167921603f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.499988705f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999962270f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.00000012f));
  return _mm512_scalef_ps(p, n);
}

// One row's online-softmax update in a single pass from raw scores s (q . k, unscaled) to
// the bf16 weights w[0 .. nk) that P.V reads (amx_pv, or pv_pairs without AMX): the row's keys [ta, te) weigh
// exp(scale * s - max), every other key up to nk (a whole number of 16-pair tiles) 0; the
// running max and sum move on and the accumulators are rescaled. With the scale folded
// into the exponent (scale > 0: the max of the raw scores is the max of the scaled), the
// scores are read twice and never written, and the weights are written once, where the
// general path takes five passes (scale, max, exp, sum, bf16).
inline void softmax_row_bf16(const float* s, int ta, int te, int nk, float scale, float& mx, float& sm, float* acc,
                            int64_t dp, uint16_t* w) {
  if (ta == te) {
    std::memset(w, 0, sizeof(uint16_t) * nk);
    return;
  }
  // The vectors [v0, v1) hold the row's keys; only the first and last can be partly outside
  // [ta, te), so the others skip the lane masks (a dozen scalar instructions a vector, as
  // many as the exp's). Before v0 and from v1 the weights are 0 and the sum does not move.
  const int v0 = ta & ~15, v1 = (te + 15) & ~15;
  __m512 vmax = _mm512_set1_ps(-3.0e38f);
  for (int t = v0; t < v1; t += 16) {
    const __m512 x = _mm512_loadu_ps(s + t);
    vmax = t >= ta && t + 16 <= te ? _mm512_max_ps(vmax, x) : _mm512_mask_max_ps(vmax, lanes_in(t, ta, te), vmax, x);
  }
  const float tile_max = _mm512_reduce_max_ps(vmax) * scale;
  const float m_new = mx > tile_max ? mx : tile_max;
  const float alpha = __builtin_expf(mx - m_new);
  const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(-m_new);
  const __m256i zero = _mm256_setzero_si256();
  for (int t = 0; t < v0; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), zero);
  __m512 sum = _mm512_setzero_ps();
  for (int t = v0; t < v1; t += 16) {
    __m512 p;
    if (t >= ta && t + 16 <= te) {
      p = exp_weights(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), vs, vm));
    } else {
      const __mmask16 k = lanes_in(t, ta, te);
      p = _mm512_maskz_mov_ps(k, exp_weights(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + t), vs, vm)));
    }
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), Vec::to_bf16(p));
  }
  for (int t = v1; t < nk; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), zero);
  sm = sm * alpha + _mm512_reduce_add_ps(sum);
  mx = m_new;
  if (alpha != 1.0f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t j = 0; j < dp; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), va));
  }
}

#ifdef TOKENMILL_AMX_TILES
// The same packed operands on AMX-BF16 tiles (PrefillArgs::amx): qw's rows (P words, a
// multiple of 16) are A tiles of 16 words, kt's groups of 16 keys B tiles of 16 lines, pw's
// rows A tiles of 16 key pairs and vp's rows B tiles of 16 key pairs x 16 channels. Tiles
// 0-3: fp32 [16, 16] (the scores of 16 keys, or 16 output channels); 4: A; 5, 6: B. Always
// 16 rows: an item's query vectors are padded to a multiple of 16 in the scratch (the rows
// past them are computed and never read), so the tiles are configured once per call.
inline void amx_attention_configure() {
  tokenmill::AmxTileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// s[m][0 .. n) = scale * (q_m . k_t), rows ld floats apart, for rows m < ``rows``
// (computed in blocks of 16: the rows past them up to a multiple of 16 are scratch) and
// kt's groups of 16 keys, 64 keys a pass (the groups past n give scores nobody reads).
inline void amx_scores(const uint32_t* qw, int64_t P, const uint32_t* kt, float scale, int rows, int n, int64_t ld,
                       float* s) {
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const uint32_t* q = qw + r0 * P;
    for (int g0 = 0; g0 < n; g0 += 64) {
      const uint32_t* k = kt + g0 * P;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p0 = 0; p0 < P; p0 += 16) {
        _tile_loadd(4, q + p0, P * 4);
        _tile_loadd(5, k + p0 * 16, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, k + (P + p0) * 16, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, k + (2 * P + p0) * 16, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, k + (3 * P + p0) * 16, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
      float* o = s + r0 * ld + g0;
      _tile_stored(0, o, ld * 4);
      _tile_stored(1, o + 16, ld * 4);
      _tile_stored(2, o + 32, ld * 4);
      _tile_stored(3, o + 48, ld * 4);
    }
  }
  if (scale == 1.0f) return;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int m = 0; m < rows; ++m)
    for (int t = 0; t < n; t += 16) _mm512_storeu_ps(s + m * ld + t, _mm512_mul_ps(_mm512_loadu_ps(s + m * ld + t), vs));
}

// acc[m][j0 .. j0 + 16 NV) += the weights' pairs pw (rows lw words apart) times vp's
// chunks of 16 key pairs (zero past the tile's keys on both sides), for 16 rows.
template <int NV>
inline void amx_pv(const uint32_t* vp, int chunks, int64_t dp, int64_t j0, const uint32_t* pw, int64_t lw, float* acc) {
  const int64_t ld = dp * 4;
  _tile_loadd(0, acc + j0, ld);
  if (NV > 1) _tile_loadd(1, acc + j0 + 16, ld);
  if (NV > 2) _tile_loadd(2, acc + j0 + 32, ld);
  if (NV > 3) _tile_loadd(3, acc + j0 + 48, ld);
  for (int c = 0; c < chunks; ++c) {
    const uint32_t* v = vp + c * 16 * dp + j0;
    _tile_loadd(4, pw + c * 16, lw * 4);
    _tile_loadd(5, v, ld);
    _tile_dpbf16ps(0, 4, 5);
    if (NV > 1) { _tile_loadd(6, v + 16, ld); _tile_dpbf16ps(1, 4, 6); }
    if (NV > 2) { _tile_loadd(5, v + 32, ld); _tile_dpbf16ps(2, 4, 5); }
    if (NV > 3) { _tile_loadd(6, v + 48, ld); _tile_dpbf16ps(3, 4, 6); }
  }
  _tile_stored(0, acc + j0, ld);
  if (NV > 1) _tile_stored(1, acc + j0 + 16, ld);
  if (NV > 2) _tile_stored(2, acc + j0 + 32, ld);
  if (NV > 3) _tile_stored(3, acc + j0 + 48, ld);
}

// amx_pv over every channel, for rows m < ``rows`` in blocks of 16 (as amx_scores).
inline void amx_pv_all(const uint32_t* vp, int chunks, int64_t dp, const uint32_t* pw, int64_t lw, float* acc,
                       int rows) {
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const uint32_t* w = pw + r0 * lw;
    float* o = acc + r0 * dp;
    int64_t j = 0;
    for (; j + 64 <= dp; j += 64) amx_pv<4>(vp, chunks, dp, j, w, lw, o);
    switch ((dp - j) / 16) {
      case 1: amx_pv<1>(vp, chunks, dp, j, w, lw, o); break;
      case 2: amx_pv<2>(vp, chunks, dp, j, w, lw, o); break;
      case 3: amx_pv<3>(vp, chunks, dp, j, w, lw, o); break;
      default: break;
    }
  }
}
#endif
#else
constexpr bool kBf16Dot = false;
#endif

template <int KF>
inline void score_block_wide(int gn, const void* kc, const int64_t* rows, int n, int64_t D, const float* qf,
                             int64_t dq, float* out, int64_t out_stride, TilePrefetch& pf) {
  if constexpr (kPrefillScoreTile == 8) {
    switch (gn) {
      case 5: score_block<KF, 5>(kc, rows, n, D, qf, dq, out, out_stride, pf); return;
      case 6: score_block<KF, 6>(kc, rows, n, D, qf, dq, out, out_stride, pf); return;
      case 7: score_block<KF, 7>(kc, rows, n, D, qf, dq, out, out_stride, pf); return;
      case 8: score_block<KF, 8>(kc, rows, n, D, qf, dq, out, out_stride, pf); return;
      default: break;
    }
  }
  score_block_any<KF>(gn, kc, rows, n, D, qf, dq, out, out_stride, pf);
}

template <int QF, int KF>
void prefill_impl(const tokenmill::PrefillArgs& a, int64_t i0, int64_t i1) {
  const int64_t D = a.D, Hq = a.Hq, Hkv = a.Hkv, G = Hq / Hkv, bs = a.block_size;
  const int64_t dp = round_up(D, Vec::W), R = a.rows_per_item, HI = a.heads_per_item;
  const int64_t RG = R * G;  // query vectors per head of an item
  const int64_t KT = a.key_tile;  // keys per softmax update (kernels.h: the callers' choice)
  // Vectors per item, padded to whole 16-row tiles for AMX (which needs one head an item).
  const int64_t MV = a.amx ? round_up(RG, 16) : RG * HI;
  // fp32 scratch: scaled queries and accumulators [MV, dp], running max and sum [MV], one
  // key tile's scores / weights [MV, KT]; K/V row offsets of the tile's keys.
  // bf16 dot products: queries as bf16 pairs [MV, P], keys packed [KT / 16, P, 16],
  // values by key pairs [KT / 2, dp], weights as bf16 pairs [MV, KT / 2].
  constexpr bool fast = kBf16Dot && QF == tokenmill::BF16 && KF == tokenmill::BF16;
  const int64_t P = round_up((D + 1) / 2, 16);
  // Decode items of <= 4 query vectors a head score the keys in place (qk_lanes16).
  const int64_t chunks = D / 8;
  const bool lanes = fast && R == 1 && G <= kLaneVectors && D % 8 == 0 && !a.amx;
  const int64_t words = fast ? MV * P + KT * P + KT / 2 * dp + MV * KT / 2 + (lanes ? HI * chunks * 16 : 0) : 0;
  float* qf = static_cast<float*>(
      std::aligned_alloc(64, sizeof(float) * (2 * MV * dp + 2 * round_up(MV, 16) + MV * KT + words)));
  float* acc = qf + MV * dp;
  float* mx = acc + MV * dp;
  float* sm = mx + round_up(MV, 16);
  float* sc = sm + round_up(MV, 16);
  uint32_t* qw = reinterpret_cast<uint32_t*>(sc + MV * KT);  // each part 64-byte aligned
  uint32_t* kt = qw + MV * P;
  uint32_t* vp = kt + KT * P;
  uint32_t* pw = vp + KT / 2 * dp;
  uint32_t* ql = pw + MV * KT / 2;  // lanes: each head's query chunks (qk_lanes_query)
  (void)kt; (void)vp; (void)pw; (void)ql; (void)lanes;
  int64_t* base = static_cast<int64_t*>(std::aligned_alloc(64, sizeof(int64_t) * 3 * KT));
  int64_t* rows = base + KT;
  int64_t* next_rows = base + 2 * KT;  // the next tile's rows, in bytes (TilePrefetch)
  int configured = -1;  // AMX: whether the tiles are configured
  (void)configured;
  const float dot_scale = a.scale * (a.softcap > 0 ? 1.0f : a.k_scale);  // the cap takes K's scale after it
  const Vec::R qscale = Vec::set1(dot_scale);
#ifdef TOKENMILL_BF16_DOT
  // bf16 prompts without a soft cap: softmax_row_bf16 from the raw scores to the weights.
  const bool fused = fast && a.one_pass_softmax && !(a.softcap > 0);
#else
  constexpr bool fused = false;
#endif
  (void)fused;  // read by the bf16 dot products' code only
  // The keys [ta, te) of a tile of n keys from k0 that the row at pos sees (causal, window).
  auto row_keys = [&a](int64_t pos, int64_t k0, int n) {
    const int ta = a.window > 0 ? (int)min64(n, max64(0, pos - a.window + 1 - k0)) : 0;
    return std::pair<int, int>(ta, (int)max64(ta, min64(n, pos + 1 - k0)));
  };
  const float post_scale = a.softcap > 0 ? a.k_scale : 1.0f;  // K's fp8 scale, before the cap
  const int64_t kv_bytes = KF == tokenmill::F32 ? 4 : KF == tokenmill::BF16 ? 2 : 1;
  // Item idx's sequence, first KV head, query rows [r0, r1), the position of the sequence's
  // first query, and the keys [lo, hi) its rows see: [lo(r), pos(r) + 1), lo = pos - window + 1
  // with a window; a split item only its share [item_keys) of them.
  struct ItemKeys {
    int64_t b, h0, r0, r1, first_pos, lo, hi;
  };
  auto item_keys = [&a, R](int64_t idx) {
    const int64_t* it = a.items + 3 * idx;
    const int64_t b = it[0], h0 = it[1], r0 = it[2];
    const int64_t nq = a.query_start[b + 1] - a.query_start[b], first_pos = a.context_lens[b] - nq;
    const int64_t r1 = min64(nq, r0 + R);
    int64_t lo = a.window > 0 ? max64(0, first_pos + r0 - a.window + 1) : 0, hi = first_pos + r1;
    if (a.item_keys) { lo = max64(lo, a.item_keys[2 * idx]); hi = min64(hi, a.item_keys[2 * idx + 1]); }
    return ItemKeys{b, h0, r0, r1, first_pos, lo, hi};
  };
  // Rows [from, end) of sequence b's keys into pf, whose rows are `out` (byte offsets of the
  // item's heads' lines).
  auto add_rows = [&a, bs, Hkv, D, kv_bytes](TilePrefetch& pf, int64_t* out, int64_t b, int64_t from, int64_t end,
                                             int64_t line0) {
    const int64_t* table = a.block_tables + b * a.ldbt;
    for (int64_t pos = from; pos < end;) {  // block by block: one table read and division per block
      const int64_t off = pos % bs, run = min64(end - pos, bs - off);
      const int64_t row0 = (table[pos / bs] * bs + off) * Hkv * D * kv_bytes + line0;
      for (int64_t u = 0; u < run; ++u) out[pf.n++] = row0 + u * Hkv * D * kv_bytes;
      pos += run;
    }
  };
  for (int64_t idx = i0; idx < i1; ++idx) {
    const ItemKeys ik = item_keys(idx);
    const int64_t b = ik.b, h0 = ik.h0, r0 = ik.r0, r1 = ik.r1, first_pos = ik.first_pos;
    const int64_t q0 = a.query_start[b];
    const int64_t Mh = (r1 - r0) * G;  // vectors per head
    const int64_t* table = a.block_tables + b * a.ldbt;
    // A decode item's last tile asks for the first tile of the item after it (the next in
    // the range, or the one this thread claimed next): at 16 streams of ~160 tokens each
    // item is 2-3 tiles, and a first tile asked for by nobody was a third of the cache read
    // at the rate of demand misses.
    const int64_t next_idx = R == 1 && !a.amx ? (idx + 1 < i1 ? idx + 1 : a.next_item) : -1;
    // Vector hl * RG + i: KV head h0 + hl, query row r0 + i / G, query head (h0 + hl) * G + i % G.
    for (int64_t hl = 0; hl < HI; ++hl)
      for (int64_t i = 0; i < Mh; ++i) {
        const int64_t m = hl * RG + i, row = q0 + r0 + i / G, hq = (h0 + hl) * G + i % G;
        for (int64_t j = 0; j < dp; j += Vec::W) {
          if constexpr (!fast) {  // the scaled fp32 query the float dot products read
            Vec::R qv = j < D ? Vec::mul(ld<QF>(a.q, row * a.ldq + hq * D + j, chunk(D, j)), qscale) : Vec::zero();
            Vec::store_f32(qf + m * dp + j, qv, Vec::W);
          }
          Vec::store_f32(acc + m * dp + j, Vec::zero(), Vec::W);
        }
#ifdef TOKENMILL_BF16_DOT
        if constexpr (fast) {  // the bf16 query as it is (exact), zero past D; the scale goes on the scores
          uint16_t* w = reinterpret_cast<uint16_t*>(qw + m * P);
          const uint16_t* src = static_cast<const uint16_t*>(a.q) + row * a.ldq + hq * D;
          for (int64_t j = 0; j < 2 * P; j += 32)
            _mm512_storeu_si512(w + j, _mm512_maskz_loadu_epi16(Vec::mask32(D - j), src + j));
        }
#endif
        mx[m] = -3.0e38f;
        sm[m] = 0.0f;
      }
#ifdef TOKENMILL_BF16_DOT
    if (lanes)
      for (int64_t hl = 0; hl < HI; ++hl) qk_lanes_query(qw + hl * RG * P, (int)Mh, P, chunks, ql + hl * chunks * 16);
#endif
    const int64_t lo0 = ik.lo, hi1 = ik.hi;
    const int64_t line0 = h0 * D * kv_bytes, lines = HI * D * kv_bytes;  // the item's heads in a token's row
    for (int64_t k0 = lo0; k0 < hi1; k0 += KT) {
      const int n = (int)min64(KT, hi1 - k0);
      for (int t = 0; t < n;) {  // block by block: one table read and division per block
        const int64_t pos = k0 + t, off = pos % bs, run = min64(n - t, bs - off);
        const int64_t r0w = (table[pos / bs] * bs + off) * Hkv * D;
        for (int64_t u = 0; u < run; ++u) base[t + u] = r0w + u * Hkv * D;
        t += (int)run;
      }
      // The next tile's K and V rows lie elsewhere in the pool: ask for them (into L2:
      // measured 1.2-1.5x faster decode than into L1, which the tile's own rows use), so
      // that long contexts stream instead of waiting block by block. Decode items (one query
      // row) ask a few lines at a time between their dot products (TilePrefetch); prompt
      // items, whose tiles are mostly cached, all at once, here. Block by block: one table
      // read and division per block.
      TilePrefetch pf;
      pf.k = static_cast<const char*>(a.k_cache);
      pf.v = static_cast<const char*>(a.v_cache);
      pf.rows = next_rows;
      pf.lines = (lines + 63) / 64;
      if (k0 + KT < hi1) {
        add_rows(pf, next_rows, b, k0 + KT, min64(hi1, k0 + 2 * KT), line0);
      } else if (next_idx >= 0) {
        const ItemKeys nk = item_keys(next_idx);  // the same heads per item: the same lines a row
        add_rows(pf, next_rows, nk.b, nk.lo, min64(nk.hi, nk.lo + KT), nk.h0 * D * kv_bytes);
      }
      if (R != 1 || a.amx) pf.finish();  // prompt items: all at once, the pumps below find none left
      for (int64_t hl = 0; hl < HI; ++hl) {
        for (int t = 0; t < n; ++t) rows[t] = base[t] + (h0 + hl) * D;
        const int64_t mh = hl * RG;  // this head's first vector
        if constexpr (fast) {
#ifdef TOKENMILL_BF16_DOT
          const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
#ifdef TOKENMILL_AMX_TILES
          if (a.amx) {
            if (configured < 0) { amx_attention_configure(); configured = 1; }
            for (int t0 = 0; t0 < n; t0 += 16) pack_keys16(kc, rows + t0, (int)min64(16, n - t0), D, P, kt + t0 * P);
            amx_scores(qw + mh * P, P, kt, fused ? 1.0f : dot_scale, (int)Mh, n, KT, sc + mh * KT);
          } else
#endif
          if (lanes) {
            for (int t0 = 0; t0 < n; t0 += 16)
              qk_lanes16(ql + hl * chunks * 16, chunks, kc, rows + t0, (int)min64(16, n - t0), (int)Mh,
                         fused ? 1.0f : dot_scale, sc + mh * KT + t0, KT, pf);
          } else {
            for (int t0 = 0; t0 < n; t0 += 16) pack_keys16(kc, rows + t0, (int)min64(16, n - t0), D, P, kt + t0 * P);
            for (int t0 = 0; t0 < n;) {
              const int groups = n - t0 > 16 ? 2 : 1;  // scores past n are computed, never read
              for (int64_t m0 = 0; m0 < Mh; m0 += 8)
                qk16_any((int)min64(8, Mh - m0), groups, qw + (mh + m0) * P, P, kt + t0 * P,
                         fused ? 1.0f : dot_scale, sc + (mh + m0) * KT + t0, KT, pf);
              t0 += 16 * groups;
            }
          }
#endif
        } else {
          for (int64_t m0 = 0; m0 < Mh; m0 += kPrefillScoreTile) {
            const int gn = (int)min64(kPrefillScoreTile, Mh - m0);
            score_block_wide<KF>(gn, a.k_cache, rows, n, D, qf + (mh + m0) * dp, dp, sc + (mh + m0) * KT, KT, pf);
          }
        }
#ifdef TOKENMILL_BF16_DOT
        if (fused) {
          const int nk = ((n + 1) / 2 + 15) / 16 * 32;  // whole tiles of 16 key pairs
          for (int64_t i = 0; i < Mh; ++i) {
            const int64_t m = mh + i;
            const auto [ta, te] = row_keys(first_pos + r0 + i / G, k0, n);
            softmax_row_bf16(sc + m * KT, ta, te, nk, dot_scale, mx[m], sm[m], acc + m * dp, dp,
                            reinterpret_cast<uint16_t*>(pw + m * (KT / 2)));
          }
        } else
#endif
        for (int64_t i = 0; i < Mh; ++i) {
          const int64_t m = mh + i;
          float* p = sc + m * KT;
          const auto [ta, te] = row_keys(first_pos + r0 + i / G, k0, n);
          for (int t = 0; t < ta; ++t) p[t] = 0.0f;
          for (int t = te; t < n; ++t) p[t] = 0.0f;
          if (ta == te) continue;
          Vec::R vmax = Vec::set1(-3.0e38f);
          for (int t = ta; t < te; t += Vec::W) {
            const int c = (int)min64(Vec::W, te - t);
            Vec::R v = Vec::load_f32(p + t, c);
            if (a.softcap > 0) v = softcap_vec(Vec::mul(v, Vec::set1(post_scale)), a.softcap);
            Vec::store_f32(p + t, v, c);
            vmax = Vec::max(vmax, Vec::load_masked_or(p + t, c, -3.0e38f));
          }
          const float tile_max = Vec::reduce_max(vmax);
          const float m_new = mx[m] > tile_max ? mx[m] : tile_max;
          const float alpha = __builtin_expf(mx[m] - m_new);
          const Vec::R vm = Vec::set1(m_new);
          Vec::R sum = Vec::zero();
          for (int t = ta; t < te; t += Vec::W) {
            const int c = (int)min64(Vec::W, te - t);
            Vec::store_f32(p + t, Vec::exp(Vec::sub(Vec::load_f32(p + t, c), vm)), c);
            sum = Vec::add(sum, Vec::load_f32(p + t, c));  // reload: the tail lanes read as 0
          }
          sm[m] = sm[m] * alpha + Vec::reduce_add(sum);
          mx[m] = m_new;
          if (alpha != 1.0f) {
            const Vec::R va = Vec::set1(alpha);
            float* o = acc + m * dp;
            for (int64_t j = 0; j < dp; j += Vec::W) Vec::store_f32(o + j, Vec::mul(Vec::load_f32(o + j, Vec::W), va), Vec::W);
          }
        }
        if constexpr (fast) {
#ifdef TOKENMILL_BF16_DOT
          pack_values(static_cast<const uint16_t*>(a.v_cache), rows, n, D, dp, vp);
          if (!fused)
            for (int64_t i = 0; i < Mh; ++i) pack_weights(sc + (mh + i) * KT, n, pw + (mh + i) * (KT / 2));
#ifdef TOKENMILL_AMX_TILES
          if (a.amx) {
            // Whole tiles of 16 key pairs: the pairs past the tile's keys are zero on both
            // sides (stale values could be NaN, and NaN x 0 is NaN).
            const int pairs = (n + 1) / 2, chunks = (pairs + 15) / 16;
            std::memset(vp + pairs * dp, 0, sizeof(uint32_t) * (chunks * 16 - pairs) * dp);
            if (!fused)
              for (int64_t i = 0; i < Mh; ++i)
                for (int w = pairs; w < chunks * 16; ++w) pw[(mh + i) * (KT / 2) + w] = 0;
            amx_pv_all(vp, chunks, dp, pw + mh * (KT / 2), KT / 2, acc + mh * dp, (int)Mh);
          } else
#endif
          for (int64_t m0 = 0; m0 < Mh; m0 += 4)
            pv_any((int)min64(4, Mh - m0), vp, (n + 1) / 2, dp, pw + (mh + m0) * (KT / 2), KT / 2,
                   acc + (mh + m0) * dp, pf);
#endif
        } else {
          for (int64_t m0 = 0; m0 < Mh; m0 += kHeadTile) {
            const int gn = (int)min64(kHeadTile, Mh - m0);
            accumulate_v_any<KF>(gn, a.v_cache, rows, n, D, sc + (mh + m0) * KT, KT, acc + (mh + m0) * dp, dp);
          }
        }
      }
      pf.finish();  // whatever the pumps left: the next tile is asked for in full
    }
    for (int64_t hl = 0; hl < HI; ++hl)
      for (int64_t i = 0; i < Mh; ++i) {
        const int64_t m = hl * RG + i, row = q0 + r0 + i / G, hq = (h0 + hl) * G + i % G;
        // A whole range sees at least each row's own key; a split's share may see none
        // (sum 0: its weight in the merge is 0).
        const Vec::R vi = Vec::set1(sm[m] > 0 ? a.v_scale / sm[m] : 0.0f);
        const int64_t slot = a.partial ? a.item_slot[idx] : 0;
        for (int64_t j = 0; j < D; j += Vec::W) {
          const Vec::R o = Vec::mul(Vec::load_f32(acc + m * dp + j, Vec::W), vi);
          if (a.partial) Vec::store_f32(a.partial + (slot * Hq + hq) * D + j, o, chunk(D, j));
          else st<QF>(a.out, (row * Hq + hq) * D + j, o, chunk(D, j));
        }
        if (a.partial) {
          a.partial_ml[2 * (slot * Hq + hq)] = mx[m];
          a.partial_ml[2 * (slot * Hq + hq) + 1] = sm[m];
        }
      }
  }
#ifdef TOKENMILL_AMX_TILES
  if (configured >= 0) _tile_release();
#endif
  std::free(qf);
  std::free(base);
}

template <int QF>
void prefill_for_q(const tokenmill::PrefillArgs& a, int64_t i0, int64_t i1) {
  switch (a.kv_fmt) {
    case tokenmill::F32: prefill_impl<QF, tokenmill::F32>(a, i0, i1); break;
    case tokenmill::BF16: prefill_impl<QF, tokenmill::BF16>(a, i0, i1); break;
    case tokenmill::E4M3: prefill_impl<QF, tokenmill::E4M3>(a, i0, i1); break;
    default: prefill_impl<QF, tokenmill::E5M2>(a, i0, i1); break;
  }
}

void prefill_attention_kernel(const tokenmill::PrefillArgs& a, int64_t i0, int64_t i1) {
  if (a.q_fmt == tokenmill::BF16) prefill_for_q<tokenmill::BF16>(a, i0, i1);
  else prefill_for_q<tokenmill::F32>(a, i0, i1);
}

}  // namespace
