// The projections' ops: bf16 and fp32 weights (row-major, or gemv_layout's packed blocks),
// int8 and int4 rows with activations quantized per row (W8A8) where the table does, and the
// AMX tile layout on AMX or AVX-512 VNNI.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

// bf16 outputs from this size on are written with non-temporal stores where the kernel can
// (GemmArgs::stream_out; amx_gemm_bf16 on whole lines). A line written in place is first read
// from L3 or memory, and those reads competed with the tiles' loads: storing the outputs cost
// ~20% of a 256 x 1,024 x 1,536 product on 2 threads (AMX Xeon), non-temporal ~10%. Below L2's
// size the next op finds the output in cache, which non-temporal stores would forfeit. The
// 250M model's 1,024-token prompt steps (two runs of 3 alternating pairs): the qkv, o and down
// projections 0.86-0.98x the time; the whole step 0.90-1.03x, inside this VM's drift.
constexpr int64_t kStreamOutBytes = 2 << 20;

// ``row_chunk`` > 0: the rows go in chunks of that many, each split over the threads in
// turn, so a chunk of x stays in each core's L2 while the weights pass. ``flush``: called on
// every thread after its last task (amx_gemm_bf16 leaves a task's last outputs to the next).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, GemmArgs args, int64_t N,
                const c10::optional<at::Tensor>& bias, int64_t grain,
                void (*fn)(const GemmArgs&, int64_t, int64_t), int64_t range = -1, bool f32 = false,
                bool f32_out = false, int64_t row_chunk = 0, void (*flush)() = nullptr) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == (f32 ? at::kFloat : at::kBFloat16), "tokenmill_cpu linear: x must be ",
              f32 ? "float32" : "bfloat16");
  const int64_t cols = args.act ? N / 2 : N;  // act(gate) * up: half the channels
  at::Tensor y = at::empty({x.size(0), cols}, x.options().dtype(f32 || f32_out ? at::kFloat : at::kBFloat16));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias has ", b.numel(), " elements, expected ", N);
    args.bias = b.data_ptr<float>();
  }
  if (f32) {  // fp32 rows in and out (gemv_f32)
    args.xf = x.data_ptr<float>();
    args.yf = y.data_ptr<float>();
  } else if (f32_out) {  // bf16 rows in, fp32 out (gemv_bf16_f32out: logits)
    args.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
    args.yf = y.data_ptr<float>();
  } else {
    args.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
    args.y = reinterpret_cast<uint16_t*>(y.data_ptr());
  }
  args.ldx = x.stride(0);
  args.M = x.size(0);
  args.K = x.size(1);
  args.w = w.data_ptr();
  args.ldy = cols;
  args.stream_out = args.y != nullptr && args.M * cols * 2 >= kStreamOutBytes &&
                    reinterpret_cast<uintptr_t>(args.y) % 64 == 0 && cols % 32 == 0;
  if (args.M == 0 || N == 0) return y;
  // The parallel dimension: output channels, or (range >= 0) the kernel's channel blocks.
  const int64_t M = args.M, chunk = row_chunk > 0 ? row_chunk : M;
  const int64_t width = range < 0 ? N : range, per_chunk = (width + grain - 1) / grain;
  const int64_t chunks = (M + chunk - 1) / chunk;
  auto rows = [&](int64_t r) {  // the arguments for row chunk r
    GemmArgs c = args;
    const int64_t r0 = r * chunk;
    c.M = std::min(chunk, M - r0);
    if (c.x) c.x += r0 * c.ldx;
    if (c.xf) c.xf += r0 * c.ldx;
    if (c.y) c.y += r0 * c.ldy;
    if (c.yf) c.yf += r0 * c.ldy;
    return c;
  };
  // One parallel region for every row chunk: tasks (row chunk, grain of the channels) in
  // row-chunk order, so the threads still share a chunk of x while they pass the weights,
  // where each chunk had a region of its own (a 1024-token prompt step: 16 a layer). A run
  // of tasks in one row chunk is one call (run inline, a whole chunk's channels). Engine
  // prompt steps, the two alternating in one process (AMX Xeon, 2 threads): 16 x 128 tokens
  // 0.95x the time on SmolLM2 (faster in 8 of 10 rounds) and 0.92x on the 250M Llama (6 of
  // 6); one 1024-token prompt and Gemma 3 level.
  parallel_chunks(
      chunks * per_chunk, 1,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1;) {
          const int64_t r = t / per_chunk, end = std::min(t1, (r + 1) * per_chunk);
          fn(rows(r), (t - r * per_chunk) * grain, std::min(width, (end - r * per_chunk) * grain));
          t = end;
        }
      },
      [flush] {
        if (flush) flush();
      });
  return y;
}

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_rows(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1), "linear_bf16: weight must be bfloat16 [N, K]");
  GemmArgs a{};
  a.ldw = w.stride(0);
  return gemm(x, w, a, w.size(0), bias, gemm_grain(x.size(1), 4), kernels().gemm_bf16);
}

// linear_bf16 with its fp32 sums returned unrounded (a tied LM head's logits, read from the
// embedding's row-major bf16 rows without a packed copy).
at::Tensor linear_bf16_f32out(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_rows(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1), "linear_bf16: weight must be bfloat16 [N, K]");
  GemmArgs a{};
  a.ldw = w.stride(0);
  return gemm(x, w, a, w.size(0), bias, gemm_grain(x.size(1), 4), kernels().gemm_bf16, -1, false, true);
}

namespace {

// Rows from which gemv_bf16 runs on AMX-BF16 tiles where the CPU has them.
constexpr int64_t kAmxBf16MinRows = 2;
// Rows per pass over the weights on AMX: 256 rows of x (at most 1 MB at K = 2048) stay in L2
// while every thread streams its blocks. All rows in one pass re-read x from L3 for each
// task: a 2,048-row prompt ran the tiles at 1.0-1.2 TFLOP/s against 1.7-2.1 at 256 rows
// (AMX Xeon, 2 threads, SmolLM2's projections).
constexpr int64_t kAmxBf16RowChunk = 256;
static_assert(kAmxBf16RowChunk <= kAmxBf16MaxRows, "amx_gemm_bf16 takes at most kAmxBf16MaxRows rows a call");

// bf16 weights packed by kernels/gemv_layout.py: [ceil(N/16), ceil(K/2), 16, 2]; bf16 out, or
// (f32_out) the fp32 sums unrounded: an LM head's logits, where bf16's 8 bits of mantissa turn
// close candidates into ties that greedy decoding then breaks by token id.
// ``path``: kAuto picks AMX-BF16 from kAmxBf16MinRows rows where it runs (and K is whole
// tiles), else the table's GEMV; kAmx insists on the tiles (tests of the kernel itself).
enum class Bf16Path { kAuto, kAmx };

// bf16 weights for N outputs of K inputs in kernels/gemv_layout.py's blocks, or `op`'s error.
void check_bf16_blocks(const at::Tensor& packed, int64_t N, int64_t K, const char* op) {
  const int64_t blocks = (N + 15) / 16, kp = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == blocks && packed.size(1) == kp && packed.size(2) == 16 && packed.size(3) == 2,
              op, ": weight must be bfloat16 blocks [", blocks, ", ", kp, ", 16, 2] (kernels.gemv_layout)");
}

at::Tensor gemv_bf16_out(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         bool f32_out, Bf16Path path = Bf16Path::kAuto) {
  check_rows(x, "x");
  const int64_t K = x.size(1), blocks = (N + 15) / 16, kp = (K + 1) / 2;
  check_bf16_blocks(packed, N, K, "gemv_bf16");
  GemmArgs a{};
  a.N = N;
  // Tasks of whole blocks, ~64 KB of weights or more: each thread streams one contiguous range.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kp * 64));
  // From kAmxBf16MinRows rows on (a batch or a prompt) the blocks go to AMX-BF16's tiles,
  // 16 x 16 x 32 products an instruction; fewer rows are bound by reading the weights, where
  // the GEMV's one pass over each block is as fast.
  if (path == Bf16Path::kAmx)
    TORCH_CHECK(amx_bf16_active() && K % 32 == 0, "gemv_bf16_amx: needs AMX-BF16 active and K a multiple of 32");
  if (path == Bf16Path::kAmx || (x.size(0) >= kAmxBf16MinRows && K % 32 == 0 && amx_bf16_active()))
    return gemm(x, packed, a, N, bias, (grain + 1) / 2 * 2, amx_gemm_bf16, blocks, /*f32=*/false, f32_out,
                kAmxBf16RowChunk, amx_gemm_bf16_flush);
  return gemm(x, packed, a, N, bias, grain, kernels().gemv_bf16, blocks, /*f32=*/false, f32_out);
}

}  // namespace

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  return gemv_bf16_out(x, packed, N, bias, false);
}

at::Tensor gemv_bf16_f32out(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  return gemv_bf16_out(x, packed, N, bias, true);
}

// An MLP's act(gate) * up from its fused [gate | up] projection: on AMX-BF16 (rows and K as
// gemv_bf16 takes the tiles, N / 2 whole blocks) in the GEMM's epilogue, so the [M, N]
// product is never written and read back; elsewhere gemv_bf16, then the activation op. Both
// give the same bits. act: "silu" or "gelu_tanh".
at::Tensor gemv_bf16_act(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         const std::string& act) {
  TORCH_CHECK(act == "silu" || act == "gelu_tanh", "gemv_bf16_act: act must be silu or gelu_tanh, got ", act);
  TORCH_CHECK(N % 2 == 0, "gemv_bf16_act: out_features must be even ([gate | up])");
  check_rows(x, "x");
  const int64_t K = x.size(1);
  if (x.size(0) >= kAmxBf16MinRows && K % 32 == 0 && N % 32 == 0 && amx_bf16_active()) {
    const int64_t blocks = (N + 15) / 16, kp = (K + 1) / 2;
    check_bf16_blocks(packed, N, K, "gemv_bf16_act");
    GemmArgs a{};
    a.N = N;
    a.act = act == "silu" ? kActSilu : kActGeluTanh;
    a.up_block = blocks / 2;
    // One task: an even number of gate blocks and their up blocks, ~64 KB or more (two gate
    // blocks' outputs are one line a row: amx_gemm_bf16 writes them together).
    const int64_t grain = (std::max<int64_t>(1, 65536 / (kp * 64) / 2) + 1) / 2 * 2;
    return gemm(x, packed, a, N, bias, grain, amx_gemm_bf16, blocks / 2, /*f32=*/false, false, kAmxBf16RowChunk,
                amx_gemm_bf16_flush);
  }
  const at::Tensor y = gemv_bf16_out(x, packed, N, bias, false);
  return act == "silu" ? silu_and_mul(y) : gelu_tanh_and_mul(y);
}

// gemv_bf16 on the AMX-BF16 tiles at any row count (an error where they do not run).
at::Tensor gemv_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         bool f32_out) {
  return gemv_bf16_out(x, packed, N, bias, f32_out, Bf16Path::kAmx);
}

// fp32 weights packed by kernels/gemv_layout.py's pack_f32: [ceil(N/16), K, 16], fp32 rows in
// and out (the same blocks-per-thread split as gemv_bf16).
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  const int64_t K = x.size(1), blocks = (N + 15) / 16;
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == K && packed.size(2) == 16,
              "gemv_f32: weight must be float32 blocks [", blocks, ", ", K, ", 16] (kernels.gemv_layout)");
  GemmArgs a{};
  a.N = N;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * 64));  // ~64 KB a task
  return gemm(x, packed, a, N, bias, grain, kernels().gemv_f32, blocks, /*f32=*/true);
}

namespace {

// Tables with quantize_rows read int8 activations (W8A8): x is quantized first, per row
// (xs [M] in a.x_scale) or, with a.x_group set, per group of a row (xs [M, ldq / x_group] in
// a.x_group_scale).
void quantize_activations(const at::Tensor& x, GemmArgs& a, bool is_unsigned, at::Tensor& xq, at::Tensor& xs,
                          int64_t ldq = 0) {
  const KernelTable& k = kernels();
  if (!k.quantize_rows) return;
  const int64_t M = x.size(0);
  a.ldq = std::max(ldq, (x.size(1) + 63) / 64 * 64);
  xq = at::empty({M, a.ldq}, x.options().dtype(at::kByte));
  xs = at::empty({M, a.x_group > 0 ? a.ldq / a.x_group : 1}, x.options().dtype(at::kFloat));
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = x.stride(0);
  a.K = x.size(1);
  a.xq = xq.data_ptr<uint8_t>();
  (a.x_group > 0 ? a.x_group_scale : a.x_scale) = xs.data_ptr<float>();
  parallel_chunks(M, rows_grain(x.size(1)), [&](int64_t r0, int64_t r1) { k.quantize_rows(a, is_unsigned, r0, r1); });
}

// x quantized per row and group of 32 by table k (quantize_rows_g32), into xq [M, a.ldq] and
// the group scales xg [M, a.ldq / 64, 8], for the int4 kernels of groups of 32; a.x, a.ldx,
// a.K, a.ldq, a.num_groups and a.xsum set by the caller.
void quantize_groups_of_32(const at::Tensor& x, GemmArgs& a, const KernelTable& k, at::Tensor& xq, at::Tensor& xg) {
  const int64_t M = x.size(0);
  xq = at::empty({M, a.ldq}, x.options().dtype(at::kByte));
  xg = at::empty({M, a.ldq / 64, 8}, x.options().dtype(at::kFloat));
  a.xq = xq.data_ptr<uint8_t>();
  a.x_group_scale = xg.data_ptr<float>();
  parallel_chunks(M, rows_grain(a.K), [&](int64_t r0, int64_t r1) { k.quantize_rows_g32(a, r0, r1); });
}

at::Tensor linear_int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                            const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, bool f32_out) {
  check_rows(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.size(1) == x.size(1), "linear_int8: weight must be int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0),
              "linear_int8: scales must be float32 [N]");
  GemmArgs a{};
  a.ldw = w.stride(0);
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == w.size(0),
              "linear_int8: wsum must be int32 [N], the sum of each weight row");
  a.scales = scales.data_ptr<float>();
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  at::Tensor xq, xs;
  const KernelTable& k = kernels();
  a.x_group = k.int8_x_group;  // 0: one scale a row
  quantize_activations(x, a, /*is_unsigned=*/false, xq, xs);
  return gemm(x, w, a, w.size(0), bias, gemm_grain(x.size(1), 2), k.gemm_int8, -1, false, f32_out);
}

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& wsum, const c10::optional<at::Tensor>& bias) {
  return linear_int8_rows(x, w, scales, wsum, bias, false);
}

// The same product with fp32 outputs: an int8 LM head's logits, unrounded.
at::Tensor linear_int8_f32out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                              const at::Tensor& wsum, const c10::optional<at::Tensor>& bias) {
  return linear_int8_rows(x, w, scales, wsum, bias, true);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  check_rows(w, "weight");
  const int64_t N = w.size(0), K = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) * 2 >= K && w.size(1) % 32 == 0,
              "linear_int4: weight must be uint8 [N, K_pad / 2] with K_pad a multiple of 64 >= K");
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0, "linear_int4: group_size must be a multiple of 32");
  const int64_t G = (w.size(1) * 2 + group_size - 1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N && scales.size(1) == G &&
                  zeros.scalar_type() == at::kFloat && zeros.is_contiguous() && zeros.sizes() == scales.sizes(),
              "linear_int4: scales and zeros must be float32 [N, ", G, "]");
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  const int64_t M = x.size(0), ldx = x.stride(0);
  at::Tensor xsum = at::empty({M, G}, x.options().dtype(at::kFloat));
  GemmArgs a{};
  a.ldw = w.stride(0);
  a.scales = scales.data_ptr<float>();
  a.zeros = zeros.data_ptr<float>();
  a.xsum = xsum.data_ptr<float>();
  a.group_size = group_size;
  a.num_groups = G;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = ldx;
  a.K = K;
  at::Tensor xq, xs;
  const KernelTable& k = kernels();
  if (group_size == 32 && k.quantize_rows_g32) {
    // Groups of 32 (GGUF's Q4 blocks): x quantized per row and group of 32, each with its own
    // scale, as llama.cpp's Q8 blocks are, and the offsets' share summed from those quantized
    // values, so the product is exactly sum(w * x_q). One scale a row let a few large
    // activations flatten the rest (SmolLM2 Q4_1: top-1 agreement with fp32 72%), and the
    // exact sums added offset * sum(x - x_q), offsets being ~-8 weight scales.
    a.ldq = w.size(1) * 2;  // codes padded to whole chunks: the quantized rows too
    xs = at::ones({M}, x.options().dtype(at::kFloat));
    a.x_scale = xs.data_ptr<float>();
    at::Tensor xg;
    quantize_groups_of_32(x, a, k, xq, xg);
    return gemm(x, w, a, N, bias, gemm_grain(K, 1), k.gemm_int4);
  }
  // Sum of the activations over each group: the offsets' share of every output (a plain
  // loop: the ATen ops it replaces cost ~15 us a call, more than a one-row product's kernel).
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* xs_out = xsum.data_ptr<float>();
  parallel_chunks(M, rows_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int64_t kk = g * group_size; kk < std::min(K, (g + 1) * group_size); ++kk) {
          s += bf16_to_f32(xb[r * ldx + kk]);
        }
        xs_out[r * G + g] = s;
      }
  });
  if (group_size % 64 == 0) quantize_activations(x, a, /*is_unsigned=*/false, xq, xs, w.size(1) * 2);
  return gemm(x, w, a, N, bias, gemm_grain(K, 1), kernels().gemm_int4);
}

namespace {

// packed uint8 [blocks, G, 128] (int4_layout.pack_channels8), scales and offsets fp16
// [blocks, G, 8], G even (whole 64-input chunks, as quantize_rows_g32 writes x), checked;
// the kernel arguments they give (w, scales_f16, offsets_f16, num_groups, N, K).
GemmArgs int4_x8_args(const char* op, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                      int64_t out_features, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(2) == 128 &&
                  w.size(1) % 2 == 0 && w.size(1) * 32 >= K && w.size(0) * 8 >= out_features &&
                  (w.size(0) - 1) * 8 < out_features,
              op, ": weight must be uint8 [ceil(N / 8), G, 128] with G even and 32 * G >= K (int4_layout.pack_channels8)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == w.size(0) && scales.size(1) == w.size(1) && scales.size(2) == 8 &&
                  offsets.scalar_type() == at::kHalf && offsets.is_contiguous() && offsets.sizes() == scales.sizes(),
              op, ": scales and offsets must be float16 [", w.size(0), ", ", w.size(1), ", 8]");
  GemmArgs a{};
  a.w = w.data_ptr();
  a.scales_f16 = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  a.offsets_f16 = reinterpret_cast<const uint16_t*>(offsets.data_ptr());
  a.num_groups = w.size(1);
  a.N = out_features;
  a.K = K;
  return a;
}

}  // namespace

// int4 groups of 32 with 8 output channels interleaved (avx2_gemm_int4_x8), x quantized per
// group of 32 as linear_int4's groups of 32 are: AVX2 code whichever table is active.
at::Tensor linear_int4_x8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const at::Tensor& offsets, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  const int64_t K = x.size(1), M = x.size(0), G = w.size(1);
  GemmArgs a = int4_x8_args("linear_int4_x8", w, scales, offsets, out_features, K);
  a.group_size = 32;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = x.stride(0);
  a.ldq = G * 32;
  at::Tensor xsum = at::empty({M, G}, x.options().dtype(at::kFloat)), xq, xg;
  a.xsum = xsum.data_ptr<float>();
  quantize_groups_of_32(x, a, *avx2_kernels(), xq, xg);
  // Tasks of whole blocks, ~64 KB of codes, scales and offsets or more (on AVX-512, of
  // whole pairs of blocks: 16 channels a vector).
  const int64_t grain = std::max<int64_t>(1, 65536 / (G * 160));
  if (&kernels() == avx512_kernels())
    return gemm(x, w, a, out_features, bias, (grain + 1) / 2, avx512_gemm_int4_x8, (w.size(0) + 1) / 2);
  return gemm(x, w, a, out_features, bias, grain, avx2_gemm_int4_x8, w.size(0));
}

// linear_int4_x8's weight as rows [out_features, in_features]: fp32 (dequantize_int4's use),
// or with bf16 set rounded to bfloat16 in the same pass (a prefill chunk's AMX-BF16 GEMM,
// which then reads half the bytes and skips a separate conversion).
at::Tensor dequantize_int4_x8(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                              int64_t out_features, int64_t in_features, bool bf16) {
  const int64_t K = in_features, N = out_features;
  const GemmArgs a = int4_x8_args("dequantize_int4_x8", w, scales, offsets, N, K);
  TORCH_CHECK(K > 0, "dequantize_int4_x8: in_features must be positive");
  at::Tensor out = at::empty({N, K}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  float* yf = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  parallel_chunks(w.size(0), std::max<int64_t>(1, rows_grain(K) / 8),
                  [&](int64_t b0, int64_t b1) { avx2_dequantize_int4_x8(a, b0, b1, yf, yb, K, false); });
  return out;
}

at::Tensor dequantize_int4_x8_blocks(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                                     int64_t out_features, int64_t in_features) {
  const int64_t K = in_features, N = out_features;
  const GemmArgs a = int4_x8_args("dequantize_int4_x8_blocks", w, scales, offsets, N, K);
  TORCH_CHECK(K > 0 && K % 32 == 0, "dequantize_int4_x8_blocks: in_features must be a positive multiple of 32");
  const auto opts = w.options().dtype(at::kBFloat16);
  at::Tensor out = (w.size(0) % 2) ? at::zeros({(N + 15) / 16, K / 2, 16, 2}, opts) : at::empty({(N + 15) / 16, K / 2, 16, 2}, opts);
  uint16_t* yb = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool avx512 = &kernels() == avx512_kernels();
  parallel_chunks((w.size(0) + 1) / 2, std::max<int64_t>(1, rows_grain(K) / 16), [&](int64_t p0, int64_t p1) {
    if (avx512) avx512_dequantize_int4_x8_blocks(a, p0, p1, yb);
    else avx2_dequantize_int4_x8(a, 2 * p0, std::min<int64_t>(2 * p1, w.size(0)), nullptr, yb, 0, true);
  });
  return out;
}

// int4 groups fitted at load (quant_int4._fitted_groups is the same in torch ops, the
// reference): per group of group_size weights, min-max's codes, then for each step count
// in levels the codes of that grid and `rounds` least-squares fits of scale and offset,
// each re-choosing the codes; the least squared error wins. One pass over the weight with
// the group in L1 (avx2_fit_int4_groups), where the torch version makes some 60 passes over it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int4_groups(const at::Tensor& weight, int64_t group_size,
                                                                    bool half, at::ArrayRef<double> levels,
                                                                    int64_t rounds) {
  check_rows(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "quantize_int4_groups: weight must be float32");
  TORCH_CHECK(group_size > 0 && group_size <= 256 && group_size % 8 == 0 && weight.size(1) % group_size == 0,
              "quantize_int4_groups: in_features ", weight.size(1), " must be a multiple of group_size ",
              group_size, " (a multiple of 8, up to 256)");
  const int64_t rows = weight.size(0), K = weight.size(1), G = K / group_size;
  at::Tensor codes = at::empty({rows, K}, weight.options().dtype(at::kInt));
  at::Tensor scale = at::empty({rows, G, 1}, weight.options());
  at::Tensor low = at::empty({rows, G, 1}, weight.options());
  const std::vector<double> steps(levels.begin(), levels.end());
  Int4Fit fit{};
  fit.w = weight.data_ptr<float>();
  fit.ldw = weight.stride(0);
  fit.K = K;
  fit.group_size = group_size;
  fit.half = half;
  fit.levels = steps.data();
  fit.num_levels = static_cast<int64_t>(steps.size());
  fit.rounds = rounds;
  fit.codes = codes.data_ptr<int32_t>();
  fit.scale = scale.data_ptr<float>();
  fit.low = low.data_ptr<float>();
  parallel_chunks(rows, rows_grain(K), [&](int64_t r0, int64_t r1) { avx2_fit_int4_groups(fit, r0, r1); });
  return {codes, scale, low};
}

// The int4 codes dequantized to fp32 rows [N, in_features] (w = q * scale + offset per
// group): a prefill chunk's product then runs as one fp32 GEMM (torch's, oneDNN/MKL), which
// on the AVX2 EPYC reads 150-170 GFLOP/s at 128-2048 rows where the int4 tiles read 55-80
// (benchmarks/int4_prefill.py). Plain loops the compiler vectorizes; each thread writes whole rows.
at::Tensor dequantize_int4(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                           int64_t group_size, int64_t in_features) {
  check_rows(w, "weight");
  const int64_t N = w.size(0), K = in_features;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) % 32 == 0 && w.size(1) * 2 >= K && K > 0,
              "dequantize_int4: weight must be uint8 [N, K_pad / 2] with K_pad a multiple of 64 >= in_features");
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0, "dequantize_int4: group_size must be a multiple of 32");
  const int64_t G = (w.size(1) * 2 + group_size - 1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N &&
                  scales.size(1) == G && offsets.scalar_type() == at::kFloat && offsets.is_contiguous() &&
                  offsets.sizes() == scales.sizes(),
              "dequantize_int4: scales and offsets must be float32 [N, ", G, "]");
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* codes = w.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* off = offsets.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t ldw = w.stride(0), chunks = (K + 63) / 64;
  parallel_chunks(N, rows_grain(K), [&](int64_t n0, int64_t n1) {
    float row[64];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t c = 0; c < chunks; ++c) {  // 64 codes: low nibbles the first 32, high the next 32
        const uint8_t* b = codes + n * ldw + c * 32;
        const int64_t g_lo = c * 64 / group_size, g_hi = (c * 64 + 32) / group_size;
        const float s_lo = sc[n * G + g_lo], o_lo = off[n * G + g_lo];
        const float s_hi = sc[n * G + g_hi], o_hi = off[n * G + g_hi];
        for (int j = 0; j < 32; ++j) row[j] = (float)(b[j] & 15) * s_lo + o_lo;
        for (int j = 0; j < 32; ++j) row[32 + j] = (float)(b[j] >> 4) * s_hi + o_hi;
        const int64_t k0 = c * 64, n_k = std::min<int64_t>(64, K - k0);
        std::copy(row, row + n_k, y + n * K + k0);
      }
    }
  });
  return out;
}

namespace {

// AMX: weights in tiles [N/16, chunks, 16, 64] (int8) or [N/16, chunks, 512] (int4 nibbles).
// ``vnni``: the same tiles through vnni_gemm on the AVX-512 table (no AMX needed).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, AmxArgs a, const c10::optional<at::Tensor>& bias,
                      bool vnni = false, bool f32_out = false) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  TORCH_CHECK(!(f32_out && a.is_int4), "amx linear: fp32 outputs are int8's only");
  if (vnni) {
    TORCH_CHECK(active() == avx512_kernels(), "tokenmill_cpu: the VNNI kernels need the avx512 table");
  } else {
    TORCH_CHECK(amx_active(), "tokenmill_cpu: the AMX kernels are not active in this process");
  }
  TORCH_CHECK(tiles.is_contiguous() && tiles.dim() >= 3 && tiles.size(0) * 16 >= a.N && tiles.size(1) * 64 >= x.size(1),
              "amx linear: weight tiles do not cover [", a.N, ", ", x.size(1), "]");
  const int64_t M = x.size(0);
  a.num_chunks = tiles.size(1);
  // One int8 row on AMX goes to VNNI's GEMV instead (the same outputs, bit for bit): it
  // streams each block once, where a 16-row tile holding one row stores its sums per chunk.
  vnni = vnni || (!a.is_int4 && M == 1);
  GemmArgs q{};
  at::Tensor xq, xs, xsum;
  // int8: signed x, a scale per row and chunk (AMX's signed x signed product; VNNI's u8 side
  // is the weight + 128, undone with the chunk sums of x). int4: a scale a row; AMX reads
  // x + 128 against the codes (undone with the code sums), VNNI the codes against signed x.
  q.x_group = a.is_int4 ? 0 : 64;
  quantize_activations(x, q, /*is_unsigned=*/a.is_int4 && !vnni, xq, xs, a.num_chunks * 64);
  a.xq = q.xq;
  a.x_scale = q.x_scale;
  a.x_group_scale = q.x_group_scale;
  a.ldq = q.ldq;
  if (vnni && !a.is_int4) {  // each chunk's sum of the quantized x (a loop: no op dispatched per call)
    xsum = at::empty({M, a.num_chunks}, x.options().dtype(at::kInt));
    int32_t* s = xsum.data_ptr<int32_t>();
    const int8_t* xs8 = reinterpret_cast<const int8_t*>(q.xq);
    for (int64_t c = 0; c < M * a.num_chunks; ++c) {
      int32_t sum = 0;
      for (int i = 0; i < 64; ++i) sum += xs8[c * 64 + i];
      s[c] = sum;
    }
    a.x_chunk_sum = s;
  }
  a.M = M;
  a.w = tiles.data_ptr();
  at::Tensor y = at::empty({M, a.N}, x.options().dtype(f32_out ? at::kFloat : at::kBFloat16));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == a.N, "bias has ", b.numel(), " elements, expected ", a.N);
    a.bias = b.data_ptr<float>();
  }
  if (f32_out) a.yf = y.data_ptr<float>();
  else a.y = reinterpret_cast<uint16_t*>(y.data_ptr());
  a.ldy = a.N;
  if (M == 0) return y;
  const int64_t blocks = (a.N + 15) / 16;
  if (vnni) {  // whole 4-block (64-channel) tiles per task
    parallel_chunks((blocks + 3) / 4, 1, [&](int64_t p0, int64_t p1) {
      vnni_gemm(a, 4 * p0, std::min(blocks, 4 * p1));
    });
    return y;
  }
  parallel_chunks((blocks + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    amx_gemm(a, 2 * p0, std::min(blocks, 2 * p1));
  });
  return y;
}

}  // namespace

at::Tensor int8_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor& wsum,
                      const c10::optional<at::Tensor>& bias, int64_t out_features, bool vnni, bool f32_out) {
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.dim() == 4, "linear_int8_amx: int8 tiles [N/16, chunks, 16, 64]");
  const int64_t N = out_features;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && wsum.scalar_type() == at::kInt &&
                  wsum.is_contiguous() && scales.numel() == tiles.size(0) * 16 && wsum.numel() == scales.numel(),
              "linear_int8_amx: float32 scales and int32 row sums blocked [N/16, 16]");
  AmxArgs a{};
  a.N = N;
  a.scales = scales.data_ptr<float>();  // (wsum: checked for the op's schema, not read)
  return amx_linear(x, tiles, a, bias, vnni, f32_out);
}

at::Tensor int4_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                      const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, int64_t out_features, bool vnni) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.size(2) == 512,
              "linear_int4_amx: uint8 tiles [N/16, chunks, 512]");
  TORCH_CHECK(group_size % 64 == 0, "linear_int4_amx: group_size must be a multiple of 64");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles.size(0) && scales.size(2) == 16,
              "linear_int4_amx: scales blocked [N/16, groups, 16]");
  const int64_t N = out_features, G = scales.size(1), K = x.size(1);
  TORCH_CHECK(G * group_size == tiles.size(1) * 64, "linear_int4_amx: ", G, " groups of ", group_size,
              " do not match ", tiles.size(1), " chunks of 64");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && offsets.sizes() == scales.sizes() &&
                  offsets.scalar_type() == at::kFloat && offsets.is_contiguous() && code_sums.sizes() == scales.sizes() &&
                  code_sums.scalar_type() == at::kInt && code_sums.is_contiguous(),
              "linear_int4_amx: float32 scales and offsets, int32 code sums, all [N/16, groups, 16]");
  at::Tensor xf = x.to(at::kFloat);
  if (G * group_size > K) xf = at::constant_pad_nd(xf, {0, G * group_size - K});
  at::Tensor xsum = xf.view({x.size(0), G, group_size}).sum(-1).contiguous();
  AmxArgs a{};
  a.N = N;
  a.is_int4 = true;
  a.group_chunks = group_size / 64;
  a.num_groups = G;
  a.scales = scales.data_ptr<float>();
  a.wsum = code_sums.data_ptr<int32_t>();
  a.offsets = offsets.data_ptr<float>();
  a.xsum = xsum.data_ptr<float>();
  return amx_linear(x, tiles, a, bias, vnni);
}

at::Tensor linear_int8_amx(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                           const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/false, /*f32_out=*/false);
}

// The same products with fp32 outputs: a tied int8 LM head's logits, unrounded.
at::Tensor linear_int8_amx_f32out(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                                  const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/false, /*f32_out=*/true);
}

at::Tensor linear_int4_amx(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                           const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                           const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int4_tiles(x, tiles, scales, code_sums, offsets, group_size, bias, out_features, /*vnni=*/false);
}

// The AMX tiles on AVX-512 VNNI (vnni.cpp): CPUs with VNNI and no AMX.
at::Tensor linear_int8_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/true, /*f32_out=*/false);
}

at::Tensor linear_int8_vnni_f32out(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                                   const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/true, /*f32_out=*/true);
}

at::Tensor linear_int4_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int4_tiles(x, tiles, scales, code_sums, offsets, group_size, bias, out_features, /*vnni=*/true);
}

}  // namespace tokenmill
