// AVX-512 VNNI GEMM for int8 and int4 weights in the AMX tile layout (kernels/amx_layout.py),
// for CPUs without AMX. A tile row is 16 output channels x 4 consecutive inputs, one 64-byte
// vector: VPDPBUSD multiplies it by 4 activation bytes broadcast to every lane and adds into
// 16 channel sums, so no horizontal reduction is ever needed (the row-major kernels in
// avx512.cpp end every output with one, and reread each weight row once per 4 activation
// rows). Here an MR x 4-block tile (MR rows, 64 channels) keeps MR * 4 accumulators (and as
// many fp32 ones) in registers; each weight vector is loaded once per MR rows and each activation broadcast
// feeds 4 dot products. One activation row is a GEMV: each 16-channel block (16 * K bytes,
// contiguous) is read in order, one stream per thread.
//
// int8: weights + 128 (u8: the sign bit flipped in registers) against signed activations
// with one scale a row and 64-input chunk, minus 128 x the chunk's activation sum. int4:
// codes u8 (0..15, unpacked in registers from the tile's nibbles) against signed
// activations, so no code sums are needed. Per group (int8: chunk) the integer sums are
// scaled into fp32 accumulators.
#include <cstdint>
#include <cstring>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")
#include <immintrin.h>

#include "kernels.h"

namespace {

using tokenmill::AmxArgs;

// Constant-trip loops unrolled before GCC decides where accumulators live (else it keeps
// them on the stack and stores all of them every iteration).
#define TM_UNROLL _Pragma("GCC unroll 16")

constexpr int kBlocks = 4;  // 16-channel blocks per tile: 64 channels

// VPDPBUSD through inline asm: GCC's builtin here copies every accumulator through another
// register (and the stack) around each dot product instead of updating it in place.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __mmask16 lanes(int64_t n0, int64_t N) {
  const int64_t left = N - n0;
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (left > 0 ? left : 0)) - 1u);
}

inline void store_row(const AmxArgs& a, int64_t row, int64_t n0, __m512 v) {
  const __mmask16 mask = lanes(n0, a.N);
  if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + n0));
  if (a.yf)  // int8 only (amx_linear): fp32 logits
    _mm512_mask_storeu_ps(a.yf + row * a.ldy + n0, mask, v);
  else
    _mm256_mask_storeu_epi16(a.y + row * a.ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// int8: rows [m0, m0 + MR) x blocks [nb, nb + NB). Per 64-input chunk (one activation
// scale a row): the weights + 128 (u8, a flipped sign bit) against signed x, started from
// -128 x the chunk's sum of x so each lane ends at the exact signed dot product; that
// converted and scaled by the row's chunk scale into fp32 accumulators, in chunk order
// (amx.cpp's block_int8 takes the same steps: the same outputs on either, whatever the batch).
template <int MR, int NB>
void tile_int8(const AmxArgs& a, int64_t nb, int64_t m0) {
  const int64_t ldb = a.num_chunks * 1024;  // bytes per 16-channel block
  const int8_t* w = static_cast<const int8_t*>(a.w) + nb * ldb;
  const uint8_t* x = a.xq + m0 * a.ldq;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 facc[MR][NB];
  TM_UNROLL
  for (int m = 0; m < MR; ++m)
    TM_UNROLL
    for (int b = 0; b < NB; ++b) facc[m][b] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < a.num_chunks; ++kc) {
    __m512i acc[MR][NB];
    TM_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(-128 * a.x_chunk_sum[(m0 + m) * a.num_chunks + kc]);
      TM_UNROLL
      for (int b = 0; b < NB; ++b) acc[m][b] = start;
    }
    for (int j = 0; j < 16; ++j) {
      __m512i wv[NB];
      TM_UNROLL
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_xor_si512(_mm512_loadu_si512(w + b * ldb + kc * 1024 + j * 64), flip);
      TM_UNROLL
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = bcast4(x + m * a.ldq + kc * 64 + j * 4);
        TM_UNROLL
        for (int b = 0; b < NB; ++b) acc[m][b] = dpbusd(acc[m][b], wv[b], xv);
      }
    }
    TM_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m512 xs = _mm512_set1_ps(a.x_group_scale[(m0 + m) * a.num_chunks + kc]);
      TM_UNROLL
      for (int b = 0; b < NB; ++b) facc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][b]), xs, facc[m][b]);
    }
  }
  TM_UNROLL
  for (int b = 0; b < NB; ++b) {
    const __m512 scale = _mm512_loadu_ps(a.scales + (nb + b) * 16);
    TM_UNROLL
    for (int m = 0; m < MR; ++m) store_row(a, m0 + m, (nb + b) * 16, _mm512_mul_ps(facc[m][b], scale));
  }
}

// int4: a chunk (64 inputs x 16 channels) is 512 bytes; byte j * 64 + i holds quad j's
// value i in its low nibble and quad j + 8's in its high nibble.
template <int MR, int NB>
void tile_int4(const AmxArgs& a, int64_t nb, int64_t m0) {
  const int64_t ldb = a.num_chunks * 512;
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + nb * ldb;
  const uint8_t* x = a.xq + m0 * a.ldq;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 facc[MR][NB];
  TM_UNROLL
  for (int m = 0; m < MR; ++m)
    TM_UNROLL
    for (int b = 0; b < NB; ++b) facc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512i acc[MR][NB];
    TM_UNROLL
    for (int m = 0; m < MR; ++m)
      TM_UNROLL
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_si512();
    for (int64_t kc = g * a.group_chunks; kc < (g + 1) * a.group_chunks; ++kc) {
      for (int j = 0; j < 8; ++j) {
        __m512i raw[NB], wv[NB];
        TM_UNROLL
        for (int b = 0; b < NB; ++b) {
          raw[b] = _mm512_loadu_si512(w + b * ldb + kc * 512 + j * 64);
          wv[b] = _mm512_and_si512(raw[b], low4);
        }
        TM_UNROLL
        for (int m = 0; m < MR; ++m) {
          const __m512i xv = bcast4(x + m * a.ldq + kc * 64 + j * 4);
          TM_UNROLL
          for (int b = 0; b < NB; ++b) acc[m][b] = dpbusd(acc[m][b], wv[b], xv);
        }
        TM_UNROLL
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_and_si512(_mm512_srli_epi16(raw[b], 4), low4);
        TM_UNROLL
        for (int m = 0; m < MR; ++m) {
          const __m512i xv = bcast4(x + m * a.ldq + kc * 64 + 32 + j * 4);
          TM_UNROLL
          for (int b = 0; b < NB; ++b) acc[m][b] = dpbusd(acc[m][b], wv[b], xv);
        }
      }
    }
    TM_UNROLL
    for (int b = 0; b < NB; ++b) {
      const __m512 scale = _mm512_loadu_ps(a.scales + ((nb + b) * a.num_groups + g) * 16);
      TM_UNROLL
      for (int m = 0; m < MR; ++m) facc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][b]), scale, facc[m][b]);
    }
  }
  TM_UNROLL
  for (int b = 0; b < NB; ++b) {
    const float* o = a.offsets + (nb + b) * a.num_groups * 16;
    TM_UNROLL
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      __m512 v = _mm512_mul_ps(facc[m][b], _mm512_set1_ps(a.x_scale[row]));
      const float* xs = a.xsum + row * a.num_groups;
      for (int64_t g = 0; g < a.num_groups; ++g) v = _mm512_fmadd_ps(_mm512_loadu_ps(o + g * 16), _mm512_set1_ps(xs[g]), v);
      store_row(a, row, (nb + b) * 16, v);
    }
  }
}

// One row, int8: block by block, one sequential read of each; per chunk four integer
// accumulators over interleaved quads (independent dependency chains), their exact sum then
// scaled as tile_int8 does.
void gemv_int8(const AmxArgs& a, int64_t nb0, int64_t nb1) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int8_t* w = static_cast<const int8_t*>(a.w) + nb * a.num_chunks * 1024;
    __m512 facc = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < a.num_chunks; ++kc) {
      __m512i acc[4] = {_mm512_set1_epi32(-128 * a.x_chunk_sum[kc]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                        _mm512_setzero_si512()};
      for (int64_t q = kc * 16; q < kc * 16 + 16; q += 4)
        TM_UNROLL
        for (int i = 0; i < 4; ++i)
          acc[i] = dpbusd(acc[i], _mm512_xor_si512(_mm512_loadu_si512(w + (q + i) * 64), flip), bcast4(a.xq + (q + i) * 4));
      const __m512i d = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
      facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(a.x_group_scale[kc]), facc);
    }
    store_row(a, 0, nb * 16, _mm512_mul_ps(facc, _mm512_loadu_ps(a.scales + nb * 16)));
  }
}

// Both keep a second (fp32) set of accumulators: at most 3 rows x 4 blocks in registers.
constexpr int kMaxRows = 3;

template <int NB>
void rows_int8(const AmxArgs& a, int64_t nb, int64_t m0, int mr) {
  switch (mr) {
    case 1: tile_int8<1, NB>(a, nb, m0); break;
    case 2: tile_int8<2, NB>(a, nb, m0); break;
    default: tile_int8<3, NB>(a, nb, m0); break;
  }
}

template <int NB>
void rows_int4(const AmxArgs& a, int64_t nb, int64_t m0, int mr) {
  switch (mr) {
    case 1: tile_int4<1, NB>(a, nb, m0); break;
    case 2: tile_int4<2, NB>(a, nb, m0); break;
    default: tile_int4<3, NB>(a, nb, m0); break;
  }
}

// Row tiles sized evenly: 16 rows are 6 + 5 + 5, not 6 + 6 + 4.
inline int tile_rows(int64_t left, int max_rows) {
  const int64_t tiles = (left + max_rows - 1) / max_rows;
  return (int)((left + tiles - 1) / tiles);
}

}  // namespace

void tokenmill::vnni_gemm(const AmxArgs& a, int64_t nb0, int64_t nb1) {
  if (a.M == 1 && !a.is_int4) { gemv_int8(a, nb0, nb1); return; }
  for (int64_t nb = nb0; nb < nb1; nb += kBlocks) {
    const int nbs = (int)(nb1 - nb < kBlocks ? nb1 - nb : kBlocks);
    for (int64_t m0 = 0; m0 < a.M;) {
      const int mr = tile_rows(a.M - m0, kMaxRows);
#define TM_BLOCKS(KIND)                                 \
  switch (nbs) {                                        \
    case 1: rows_##KIND<1>(a, nb, m0, mr); break;       \
    case 2: rows_##KIND<2>(a, nb, m0, mr); break;       \
    case 3: rows_##KIND<3>(a, nb, m0, mr); break;       \
    default: rows_##KIND<4>(a, nb, m0, mr); break;      \
  }
      if (a.is_int4) { TM_BLOCKS(int4) } else { TM_BLOCKS(int8) }
#undef TM_BLOCKS
      m0 += mr;
    }
  }
}
