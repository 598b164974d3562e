// AMX-INT8 GEMM for int8 and int4 weights: VPDPBUSD's math on 16x64 tiles (TDPBSSD, TDPBUSD), 16
// times the work per instruction, so quantized weights keep up with oneDNN's AMX bf16 at
// every batch size; and AMX-BF16 (TDPBF16PS) for bf16 weights in gemv_layout's blocks, whose
// 16 lines of 16 channels x 2 inputs are exactly a B tile (no second copy or layout). Tiles
// are only touched after the kernel granted the tile state (ops.cpp asks with arch_prctl);
// AMX is otherwise never executed.
#include <cstdint>
#include <cstdlib>

#pragma GCC target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c")
#include <immintrin.h>

#include "kernels.h"
#include "vec_avx512.h"
#include "activation.h"

namespace {

// Tiles: 0, 1 accumulators (two 16-channel blocks); 2 activations; 3, 4 weights.
void configure(int rows) {
  tokenmill::AmxTileConfig cfg;
  for (int t = 0; t < 3; ++t) { cfg.rows[t] = (uint8_t)rows; cfg.colsb[t] = 64; }
  for (int t = 3; t < 5; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

// int4 tile: 512 bytes, low nibbles the tile's first 512 codes, high nibbles the rest.
inline void unpack_int4(const uint8_t* p, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int i = 0; i < 512; i += 64) {
    __m512i v = _mm512_loadu_si512(p + i);
    _mm512_store_si512(out + i, _mm512_and_si512(v, low4));
    _mm512_store_si512(out + 512 + i, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

inline __mmask16 tail_mask(int64_t n0, int64_t N) {
  const int64_t left = N - n0;
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (left > 0 ? left : 0)) - 1u);
}

// int8: per 64-input chunk, signed x times signed weights (TDPBSSD), each chunk's int32
// sums stored to ``sums`` ([chunks][NB][16 rows][16]: the blocks' whole K, in L1/L2), then per
// row and block scaled by the row's chunk scales into one fp32 accumulator in a register,
// in chunk order, then the channel scales: the same integer sums and float steps as
// vnni.cpp's int8, so a row's outputs are the same on either and whatever the batch.
// (Scaling chunk by chunk into accumulators kept in memory cost more than the products.)
template <int NB>
void block_int8(const tokenmill::AmxArgs& a, int64_t nb, int64_t m0, int rows, int32_t* sums) {
  const int8_t* w = static_cast<const int8_t*>(a.w);
  const int64_t chunks = a.num_chunks;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    _tile_loadd(2, a.xq + m0 * a.ldq + kc * 64, a.ldq);
    _tile_loadd(3, w + (nb * chunks + kc) * 1024, 64);
    if (NB == 2) _tile_loadd(4, w + ((nb + 1) * chunks + kc) * 1024, 64);
    _tile_dpbssd(0, 2, 3);
    if (NB == 2) _tile_dpbssd(1, 2, 4);
    _tile_stored(0, sums + (kc * 2) * 256, 64);
    if (NB == 2) _tile_stored(1, sums + (kc * 2 + 1) * 256, 64);
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb + b) * 16;
    const __mmask16 mask = tail_mask(n0, a.N);
    const __m512 scale = _mm512_loadu_ps(a.scales + n0);
    for (int m = 0; m < rows; ++m) {
      const float* xs = a.x_group_scale + (m0 + m) * chunks;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t kc = 0; kc < chunks; ++kc)
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + (kc * 2 + b) * 256 + m * 16)),
                              _mm512_set1_ps(xs[kc]), acc);
      __m512 v = _mm512_mul_ps(acc, scale);
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + n0));
      if (a.yf)
        _mm512_mask_storeu_ps(a.yf + (m0 + m) * a.ldy + n0, mask, v);
      else
        _mm256_mask_storeu_epi16(a.y + (m0 + m) * a.ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// int4: x + 128 against the codes per group (TDPBUSD), minus 128 x the group's code sums,
// times the group's scale; the offsets through the activation sums at the end. Per-channel
// vectors are blocked [N/16, groups, 16] so each epilogue step is one load. The codes
// arrive unpacked to int8 tiles in ``panel`` (both blocks, every chunk), so row blocks after
// the first do not unpack again.
template <int NB>
void block_int4(const tokenmill::AmxArgs& a, int64_t nb, int64_t m0, int rows, int32_t (*c)[16][16],
                float (*acc)[16][16], const uint8_t* panel) {
  const int64_t chunks = a.num_chunks;
  const int64_t group_chunks = a.group_chunks;
  const __m512i k128 = _mm512_set1_epi32(128);
  for (int64_t g0 = 0; g0 < chunks; g0 += group_chunks) {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    const int64_t g1 = g0 + group_chunks < chunks ? g0 + group_chunks : chunks;
    for (int64_t kc = g0; kc < g1; ++kc) {
      _tile_loadd(2, a.xq + m0 * a.ldq + kc * 64, a.ldq);
      _tile_loadd(3, panel + kc * 1024, 64);
      if (NB == 2) _tile_loadd(4, panel + (chunks + kc) * 1024, 64);
      _tile_dpbusd(0, 2, 3);
      if (NB == 2) _tile_dpbusd(1, 2, 4);
    }
    _tile_stored(0, c[0], 64);
    if (NB == 2) _tile_stored(1, c[1], 64);
    const int64_t g = g0 / group_chunks;
    for (int b = 0; b < NB; ++b) {
      const int64_t at = ((nb + b) * a.num_groups + g) * 16;
      const __m512i sums = _mm512_mullo_epi32(_mm512_loadu_si512(a.wsum + at), k128);
      const __m512 scale = _mm512_loadu_ps(a.scales + at);
      for (int m = 0; m < rows; ++m) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c[b][m]), sums)), scale);
        if (g0 > 0) v = _mm512_add_ps(v, _mm512_load_ps(acc[b][m]));
        _mm512_store_ps(acc[b][m], v);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb + b) * 16;
    const __mmask16 mask = tail_mask(n0, a.N);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m) {
      const int64_t row = m0 + m;
      __m512 v = _mm512_fmadd_ps(_mm512_load_ps(acc[b][m]), _mm512_set1_ps(a.x_scale[row]), bias);
      const float* o = a.offsets + (nb + b) * a.num_groups * 16;
      const float* xs = a.xsum + row * a.num_groups;
      for (int64_t gg = 0; gg < a.num_groups; ++gg) v = _mm512_fmadd_ps(_mm512_loadu_ps(o + gg * 16), _mm512_set1_ps(xs[gg]), v);
      _mm256_mask_storeu_epi16(a.y + row * a.ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// bf16: C tiles 0-3 (row blocks 0, 1 x channel blocks 0, 1), A tiles 4, 5 (the two row
// blocks' 32 inputs), B tiles 6, 7 (each channel block's next 16 lines). ``rows0`` and
// ``rows1`` (0: no second row block) are the row blocks' heights.
void configure_bf16(int rows0, int rows1) {
  tokenmill::AmxTileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    if (rows[t] == 0) continue;
    cfg.rows[t] = (uint8_t)rows[t];
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Sums of row block(s) m0 (32 rows when RB == 2) against channel blocks nb0 (and nb1 when
// NB == 2) over inputs [k0, k1) (multiples of 32), added to C tiles 0-3 as they stand. After
// each step of 32 inputs, ``ep`` writes a few rows of the channel pair before (AVX-512 work
// between tile instructions: PairEpilogue says why).
template <int RB, int NB, class Epilogue>
void block_bf16(const tokenmill::GemmArgs& a, int64_t nb0, int64_t nb1, int64_t m0, int64_t k0, int64_t k1,
                Epilogue& ep) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const int64_t kp = a.K / 2;  // lines per block
  const uint16_t* x0 = a.x + m0 * a.ldx;
  const uint16_t* x1 = x0 + 16 * a.ldx;
  const uint16_t* w0 = w + nb0 * kp * 32;
  const uint16_t* w1 = w + nb1 * kp * 32;
  const int64_t stride = a.ldx * 2;
  for (int64_t k = k0; k < k1; k += 32) {
    _tile_loadd(6, w0 + k * 16, 64);
    if (NB == 2) _tile_loadd(7, w1 + k * 16, 64);
    _tile_loadd(4, x0 + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if (RB == 2) {
      _tile_loadd(5, x1 + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    ep.step();
  }
}

// The channel block paired with block nb: with a.act its up block, else the next one.
inline int64_t partner_block(const tokenmill::GemmArgs& a, int64_t nb) { return a.act ? nb + a.up_block : nb + 1; }

// One block of the output: its channel blocks (nb1: the second, where nbs == 2; with a.act
// the up half's block of the same channels as the gate's nb0), first row and row counts.
struct Bf16Block {
  int64_t nb0, nb1, m0;
  int rows0, rows1, nbs;
};

void store_tiles(const Bf16Block& b, float (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  if (b.nbs == 2) _tile_stored(1, c[1], 64);
  if (b.rows1) _tile_stored(2, c[2], 64);
  if (b.rows1 && b.nbs == 2) _tile_stored(3, c[3], 64);
}

// The partial sums store_tiles left, back in the C tiles (fp32 both ways: the same bits as
// sums never stored).
void load_tiles(const Bf16Block& b, float (*c)[16][16]) {
  _tile_loadd(0, c[0], 64);
  if (b.nbs == 2) _tile_loadd(1, c[1], 64);
  if (b.rows1) _tile_loadd(2, c[2], 64);
  if (b.rows1 && b.nbs == 2) _tile_loadd(3, c[3], 64);
}

void zero_tiles(const Bf16Block& b) {
  _tile_zero(0);
  if (b.nbs == 2) _tile_zero(1);
  if (b.rows1) _tile_zero(2);
  if (b.rows1 && b.nbs == 2) _tile_zero(3);
}

template <class Epilogue>
void block_bf16(const tokenmill::GemmArgs& a, const Bf16Block& b, int64_t k0, int64_t k1, Epilogue& ep) {
  if (b.rows1) {
    if (b.nbs == 2) block_bf16<2, 2>(a, b.nb0, b.nb1, b.m0, k0, k1, ep);
    else block_bf16<2, 1>(a, b.nb0, b.nb1, b.m0, k0, k1, ep);
  } else if (b.nbs == 2) {
    block_bf16<1, 2>(a, b.nb0, b.nb1, b.m0, k0, k1, ep);
  } else {
    block_bf16<1, 1>(a, b.nb0, b.nb1, b.m0, k0, k1, ep);
  }
}

__m512 load_bias(const tokenmill::GemmArgs& a, int64_t n0, __mmask16 mask) {
  return a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
}

// act(gate) * up for one row's 16 channels, as gemv_bf16 followed by silu_and_mul (or
// gelu_tanh_and_mul) computes it: both sums rounded to bf16 first, the activation rounded.
__m256i gated_bf16(int act, __m512 gate, __m512 up) {
  gate = Vec::round_bf16(gate);
  const __m512 s = Vec::round_bf16(act == tokenmill::kActSilu ? silu(gate) : gelu_tanh(gate));
  return Vec::to_bf16(Vec::mul(s, Vec::round_bf16(up)));
}

using Bf16Tiles = float[4][16][16];  // a 32-row block's sums: row blocks 0, 1 x channel blocks 0, 1

// Bias and the stores of a finished channel pair's outputs (bf16 or fp32, or with a.act the
// gated product of its gate and up blocks: 16 channels a row), from the pair's final sums
// (one Bf16Tiles a 32-row block), written a few rows at a time between the next pair's steps
// of 32 inputs. Written all at once after a block's products, the gated rows (an exp and a
// division per value: ~50 cycles a row of 16) outran what the out-of-order window holds of
// the tile work issued before them, so the tiles idled: on AMX Xeon, 1,024 rows x K 1,024,
// the [gate | up] projection with SiLU took 7.6-8.8 ms on 2 threads against 5.5 without the
// activation (and 0.9 for silu_and_mul alone). Between steps, each row's ~30-50 vector
// instructions run beside 4 tile products (64 cycles): 5.9-6.6 ms (medians of 60, three
// alternating runs against 6.7-7.6), the 250M model's 1,024-token prompt steps 0.86-0.93x.
// The sums and the order of operations on them are the same whenever the rows are written:
// the same bits.
struct PairEpilogue {
  const tokenmill::GemmArgs* a = nullptr;
  const Bf16Tiles* sums = nullptr;
  int64_t n0 = 0, n1 = 0, next = 0, end = 0;  // rows [next, end) are still to be written
  int64_t second = 0;  // Bf16Tiles from a gated group's first pair to its second
  int nbs = 0, pairs = 1, per_step = 1;
  __mmask16 mask0 = 0, mask1 = 0;
  __m512 bias0, bias1, bias2, bias3;
  bool stream = false;

  // The pair (block nb0 and its partner_block; nbs of them) whose final sums for rows
  // [0, a.M) are in sums, one Bf16Tiles a 32-row block; with a.act, pairs (1 or 2) gate
  // blocks nb0, nb0 + 1 and their up blocks, the second's sums a.M rows after the first's:
  // two are one 64-byte line of output a row, so that they can be streamed where a single
  // pair's half line cannot.
  void start(const tokenmill::GemmArgs& args, const Bf16Tiles* group_sums, int64_t nb0, int pair_blocks,
             int group_pairs) {
    a = &args;
    sums = group_sums;
    nbs = pair_blocks;
    pairs = group_pairs;
    second = (args.M + 31) / 32;
    n0 = nb0 * 16;
    n1 = partner_block(args, nb0) * 16;
    mask0 = tail_mask(n0, args.N);
    mask1 = nbs == 2 ? tail_mask(n1, args.N) : 0;
    bias0 = load_bias(args, n0, mask0);
    bias1 = nbs == 2 ? load_bias(args, n1, mask1) : bias0;
    if (pairs == 2) {
      bias2 = load_bias(args, n0 + 16, 0xFFFF);
      bias3 = load_bias(args, n1 + 16, 0xFFFF);
    }
    // A pair of whole blocks (adjacent without a.act), or two gated pairs, is one 64-byte
    // line a row where it starts on one: non-temporal where asked.
    stream = args.stream_out && n0 % 32 == 0 && (args.act ? pairs == 2 : nbs == 2 && mask1 == 0xFFFF);
    next = 0;
    end = args.M;
  }

  void row(int64_t i) {
    const tokenmill::GemmArgs& g = *a;
    const int r = (int)(i % 32) / 16, m = (int)(i % 16);
    const Bf16Tiles& c = sums[i / 32];
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c[r * 2][m]), bias0);
    if (g.act) {
      const __m512 up = _mm512_add_ps(_mm512_load_ps(c[r * 2 + 1][m]), bias1);
      const __m256i out = gated_bf16(g.act, v0, up);
      if (pairs == 1) {
        _mm256_storeu_si256((__m256i*)(g.y + i * g.ldy + n0), out);
        return;
      }
      const Bf16Tiles& c2 = sums[second + i / 32];
      const __m512 gate2 = _mm512_add_ps(_mm512_load_ps(c2[r * 2][m]), bias2);
      const __m512 up2 = _mm512_add_ps(_mm512_load_ps(c2[r * 2 + 1][m]), bias3);
      const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(out), gated_bf16(g.act, gate2, up2), 1);
      if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(g.y + i * g.ldy + n0), line);
      else _mm512_storeu_si512(g.y + i * g.ldy + n0, line);
      return;
    }
    if (stream) {
      const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c[r * 2 + 1][m]), bias1);
      const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(Vec::to_bf16(v0)), Vec::to_bf16(v1), 1);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(g.y + i * g.ldy + n0), line);
      return;
    }
    if (g.yf) _mm512_mask_storeu_ps(g.yf + i * g.ldy + n0, mask0, v0);
    else _mm256_mask_storeu_epi16(g.y + i * g.ldy + n0, mask0, Vec::to_bf16(v0));
    if (nbs < 2) return;
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c[r * 2 + 1][m]), bias1);
    if (g.yf) _mm512_mask_storeu_ps(g.yf + i * g.ldy + n1, mask1, v1);
    else _mm256_mask_storeu_epi16(g.y + i * g.ldy + n1, mask1, Vec::to_bf16(v1));
  }

  // Rows a step, so that the rows still to be written go out within ``steps`` steps (the
  // next pair's: K / 32 a row block).
  void pace(int64_t steps) { per_step = (int)((end - next + steps - 1) / steps); }

  // per_step rows (a step of 32 inputs), none once the pair is written.
  inline void step() {
    for (int left = per_step; left > 0 && next < end; --left) row(next++);
  }

  void finish() {
    while (next < end) row(next++);
  }
};

}  // namespace

// Inputs per pass over a channel pair's rows: the pair's 2 x 256 x 32 bytes of weights (16 KB)
// stay in L1 while every 32-row block of x passes them; each block's partial sums wait in
// memory (4 KB a block, in L1/L2) for the next pass. Over all K at once the pair's lines
// (64 KB at K = 1,024) came from L2 for every row block: AMX Xeon, one core, 256 rows, the
// bare loop at K = 1,024 ran 1.19-1.22 TFLOP/s over all K and 1.41-1.45 in passes of 256
// (128: 1.30-1.33, 512: 1.34-1.37); K = 576-2,816 gained 3-10%. The op on 2 threads gained
// less (3-7% at K = 1,024, where storing the outputs also costs ~20%), the 250M model's
// 1,024-token prompt steps 1-3%.
constexpr int64_t kBf16KPass = 256;

namespace {

// Row blocks a carried half holds: a call's rows (kAmxBf16MaxRows).
constexpr int64_t kCarryRowBlocks = tokenmill::kAmxBf16MaxRows / 32;

// A thread's pending outputs between its calls of amx_gemm_bf16. A call used to write its
// last group's outputs after its own tile products: with tasks of one group (2-4 channel
// blocks, ~64 KB of weights: ops_linear.cpp's grain at K >= 1,024), that was every group, so
// the epilogue PairEpilogue moves between tile steps never overlapped them. Now they wait
// here and the thread's next call writes them between its first pair's steps;
// amx_gemm_bf16_flush writes the thread's last when it has no more tasks. In one process
// against writing them at the end of each call (AMX Xeon, 2 threads): 1,024-token prompt
// steps 0.90x the time on the 250M model, 0.95-0.96x on SmolLM2 and Gemma 3. (Larger tasks
// overlap them too, but leave a slow thread's share to nobody.) The buffers (128 KB) are
// allocated once a thread, where each call had allocated its own.
struct Bf16Carry {
  Bf16Tiles* sums = nullptr;  // two halves of 2 * kCarryRowBlocks
  tokenmill::GemmArgs args[2];
  PairEpilogue ep;
  int half = 0;
  bool streamed = false;  // rows went out through non-temporal stores: fence before they are read
  ~Bf16Carry() { std::free(sums); }
};

thread_local Bf16Carry carry;

// Channel blocks [b0, b1) of a, in groups (a channel pair, or with a.act two gated pairs),
// every row, 32 at a time, in passes over K (`pass`). The rows are x's (ops_linear.cpp passes
// 256 at a time, so they stay in L2 too). Each group's sums go to one half of c.sums and its
// outputs are written by c.ep between the next group's tile steps; the last group's stay
// pending in c.ep (the group's arguments copied to c.args, as the caller's may be gone by
// then), as may a group of a call before, which this call's first pair writes.
void bf16_groups(const tokenmill::GemmArgs& a, int64_t b0, int64_t b1, Bf16Carry& c) {
  const int64_t row_blocks = (a.M + 31) / 32;
  // One row block (a decode batch of <= 32 rows) reuses no weights across blocks: one pass.
  const int64_t pass = row_blocks > 1 ? kBf16KPass : a.K;
  // Rows written a step: a group's rows within the next pair's steps (K / 32 a row block).
  const int64_t pair_steps = (a.K / 32) * row_blocks;
  PairEpilogue& ep = c.ep;
  ep.pace(pair_steps);
  int configured0 = -1, configured1 = -1;
  for (int64_t nb = b0; nb < b1;) {
    const int64_t first = nb;
    const int pairs = a.act && nb % 2 == 0 && nb + 2 <= b1 ? 2 : 1;
    const int nbs = a.act || nb + 2 <= b1 ? 2 : 1;
    Bf16Tiles* group = c.sums + c.half * 2 * kCarryRowBlocks;
    for (int p = 0; p < pairs; ++p, nb += a.act ? 1 : 2) {
      Bf16Tiles* pair = group + p * row_blocks;
      const int64_t partner = partner_block(a, nb);
      for (int64_t k0 = 0; k0 < a.K; k0 += pass) {
        const int64_t k1 = k0 + pass < a.K ? k0 + pass : a.K;
        for (int64_t m0 = 0; m0 < a.M; m0 += 32) {
          const int64_t left = a.M - m0;
          const int rows0 = (int)(left < 16 ? left : 16);
          const int rows1 = (int)(left <= 16 ? 0 : (left < 32 ? left - 16 : 16));
          if (rows0 != configured0 || rows1 != configured1) {
            configure_bf16(rows0, rows1);  // every block's sums are in memory between passes
            configured0 = rows0;
            configured1 = rows1;
          }
          const Bf16Block block{nb, partner, m0, rows0, rows1, nbs};
          if (k0 == 0) zero_tiles(block);
          else load_tiles(block, pair[m0 / 32]);
          block_bf16(a, block, k0, k1, ep);
          store_tiles(block, pair[m0 / 32]);
        }
      }
    }
    ep.finish();  // the group before (normally written by now): its half is the next group's
    c.args[c.half] = a;
    ep.start(c.args[c.half], group, first, nbs, pairs);
    ep.pace(pair_steps);
    c.half = 1 - c.half;
  }
  _tile_release();
}

}  // namespace

void tokenmill::amx_gemm_bf16_flush() {
  Bf16Carry& c = carry;
  c.ep.finish();
  if (c.streamed) {
    _mm_sfence();  // the non-temporal stores are seen before the outputs are read
    c.streamed = false;
  }
}

void tokenmill::amx_gemm_bf16(const GemmArgs& a, int64_t b0, int64_t b1) {
  Bf16Carry& c = carry;
  if (!c.sums) c.sums = static_cast<Bf16Tiles*>(std::aligned_alloc(64, 4 * kCarryRowBlocks * sizeof(Bf16Tiles)));
  bf16_groups(a, b0, b1, c);
  c.streamed = c.streamed || a.stream_out;
}

void tokenmill::amx_gemm(const AmxArgs& a, int64_t nb0, int64_t nb1) {
  alignas(64) int32_t c[2][16][16];
  alignas(64) float acc[2][16][16];
  uint8_t* panel = a.is_int4 ? static_cast<uint8_t*>(std::aligned_alloc(64, 2 * a.num_chunks * 1024)) : nullptr;
  int32_t* sums = a.is_int4 ? nullptr : static_cast<int32_t*>(std::aligned_alloc(64, 2 * a.num_chunks * 1024));
  int configured = -1;
  for (int64_t nb = nb0; nb < nb1; nb += 2) {  // weights stream once; activations stay in L1/L2
    if (panel) {
      const uint8_t* w = static_cast<const uint8_t*>(a.w);
      const int64_t blocks = nb + 2 <= nb1 ? 2 : 1;
      for (int64_t i = 0; i < blocks * a.num_chunks; ++i) unpack_int4(w + (nb * a.num_chunks + i) * 512, panel + i * 1024);
    }
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int rows = (int)(a.M - m0 < 16 ? a.M - m0 : 16);
      if (rows != configured) { configure(rows); configured = rows; }
      if (a.is_int4) {
        if (nb + 2 <= nb1) block_int4<2>(a, nb, m0, rows, c, acc, panel);
        else block_int4<1>(a, nb, m0, rows, c, acc, panel);
      } else if (nb + 2 <= nb1) {
        block_int8<2>(a, nb, m0, rows, sums);
      } else {
        block_int8<1>(a, nb, m0, rows, sums);
      }
    }
  }
  _tile_release();
  std::free(panel);
  std::free(sums);
}
