// tokenmill CPU kernels: argument blocks and the per-ISA kernel table.
//
// The kernel translation units (avx512.cpp, avx2.cpp) include no ATen header, so they
// compile in seconds; the op files (ops*.cpp) check tensors and split work across ATen's
// threads, and ops.cpp picks a table at run time from the CPU's features.
#pragma once
#include <cstdint>
#include <cstring>

namespace tokenmill {

// Activation / cache element formats the kernels read.
enum Fmt : int { F32 = 0, BF16 = 1, E4M3 = 2, E5M2 = 3 };

namespace {  // internal linkage: each translation unit compiles it for its own ISA

// One bf16 value (its 16 bits) as fp32, exactly.
inline float bf16_to_f32(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

struct GemmArgs {
  const uint16_t* x;    // [M, K] bf16, row stride ldx
  int64_t ldx, M, K;
  const void* w;        // bf16 [N, K], int8 [N, K] or packed int4 [N, K_pad / 2]
  int64_t ldw;          // elements (bf16/int8) or bytes (int4) per weight row
  const float* scales;  // int8: [N]; int4: [N, G]
  const float* zeros;   // int4: [N, G] offsets, the value of code 0 (w = q * scale + offset)
  float* xsum;    // int4: [M, G] sums of x over each group
  const uint16_t* scales_f16;   // int4 in channels of 8 (avx2_gemm_int4_x8): fp16 [N/8, G, 8]
  const uint16_t* offsets_f16;  // the same for the offsets
  int64_t group_size, num_groups;
  const float* bias;    // [N] or null
  // W8A8 (tables with quantize_rows): x quantized to int8, [M, ldq] bytes, zero-padded
  // to whole 64-byte chunks; signed (AMX's int4 tiles read x + 128, unsigned).
  uint8_t* xq;
  int64_t ldq;
  float* x_scale;       // [M]: one scale a row (unused where x_group_scale holds them)
  // int4 groups of 32 on a table with quantize_rows_g32: x quantized per row and group of 32,
  // each group its own scale, as llama.cpp's Q8 blocks are (x_scale is then 1): [M, G / 2, 8],
  // each 64-value chunk's two group scales as [low x4, high x4] (ops_linear.cpp, avx2.cpp).
  float* x_group_scale;
  // int8 weights on a table with int8_x_group: x quantized per row and group of x_group
  // inputs (quantize_rows with x_group set), its scales in x_group_scale [M, ldq / x_group]
  // (x_scale unused). 0: one scale a row.
  int64_t x_group;
  uint16_t* y;          // [M, N] bf16, row stride ldy
  int64_t ldy;
  int64_t N;            // gemv_bf16/f32: output channels (the last 16-channel block may be padding)
  const float* xf;      // gemv_f32: [M, K] fp32 rows (stride ldx) and [M, N] fp32 out (stride ldy)
  float* yf;
  // amx_gemm_bf16 on an MLP's fused [gate | up]: kActSilu or kActGeluTanh writes act(gate) * up
  // ([M, N / 2], what silu_and_mul or gelu_tanh_and_mul gives on the bf16 product), pairing
  // each gate block with block + up_block (N / 32) of the same channels. kActNone: y itself.
  int act;
  int64_t up_block;
  // amx_gemm_bf16's bf16 y in whole 64-byte lines with non-temporal stores (the op's output
  // is larger than L2: ops_linear.cpp's gemm sets it, where y's rows start on whole lines),
  // so that writing y takes no line reads.
  bool stream_out;
};

enum { kActNone = 0, kActSilu = 1, kActGeluTanh = 2 };

struct NormArgs {
  const void* x;        // [R, D]
  const void* residual; // [R, D] or null: normalise x + residual
  void* residual_out;   // [R, D]: x + residual (when residual is set)
  const void* weight;   // [D]
  void* out;            // [R, D]
  int64_t D, ldx, ldr;
  float eps;
  int fmt;              // F32 or BF16, for every tensor
  bool offset;          // Gemma: scale by 1 + weight in fp32, one rounding at the end
};

// A gated activation on a fused [gate | up]: act(gate) * up (SiLU, or GELU's tanh form).
struct ActMulArgs {
  const void* x;        // [R, 2D]: gate | up
  void* out;            // [R, D]
  int64_t D, ldx;
  int fmt;
};

struct RopeArgs {
  const void* q;        // [T, Hq, D] (token stride ldq)
  const void* k;        // [T, Hk, D]
  void* q_out;          // contiguous [T, Hq, D]
  void* k_out;
  const int64_t* positions;
  const float* cos;     // [P, D] (rotate-half layout, both halves)
  const float* sin;
  int64_t Hq, Hk, D, ldq, ldk;
  int fmt;
};

// RoPE fused with the KV-cache write: q rotated into rope.q_out; k rotated and v copied
// straight into their cache rows (the activation dtype), row dst_rows[t] of Hk * D
// elements (null: row t, for a scratch buffer when the cache stores another dtype).
struct RopeKvArgs {
  RopeArgs rope;            // rope.k_out unused
  const void* v;            // [T, Hk, D] (token stride ldv)
  int64_t ldv;
  void* k_dst;
  void* v_dst;              // null: V is not copied (ops_norm_rope.cpp converts it)
  const int64_t* dst_rows;  // [T] or null
};

// The merge after a split decode (ops_attention.cpp's paged_decode_attention runs decode as
// PrefillArgs' work items, one query row per sequence per item): sequence b combines the
// fp32 partial outputs [slots, Hq, D] and (max, sum) [slots, Hq, 2] of its key ranges'
// slots [seq_slots[b], seq_slots[b+1]) into out [B, Hq * D].
struct AttnArgs {
  void* out;
  int64_t Hq, D;
  int q_fmt;
  const float* partial;
  const float* partial_ml;
  const int64_t* seq_slots;
};

// Prefill attention: each sequence's queries are its last positions (a prompt chunk, after
// whatever it already has cached) and attend causally over its blocks, read in place.
struct PrefillArgs {
  const void* q;            // [N, Hq, D], row stride ldq: sequence b's rows [query_start[b], query_start[b+1])
  const void* k_cache;      // [blocks, block_size, Hkv, D]
  const void* v_cache;
  const int64_t* block_tables;  // [B, ldbt]
  const int64_t* context_lens;  // [B]: tokens in the cache, the chunk's own included
  const int64_t* query_start;   // [B + 1]
  void* out;                // [N, Hq * D]
  int64_t Hq, Hkv, D, block_size, ldq, ldbt;
  int64_t window;           // 0: full attention; else a key is seen from window - 1 positions back
  float scale, k_scale, v_scale;
  float softcap;
  int q_fmt, kv_fmt;
  // Work item i: sequence items[3i], KV heads [items[3i + 1], + heads_per_item), query rows
  // [items[3i + 2], + rows_per_item) of that sequence's.
  const int64_t* items;
  int64_t rows_per_item, heads_per_item;
  // Null: each item sees all its rows' keys and writes out. Else (split decode) item i sees
  // keys [item_keys[2i], item_keys[2i+1]) only and leaves its heads' fp32 partial outputs in
  // slot item_slot[i] of [slots, Hq, D] and (max, sum) [slots, Hq, 2] for attention_merge
  // (AttnArgs; a sequence's slots are consecutive, each written for every head).
  const int64_t* item_keys;
  const int64_t* item_slot;
  float* partial;
  float* partial_ml;
  // bf16 queries over a bf16 cache on AMX-BF16 tiles (the avx512 table; only where granted;
  // one KV head an item).
  bool amx;
  // Keys per softmax update: kDecodeKeyTile, kPrefillKeyTile or kAmxPrefillKeyTile (a
  // multiple of 64).
  int64_t key_tile;
  // Prompts: bf16 queries over a bf16 cache without a soft cap take prefill.h's one-pass
  // softmax_row_bf16 (1.03-1.09x on AVX-512-BF16, part of AMX's 1.3-1.8x). Decode keeps the
  // five-pass softmax: level in speed there, and its bits (verify's teacher-forced decode).
  bool one_pass_softmax;
  // Decode: the item this thread takes after the range it was given (-1: none known), whose
  // first key tile is asked for during the range's last tile (items in the range ask for
  // the one after them themselves).
  int64_t next_item = -1;
};

// The maxima of logits' row chunks, for argmax_rows (ops_sampling.cpp): task t is row
// t / chunks, columns [chunk * (t % chunks), + chunk) of it; max[t] is their largest value
// and nonfinite[t] 1 where one of them is a NaN or an infinity (the op then leaves the
// whole batch to torch, whose argmax orders NaN first).
struct RowMaxArgs {
  const float* x;  // [rows, ldx]
  int64_t ldx, cols, chunk, chunks;
  float* max;
  uint8_t* nonfinite;
};

struct KernelTable {
  const char* name;
  // Every function handles the half-open range [begin, end) of its parallel dimension:
  // output channels (gemm), rows (norm, gated activations), tokens (rope), sequences or work items.
  void (*gemm_bf16)(const GemmArgs&, int64_t, int64_t);
  void (*gemm_int8)(const GemmArgs&, int64_t, int64_t);
  void (*gemm_int4)(const GemmArgs&, int64_t, int64_t);
  void (*rms_norm)(const NormArgs&, int64_t, int64_t);
  void (*silu_mul)(const ActMulArgs&, int64_t, int64_t);
  void (*gelu_tanh_mul)(const ActMulArgs&, int64_t, int64_t);
  void (*rope)(const RopeArgs&, int64_t, int64_t);
  void (*attention_merge)(const AttnArgs&, int64_t, int64_t);    // sequences
  // Null where the int GEMMs read bf16 activations; else quantizes rows [begin, end) of
  // a.x into a.xq / a.x_scale (``is_unsigned``: store x + 128) before gemm_int8/int4 run.
  void (*quantize_rows)(const GemmArgs&, bool is_unsigned, int64_t, int64_t);
  void (*rope_kv)(const RopeKvArgs&, int64_t, int64_t);          // tokens
  void (*prefill_attention)(const PrefillArgs&, int64_t, int64_t);  // work items
  // bf16 weights in kernels/gemv_layout.py's blocks (16 channels x 32 inputs, 1 KB each,
  // block after block): whole 16-channel blocks [begin, end), every row of a.x.
  void (*gemv_bf16)(const GemmArgs&, int64_t, int64_t);
  // fp32 weights in kernels/gemv_layout.py's fp32 blocks (16 channels, one 64-byte line per
  // input), fp32 rows a.xf into a.yf: whole blocks [begin, end), every row.
  void (*gemv_f32)(const GemmArgs&, int64_t, int64_t);
  // Null where gemm_int4 reads groups of 32 (a GGUF file's Q4_0 / Q4_1 / Q4_K blocks) with
  // bf16 activations; else quantizes rows [begin, end) of a.x per group of 32 into a.xq,
  // a.x_group_scale and a.xsum (the per-group sums of the quantized values, scaled), in the
  // order that table's gemm_int4 reads them.
  void (*quantize_rows_g32)(const GemmArgs&, int64_t, int64_t);
  // Inputs per activation scale that gemm_int8 reads (GemmArgs::x_group), 0 for one scale a
  // row. One scale a row let a few large activations flatten the rest of the row: SmolLM2's
  // int8 top-1 agreement with fp32 was 88.5% against 94.0% with groups of 32
  // (benchmarks/int8_activation_groups.py). 64 on both tables (and the AMX / VNNI tiles).
  int64_t int8_x_group;
  void (*row_max)(const RowMaxArgs&, int64_t, int64_t);  // tasks (row, chunk)
};

// Keys per softmax update (PrefillArgs::key_tile). Each update costs every query vector a
// max, a sum, an exp of the old max and a rescale of its accumulators, and on AMX a store
// and reload of the scores around the tile unit: over 64 keys that per-row work was most of
// the AMX prompt kernel. vLLM's CPU attention sizes its key tile to L2 and so pays it about
// once a row; on AMX a 512-key tile (scores, weights and packed K/V of a 128-vector item,
// ~0.7 MB for head_dim 64, ~1 MB for 256, within a 2 MB L2) ran prompt attention 1.3-1.8x
// faster than 64 with the one-pass softmax (prefill.h's softmax_row_bf16), 256 the AVX-512
// BF16 dot products 1.05-1.09x (AVX2 1.03x). Decode keeps 64: one query row, and its
// prefetch of the next tile is tuned to it.
constexpr int64_t kAmxPrefillKeyTile = 512;
constexpr int64_t kPrefillKeyTile = 256;
constexpr int64_t kDecodeKeyTile = 64;

// Query rows per prefill work item for ``group`` query heads per KV head: whole rows, at
// most 16 query vectors (at least one row, whatever the group).
inline int64_t prefill_rows_per_item(int64_t group) { return group >= 16 ? 1 : 16 / group; }

// The same on AMX tiles (PrefillArgs::amx): up to kAmxPrefillVectors query vectors, so each
// tile of keys and values, packed once, serves several 16-row tiles of queries (128 ran a
// SmolLM2 layer's 1024-token prompt attention 1.05-1.1x faster than 64 at a 512-key tile).
constexpr int64_t kAmxPrefillVectors = 128;
inline int64_t prefill_rows_per_item_amx(int64_t group) {
  return group >= kAmxPrefillVectors ? 1 : kAmxPrefillVectors / group;
}

const KernelTable* avx512_kernels();
const KernelTable* avx2_kernels();

// int4 groups of 32 in kernels/int4_layout.py's pack_channels8 (8 output channels
// interleaved) against x quantized by the AVX2 table's quantize_rows_g32: blocks [begin, end)
// of 8 channels, every row; bf16 out. AVX2 code, whichever table is active (every CPU the
// extension runs on has AVX2); a.scales_f16 and a.offsets_f16 are blocked [blocks, G, 8], a.N the
// channels to store.
void avx2_gemm_int4_x8(const GemmArgs&, int64_t, int64_t);
// Where both int4_x8 kernels read x as quantize_rows_g32 writes it (per group of 32, each
// 64-value chunk's middle quarters swapped): inputs 8t..8t+7 of group g start at byte
// x8_offset(g, t) of the quantized row, and row m's group g scale is a.x_group_scale at
// x8_scale_index(m, chunks, g) (chunks: the row's 64-value chunks, a.ldq / 64).
inline int64_t x8_offset(int64_t g, int t) { return (g / 2) * 64 + (g % 2) * 16 + (t / 2) * 32 + (t % 2) * 8; }
inline int64_t x8_scale_index(int64_t m, int64_t chunks, int64_t g) { return (m * chunks + g / 2) * 8 + (g % 2) * 4; }
// avx2_gemm_int4_x8 with AVX-512 VNNI, over pairs [begin, end) of its 8-channel blocks (the
// last pair one block where their count is odd), the same bits; AVX-512 table only.
void avx512_gemm_int4_x8(const GemmArgs&, int64_t, int64_t);
// The same layout's blocks [begin, end) dequantized to rows [a.N, a.K] of fp32 yf or (yf null)
// bf16 yb, ldy values apart; a.w, a.scales_f16, a.offsets_f16, a.num_groups as above. With
// `blocks` (a.K % 32 == 0, [begin, end) whole pairs but the last): bf16 yb in
// kernels/gemv_layout.py's blocks instead, what gemv_bf16 multiplies; ldy unused.
void avx2_dequantize_int4_x8(const GemmArgs&, int64_t, int64_t, float* yf, uint16_t* yb, int64_t ldy, bool blocks);
// Its blocks for pairs [begin, end) of 8-channel blocks with AVX-512, the same bits; AVX-512
// table only.
void avx512_dequantize_int4_x8_blocks(const GemmArgs&, int64_t, int64_t, uint16_t* yb);

// quantize_int4_groups' operands: fp32 weight rows (ldw apart) in, per group of group_size
// (a multiple of 8, up to 256) codes 0..15 (int32 rows of K), scale and low end out.
struct Int4Fit {
  const float* w;
  int64_t ldw, K, group_size;
  bool half;  // parameters rounded to fp16 before the codes are chosen against them
  const double* levels;
  int64_t num_levels, rounds;
  int32_t* codes;
  float* scale;
  float* low;
};
// Rows [begin, end) of that fit: per group min-max's codes and, from the grid of each level's
// step count, `rounds` least-squares fits of scale and offset; the least squared error wins.
void avx2_fit_int4_groups(const Int4Fit&, int64_t, int64_t);

}  // namespace tokenmill

namespace tokenmill {

// AMX int8 tiles: weights prepacked at load into 16-channel x 64-input tiles in VNNI order
// (kernels/amx_layout.py); activations quantized as AmxArgs says per field (int8 signed per
// row and 64-input chunk; int4 per row, x + 128 on AMX).
struct AmxArgs {
  const uint8_t* xq;        // [M, ldq] with ldq = 64 * num_chunks
  const float* x_scale;     // int4: [M]
  // int8: x quantized to signed int8 per row and 64-input chunk (its own scale each, as
  // llama.cpp's Q8 blocks), so each chunk's integer sums are scaled into fp32 accumulators.
  const float* x_group_scale;  // int8: [M, num_chunks]
  const int32_t* x_chunk_sum;  // int8 on VNNI: [M, num_chunks] sums of the quantized x (undoes w + 128)
  int64_t M, ldq, num_chunks;
  const void* w;            // int8: [N/16, chunks, 16, 64]; int4: [N/16, chunks, 512] nibbles
  bool is_int4;
  int64_t group_chunks, num_groups;  // int4: 64-input chunks per group, groups per row
  // Per-channel values blocked by 16 channels (N padded to 16): int8 [N/16, 16], int4
  // [N/16, G, 16]; see amx_layout.block_channels.
  const float* scales;
  const int32_t* wsum;      // int4: code sums per group (int8 needs none)
  const float* offsets;     // int4 only
  const float* xsum;        // int4: [M, G]
  const float* bias;        // [N] or null
  uint16_t* y;              // [M, ldy] bf16
  int64_t N, ldy;
  float* yf;                // int8: [M, ldy] fp32 instead of y where set (an LM head's logits)
};

// LDTILECFG's 64-byte operand: palette 1, each tile's rows and bytes per row (zero: unused).
// amx.cpp's GEMMs and prefill.h's attention each configure their own tiles with it.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Output channels [16 * begin, 16 * end); only call when amx_permitted() said so.
void amx_gemm(const AmxArgs&, int64_t, int64_t);

// bf16 weights in kernels/gemv_layout.py's blocks on AMX-BF16 (TDPBF16PS): 16-channel blocks
// [begin, end), every row of a.x (bf16 out to a.y, or fp32 to a.yf); a.K a multiple of 32,
// a.M <= kAmxBf16MaxRows. Only call when amx_bf16_active() said so. The outputs of the call's
// last channel blocks may still be pending on the calling thread when it returns (the
// thread's next call writes them between its own tile steps): the thread calls
// amx_gemm_bf16_flush() before anything reads them, and a.y (a.yf) must live until then.
constexpr int64_t kAmxBf16MaxRows = 256;
void amx_gemm_bf16(const GemmArgs&, int64_t, int64_t);
void amx_gemm_bf16_flush();

// The same tiles on AVX-512 VNNI (vnni.cpp), for CPUs without AMX: blocks [begin, end).
// Both read a.xq as signed int8 (AMX's int4 reads it as u8, x + 128).
void vnni_gemm(const AmxArgs&, int64_t, int64_t);

}  // namespace tokenmill
