// The torch custom ops (namespace tokenmill_cpu): tensor checks, the split across ATen's
// threads, and run-time selection of the kernel table from the CPU's features.
// TOKENMILL_CPU_ISA=avx2 forces the AVX2 kernels; set_isa() switches at run time (tests).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

namespace tokenmill {
namespace {

bool has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

const KernelTable* select(const std::string& want) {
  if (want == "avx2") return has_avx2() ? avx2_kernels() : nullptr;
  if (want == "avx512") return has_avx512_bf16() ? avx512_kernels() : nullptr;
  if (has_avx512_bf16()) return avx512_kernels();
  return has_avx2() ? avx2_kernels() : nullptr;
}

bool& amx_on();

const KernelTable*& active() {
  static const KernelTable* table = [] {
    const char* env = std::getenv("TOKENMILL_CPU_ISA");
    return select(env ? std::string(env) : std::string("auto"));
  }();
  return table;
}

const KernelTable& kernels() {
  TORCH_CHECK(active() != nullptr, "tokenmill_cpu: this CPU has neither AVX-512 BF16 nor AVX2");
  return *active();
}

// AMX tiles may only be used once the kernel grants this process the tile state; some
// VMs list the flags and still fault on the first tile instruction without it.
bool amx_permitted() {
  static const bool granted = [] {
    unsigned a, b, c, d;
    // CPUID.7.0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}

// AMX only with the AVX-512 table (its quantizer feeds the tiles) and not when a lower
// ISA was asked for.
bool& amx_on() {
  static bool on = [] {
    const char* env = std::getenv("TOKENMILL_CPU_ISA");
    const std::string want = env ? env : "auto";
    return (want == "auto" || want == "amx") && has_avx512_bf16() && amx_permitted();
  }();
  return on;
}

std::string isa() {
  if (!active()) return "none";
  return std::string(active()->name) + (amx_on() && active() == avx512_kernels() ? "+amx_int8" : "");
}

bool amx_active() { return amx_on() && active() == avx512_kernels(); }

std::string set_isa(const std::string& want) {
  TORCH_CHECK(want == "auto" || want == "amx" || want == "avx2" || want == "avx512",
              "set_isa: expected auto, amx, avx512 or avx2, got ", want);
  TORCH_CHECK(want != "amx" || (has_avx512_bf16() && amx_permitted()),
              "set_isa: this CPU (or its kernel) does not let this process use AMX tiles");
  const KernelTable* table = select(want == "amx" ? "avx512" : want);
  TORCH_CHECK(table != nullptr, "set_isa: this CPU cannot run the ", want, " kernels");
  active() = table;
  amx_on() = (want == "auto" || want == "amx") && table == avx512_kernels() && amx_permitted();
  return isa();
}

int fmt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kFloat8_e4m3fn: return E4M3;
    case at::kFloat8_e5m2: return E5M2;
    default: TORCH_CHECK(false, "tokenmill_cpu: unsupported dtype ", t.scalar_type());
  }
}

int act_fmt(const at::Tensor& t) {
  int f = fmt_of(t);
  TORCH_CHECK(f == F32 || f == BF16, "tokenmill_cpu: activations must be float32 or bfloat16");
  return f;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              ": expected a 2-d CPU tensor with contiguous rows");
}

// Every op splits [0, range) in chunks that ATen's threads claim one at a time, not in one fixed share
// each: a thread that loses its core for a while (the server's event loop, another
// process) leaves its chunks to the others instead of holding up the whole op. Outputs do
// not depend on which thread computes which chunk. A range of one chunk runs inline.
template <class F>
void parallel_chunks(int64_t range, int64_t chunk, const F& fn) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (range + chunk - 1) / chunk);
  if (tasks <= 1 || at::in_parallel_region()) {
    if (range > 0) fn(int64_t{0}, range);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    for (int64_t s = next.fetch_add(chunk, std::memory_order_relaxed); s < range;
         s = next.fetch_add(chunk, std::memory_order_relaxed))
      fn(s, std::min(range, s + chunk));
  });
}

int64_t rows_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// Output channels per task: whole 16-channel blocks, and no task under ~64 KB of weights.
int64_t gemm_grain(int64_t K, int64_t bytes_per_weight_x2) {
  int64_t rows = (131072 / std::max<int64_t>(1, K * bytes_per_weight_x2) + 15) / 16 * 16;
  return std::max<int64_t>(16, rows);
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, GemmArgs args, int64_t N,
                const c10::optional<at::Tensor>& bias, int64_t grain,
                void (*fn)(const GemmArgs&, int64_t, int64_t), int64_t range = -1, bool f32 = false,
                bool f32_out = false) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == (f32 ? at::kFloat : at::kBFloat16), "tokenmill_cpu linear: x must be ",
              f32 ? "float32" : "bfloat16");
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(f32 || f32_out ? at::kFloat : at::kBFloat16));
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
  args.ldy = N;
  if (args.M == 0 || N == 0) return y;
  // The parallel dimension: output channels, or (range >= 0) the kernel's channel blocks.
  parallel_chunks(range < 0 ? N : range, grain, [&](int64_t n0, int64_t n1) { fn(args, n0, n1); });
  return y;
}

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

// bf16 weights packed by kernels/gemv_layout.py: [ceil(N/16), ceil(K/2), 16, 2]; bf16 out, or
// (f32_out) the fp32 sums unrounded: an LM head's logits, where bf16's 8 bits of mantissa turn
// close candidates into ties that greedy decoding then breaks by token id.
at::Tensor gemv_bf16_out(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         bool f32_out) {
  check_rows(x, "x");
  const int64_t K = x.size(1), blocks = (N + 15) / 16, kp = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == blocks && packed.size(1) == kp && packed.size(2) == 16 && packed.size(3) == 2,
              "gemv_bf16: weight must be bfloat16 blocks [", blocks, ", ", kp, ", 16, 2] (kernels.gemv_layout)");
  GemmArgs a{};
  a.N = N;
  // Tasks of whole blocks, ~64 KB of weights or more: each thread streams one contiguous range.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kp * 64));
  return gemm(x, packed, a, N, bias, grain, kernels().gemv_bf16, blocks, /*f32=*/false, f32_out);
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  return gemv_bf16_out(x, packed, N, bias, false);
}

at::Tensor gemv_bf16_f32out(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  return gemv_bf16_out(x, packed, N, bias, true);
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

// Tables with quantize_rows read int8 activations (W8A8): x is quantized per row first.
void quantize_activations(const at::Tensor& x, GemmArgs& a, bool is_unsigned, at::Tensor& xq, at::Tensor& xs,
                          int64_t ldq = 0) {
  const KernelTable& k = kernels();
  if (!k.quantize_rows) return;
  const int64_t M = x.size(0);
  a.ldq = std::max(ldq, (x.size(1) + 63) / 64 * 64);
  xq = at::empty({M, a.ldq}, x.options().dtype(at::kByte));
  xs = at::empty({M}, x.options().dtype(at::kFloat));
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = x.stride(0);
  a.K = x.size(1);
  a.xq = xq.data_ptr<uint8_t>();
  a.x_scale = xs.data_ptr<float>();
  parallel_chunks(M, rows_grain(x.size(1)), [&](int64_t r0, int64_t r1) { k.quantize_rows(a, is_unsigned, r0, r1); });
}

namespace {
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
  a.wsum = wsum.data_ptr<int32_t>();
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  at::Tensor xq, xs;
  quantize_activations(x, a, kernels().int8_x_unsigned, xq, xs);
  return gemm(x, w, a, w.size(0), bias, gemm_grain(x.size(1), 2), kernels().gemm_int8, -1, false, f32_out);
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
  // Sum of the activations over each group: the zeros' share of every output (a plain loop:
  // the ATen ops it replaces cost ~15 us a call, more than a one-row product's kernel).
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  const int64_t M = x.size(0), ldx = x.stride(0);
  at::Tensor xsum = at::empty({M, G}, x.options().dtype(at::kFloat));
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* xs_out = xsum.data_ptr<float>();
  parallel_chunks(M, rows_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int64_t k = g * group_size; k < std::min(K, (g + 1) * group_size); ++k) {
          const uint32_t u = (uint32_t)xb[r * ldx + k] << 16;
          float f;
          std::memcpy(&f, &u, 4);
          s += f;
        }
        xs_out[r * G + g] = s;
      }
  });
  GemmArgs a{};
  a.ldw = w.stride(0);
  a.scales = scales.data_ptr<float>();
  a.zeros = zeros.data_ptr<float>();
  a.xsum = xsum.data_ptr<float>();
  a.group_size = group_size;
  a.num_groups = G;
  at::Tensor xq, xs;
  // Codes padded to whole groups: the quantized rows too, so a kernel may read whole blocks.
  if (group_size == 32 && kernels().int4_w8a8_g32) {
    // Groups of 32 (GGUF's Q4 blocks): x quantized per row and group of 32, each with its own
    // scale, as llama.cpp's Q8 blocks are, and the offsets' share summed from those quantized
    // values, so the product is exactly sum(w * x_q). One scale a row let a few large
    // activations flatten the rest (SmolLM2 Q4_1: top-1 agreement with fp32 72%), and the
    // exact sums added offset * sum(x - x_q), offsets being ~-8 weight scales.
    const int64_t ldq = w.size(1) * 2;
    xq = at::zeros({M, ldq}, x.options().dtype(at::kByte));
    xs = at::ones({M}, x.options().dtype(at::kFloat));
    at::Tensor xg = at::empty({M, G}, x.options().dtype(at::kFloat));
    int8_t* q = reinterpret_cast<int8_t*>(xq.data_ptr<uint8_t>());
    float* xg_out = xg.data_ptr<float>();
    parallel_chunks(M, rows_grain(K), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k0 = g * group_size, k1 = std::min(K, (g + 1) * group_size);
          float amax = 0.0f;
          for (int64_t k = k0; k < k1; ++k) {
            const uint32_t u = (uint32_t)xb[r * ldx + k] << 16;
            float f;
            std::memcpy(&f, &u, 4);
            amax = std::max(amax, std::fabs(f));
          }
          const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
          int32_t sum = 0;
          for (int64_t k = k0; k < k1; ++k) {
            const uint32_t u = (uint32_t)xb[r * ldx + k] << 16;
            float f;
            std::memcpy(&f, &u, 4);
            const int32_t v = (int32_t)std::nearbyint(f * inv);
            q[r * ldq + k] = (int8_t)v;
            sum += v;
          }
          xg_out[r * G + g] = scale;
          xs_out[r * G + g] = (float)sum * scale;
        }
    });
    a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
    a.ldx = ldx;
    a.K = K;
    a.xq = xq.data_ptr<uint8_t>();
    a.ldq = ldq;
    a.x_scale = xs.data_ptr<float>();
    a.x_group_scale = xg_out;
    return gemm(x, w, a, N, bias, gemm_grain(K, 1), kernels().gemm_int4);
  }
  if (group_size % 64 == 0) quantize_activations(x, a, /*is_unsigned=*/false, xq, xs, w.size(1) * 2);
  return gemm(x, w, a, N, bias, gemm_grain(K, 1), kernels().gemm_int4);
}

// AMX: weights in tiles [N/16, chunks, 16, 64] (int8) or [N/16, chunks, 512] (int4 nibbles).
// ``vnni``: the same tiles through vnni_gemm on the AVX-512 table (no AMX needed).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, AmxArgs a, const c10::optional<at::Tensor>& bias,
                      bool vnni = false) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tokenmill_cpu linear: x must be bfloat16");
  if (vnni) {
    TORCH_CHECK(active() == avx512_kernels(), "tokenmill_cpu: the VNNI kernels need the avx512 table");
  } else {
    TORCH_CHECK(amx_active(), "tokenmill_cpu: the AMX kernels are not active in this process");
  }
  TORCH_CHECK(tiles.is_contiguous() && tiles.dim() >= 3 && tiles.size(0) * 16 >= a.N && tiles.size(1) * 64 >= x.size(1),
              "amx linear: weight tiles do not cover [", a.N, ", ", x.size(1), "]");
  const int64_t M = x.size(0);
  a.num_chunks = tiles.size(1);
  GemmArgs q{};
  at::Tensor xq, xs;
  quantize_activations(x, q, /*is_unsigned=*/!(vnni && a.is_int4), xq, xs, a.num_chunks * 64);
  a.xq = q.xq;
  a.x_scale = q.x_scale;
  a.ldq = q.ldq;
  a.M = M;
  a.w = tiles.data_ptr();
  at::Tensor y = at::empty({M, a.N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == a.N, "bias has ", b.numel(), " elements, expected ", a.N);
    a.bias = b.data_ptr<float>();
  }
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr());
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

at::Tensor int8_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor& wsum,
                      const c10::optional<at::Tensor>& bias, int64_t out_features, bool vnni) {
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.dim() == 4, "linear_int8_amx: int8 tiles [N/16, chunks, 16, 64]");
  const int64_t N = out_features;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && wsum.scalar_type() == at::kInt &&
                  wsum.is_contiguous() && scales.numel() == tiles.size(0) * 16 && wsum.numel() == scales.numel(),
              "linear_int8_amx: float32 scales and int32 row sums blocked [N/16, 16]");
  AmxArgs a{};
  a.N = N;
  a.scales = scales.data_ptr<float>();
  a.wsum = wsum.data_ptr<int32_t>();
  return amx_linear(x, tiles, a, bias, vnni);
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
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/false);
}

at::Tensor linear_int4_amx(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                           const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                           const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int4_tiles(x, tiles, scales, code_sums, offsets, group_size, bias, out_features, /*vnni=*/false);
}

// The AMX tiles on AVX-512 VNNI (vnni.cpp): CPUs with VNNI and no AMX.
at::Tensor linear_int8_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int8_tiles(x, tiles, scales, wsum, bias, out_features, /*vnni=*/true);
}

at::Tensor linear_int4_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return int4_tiles(x, tiles, scales, code_sums, offsets, group_size, bias, out_features, /*vnni=*/true);
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual,
                                        const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == D,
              "rms_norm: weight must be [", D, "] in the activation dtype");
  NormArgs a{};
  a.fmt = act_fmt(x);
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.D = D;
  a.weight = weight.data_ptr();
  a.eps = static_cast<float>(eps);
  at::Tensor out = at::empty({R, D}, x.options());
  at::Tensor res_out;
  a.out = out.data_ptr();
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual must match x");
    res_out = at::empty({R, D}, x.options());
    a.residual = residual->data_ptr();
    a.ldr = residual->stride(0);
    a.residual_out = res_out.data_ptr();
  }
  const KernelTable& k = kernels();
  parallel_chunks(R, rows_grain(D), [&](int64_t r0, int64_t r1) { k.rms_norm(a, r0, r1); });
  return {out, res_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm(x, &residual, weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  SiluMulArgs a{};
  a.fmt = act_fmt(x);
  a.D = x.size(1) / 2;
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  at::Tensor out = at::empty({x.size(0), a.D}, x.options());
  a.out = out.data_ptr();
  const KernelTable& k = kernels();
  parallel_chunks(x.size(0), rows_grain(a.D), [&](int64_t r0, int64_t r1) { k.silu_mul(a, r0, r1); });
  return out;
}

// The checks and fields rope and rope_kv_write share (q, k, the tables and the positions);
// the caller sets the outputs. `op` names the caller in the errors.
RopeArgs rope_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& pos) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              op, ": q [T, Hq, D] and k [T, Hk, D] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), op, ": q and k dtypes differ");
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 2 == 0, op, ": head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == D && sin.sizes() == cos.sizes(),
              op, ": cos and sin must be float32 [positions, head_dim]");
  TORCH_CHECK(pos.numel() == q.size(0), op, ": one position per token");
  RopeArgs a{};
  a.fmt = act_fmt(q);
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.ldq = q.stride(0);
  a.ldk = k.stride(0);
  a.Hq = q.size(1);
  a.Hk = k.size(1);
  a.D = D;
  a.positions = pos.data_ptr<int64_t>();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  return a;
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor pos = positions.to(at::kLong).contiguous();
  RopeArgs a = rope_args("rope", q, k, cos, sin, pos);
  const int64_t T = q.size(0), D = a.D;
  at::Tensor qo = at::empty({T, a.Hq, D}, q.options()), ko = at::empty({T, a.Hk, D}, k.options());
  a.q_out = qo.data_ptr();
  a.k_out = ko.data_ptr();
  const KernelTable& kt = kernels();
  parallel_chunks(T, rows_grain((a.Hq + a.Hk) * D), [&](int64_t t0, int64_t t1) { kt.rope(a, t0, t1); });
  return {qo, ko};
}

// One cache's rows [slots] = x, as model/attention.py's write_kv stores them: converted to
// the cache dtype, or for fp8 divided by the layer's scale, saturated and stored as bytes.
void store_kv(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& scale) {
  const auto dt = cache.scalar_type();
  const bool fp8 = dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2;
  at::Tensor rows = (fp8 ? cache.view(at::kByte) : cache).view({-1, x.size(1), x.size(2)});
  if (!fp8) {
    rows.index_copy_(0, slots, x.to(dt));
    return;
  }
  const double limit = dt == at::kFloat8_e4m3fn ? 448.0 : 57344.0;  // torch.finfo(dt).max
  rows.index_copy_(0, slots, (x.to(at::kFloat) / scale).clamp(-limit, limit).to(dt).view(at::kByte));
}

// RoPE of q and k, then k and v stored into the caches [blocks, block_size, Hk, D] at the
// flat slots; returns the rotated q. A cache in the activation dtype is written in place
// by the kernel; any other dtype gets the rotated k through a scratch buffer and store_kv.
at::Tensor rope_kv_write(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& kv_scales) {
  at::Tensor pos = positions.to(at::kLong).contiguous();
  RopeKvArgs a{};
  a.rope = rope_args("rope_kv_write", q, k, cos, sin, pos);
  RopeArgs& r = a.rope;
  const int64_t T = q.size(0), Hk = r.Hk, D = r.D;
  TORCH_CHECK(v.sizes() == k.sizes() && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
                  v.scalar_type() == k.scalar_type(),
              "rope_kv_write: v must be shaped like k, with contiguous heads, and q, k, v one dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(2) == Hk && k_cache.size(3) == D,
              "rope_kv_write: K and V caches [blocks, block_size, Hk, D], contiguous, one dtype");
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "rope_kv_write: one slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_kv_write: slot ", sp[t], " outside the cache");
  at::Tensor sc = kv_scales.to(at::kFloat).contiguous();
  TORCH_CHECK(sc.numel() == 2, "rope_kv_write: kv_scales holds [k_scale, v_scale]");
  at::Tensor qo = at::empty({T, r.Hq, D}, q.options());
  r.q_out = qo.data_ptr();
  a.v = v.data_ptr();
  a.ldv = v.stride(0);
  const bool in_place = k_cache.scalar_type() == q.scalar_type();
  at::Tensor k_rot;
  if (in_place) {
    a.k_dst = k_cache.data_ptr();
    a.v_dst = v_cache.data_ptr();
    a.dst_rows = sp;
  } else {
    k_rot = at::empty({T, Hk, D}, k.options());
    a.k_dst = k_rot.data_ptr();
  }
  const KernelTable& kt = kernels();
  parallel_chunks(T, rows_grain((r.Hq + 2 * Hk) * D), [&](int64_t t0, int64_t t1) { kt.rope_kv(a, t0, t1); });
  if (!in_place) {
    store_kv(k_cache, k_rot, slots, sc.select(0, 0));
    store_kv(v_cache, v, slots, sc.select(0, 1));
  }
  return qo;
}


// Tokens per split of a long context: enough work per item that the merge stays cheap.
constexpr int64_t kMinSplitTokens = 256;

// The fields decode and prefill attention share, after the checks they share (`op` names
// the caller in the errors): q [rows, Hq, D] over the [blocks, block_size, Hkv, D] caches
// through the long block tables and lengths, and kv_scales as floats. The caller keeps
// those tensors alive and sets out, query_start and the work items.
PrefillArgs paged_args(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                       const at::Tensor& scales, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), op, ": q [rows, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": K and V caches [blocks, block_size, Hkv, D], contiguous, one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, op,
              ": head shapes do not match the cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == lens.numel(), op,
              ": one block table row per sequence");
  TORCH_CHECK(scales.numel() == 2, op, ": kv_scales holds [k_scale, v_scale]");
  PrefillArgs a{};
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.context_lens = lens.data_ptr<int64_t>();
  a.Hq = q.size(1);
  a.Hkv = k_cache.size(2);
  a.D = q.size(2);
  a.block_size = k_cache.size(1);
  a.ldq = q.stride(0);
  a.ldbt = block_tables.size(1);
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.k_scale = scales.data_ptr<float>()[0];
  a.v_scale = scales.data_ptr<float>()[1];
  a.q_fmt = act_fmt(q);
  a.kv_fmt = fmt_of(k_cache);
  return a;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const at::Tensor& kv_scales, double softcap) {
  at::Tensor bt = block_tables.to(at::kLong).contiguous();
  at::Tensor cl = context_lens.to(at::kLong).contiguous();
  at::Tensor sc = kv_scales.to(at::kFloat).contiguous();
  PrefillArgs p = paged_args("decode_attention", q, k_cache, v_cache, bt, cl, scale, window, sc, softcap);
  const int64_t B = q.size(0), Hq = p.Hq, D = p.D, bs = p.block_size;
  TORCH_CHECK(cl.numel() == B, "decode_attention: one context length per query row");
  const int64_t* lens = p.context_lens;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= p.ldbt * bs, "decode_attention: context length ", lens[b],
                " outside the block table");
  // Work items: whole sequences, or, when there are fewer sequences than ~4 per thread,
  // splits of the long ones (whole blocks, >= kMinSplitTokens each) merged afterwards.
  // Still fewer than 2 items per thread (one short sequence: one stream's decode), each
  // (sequence, split) goes one KV head per item, so every thread has work.
  const int64_t threads = at::get_num_threads();
  const int64_t want = B >= 4 * threads ? 1 : (4 * threads + B - 1) / B;
  std::vector<int64_t> ranges, seq_slots(B + 1, 0), starts(B + 1);  // ranges: [lo, hi) per slot
  ranges.reserve(2 * B * want);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const int64_t L = lens[b] - start;
    const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(want, L / kMinSplitTokens));
    const int64_t per = (L + splits - 1) / splits;
    const int64_t step = std::max<int64_t>(bs, (per + bs - 1) / bs * bs);  // whole blocks
    for (int64_t t = start / bs * bs; t < lens[b]; t += step)
      ranges.insert(ranges.end(), {std::max(t, start), std::min(t + step, lens[b])});
    seq_slots[b + 1] = static_cast<int64_t>(ranges.size()) / 2;
    starts[b + 1] = b + 1;
  }
  const int64_t slots = seq_slots[B];
  const int64_t heads_per_item = slots < 2 * threads ? 1 : p.Hkv;
  std::vector<int64_t> triples, item_range, item_slot;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = seq_slots[b]; s < seq_slots[b + 1]; ++s)
      for (int64_t h = 0; h < p.Hkv; h += heads_per_item) {
        triples.insert(triples.end(), {b, h, 0});  // one query row, heads [h, h + heads_per_item)
        item_range.insert(item_range.end(), {ranges[2 * s], ranges[2 * s + 1]});
        item_slot.push_back(s);
      }
  const int64_t items = static_cast<int64_t>(item_slot.size());
  at::Tensor out = at::empty({B, Hq * D}, q.options());
  at::Tensor partial, partial_ml;
  if (slots > B) {
    partial = at::empty({slots, Hq, D}, q.options().dtype(at::kFloat));
    partial_ml = at::empty({slots, Hq, 2}, q.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
    p.partial_ml = partial_ml.data_ptr<float>();
  }
  // The prefill kernel with one query row per sequence per item: keys in tiles across
  // blocks (one softmax update per tile), bf16 dot products on AVX-512.
  p.query_start = starts.data();
  p.out = out.data_ptr();
  p.items = triples.data();
  p.rows_per_item = 1;
  p.heads_per_item = heads_per_item;
  p.item_keys = item_range.data();
  p.item_slot = item_slot.data();
  const KernelTable& k = kernels();
  parallel_chunks(items, 1, [&](int64_t i0, int64_t i1) { k.prefill_attention(p, i0, i1); });
  if (slots > B) {
    const AttnArgs m{p.out, Hq, D, p.q_fmt, p.partial, p.partial_ml, seq_slots.data()};
    parallel_chunks(B, 1, [&](int64_t b0, int64_t b1) { k.attention_merge(m, b0, b1); });
  }
  return out;
}

// Prefill chunks over the paged cache: sequence b's queries are q rows [query_start[b],
// query_start[b+1]), its last positions; they attend its first context_lens[b] tokens,
// causally. Work items (sequence, KV head, tile of query rows), ordered so that a
// contiguous share of them (OpenMP's static split) mixes early and late, cheap and dear,
// tiles of the causal triangle.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                                   const at::Tensor& query_start, double scale, int64_t window,
                                   const at::Tensor& kv_scales, double softcap) {
  at::Tensor bt = block_tables.to(at::kLong).contiguous();
  at::Tensor cl = context_lens.to(at::kLong).contiguous();
  at::Tensor qs = query_start.to(at::kLong).contiguous();
  at::Tensor sc = kv_scales.to(at::kFloat).contiguous();
  PrefillArgs a = paged_args("prefill_attention", q, k_cache, v_cache, bt, cl, scale, window, sc, softcap);
  const int64_t N = q.size(0), B = cl.numel(), bs = a.block_size;
  TORCH_CHECK(qs.numel() == B + 1, "prefill_attention: one query range per sequence");
  const int64_t *lens = a.context_lens, *starts = qs.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[B] == N, "prefill_attention: query_start must run from 0 to ", N);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    TORCH_CHECK(n >= 0 && n <= lens[b] && lens[b] <= a.ldbt * bs, "prefill_attention: sequence ", b, " has ", n,
                " queries for a context of ", lens[b], " in ", a.ldbt, " blocks");
  }
  const int64_t Hkv = a.Hkv, rows = prefill_rows_per_item(a.Hq / Hkv);
  std::vector<int64_t> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tiles = (starts[b + 1] - starts[b] + rows - 1) / rows;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t i = 0; i < tiles; ++i) {
        // Tiles in the order 0, last, 1, last - 1, ...: any contiguous run is balanced.
        const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
        items.insert(items.end(), {b, h, tile * rows});
      }
  }
  at::Tensor out = at::empty({N, a.Hq * a.D}, q.options());
  a.query_start = starts;
  a.out = out.data_ptr();
  a.items = items.data();
  a.rows_per_item = rows;
  a.heads_per_item = 1;
  const KernelTable& k = kernels();
  const int64_t count = static_cast<int64_t>(items.size()) / 3;
  parallel_chunks(count, 1, [&](int64_t i0, int64_t i1) { k.prefill_attention(a, i0, i1); });
  return out;
}

// ---- one decode step through a stack of pre-norm decoder layers ----------------------
// The same ops as the Python layers call, in the same order on the same tensors (so the
// outputs are bit-identical), called from here: one stream's step made ~130 calls through
// Python and the dispatcher, with module and view overheads in between, ~15% of its time.

// A projection's kernel and arguments, as model/fused_decode.py's encode lays them out:
// kind, then kLinearTensors tensor slots (unused ones None) and kLinearInts int slots.
enum LinearKind : int64_t {
  kGemvBf16 = 0, kGemvF32 = 1, kInt8Rows = 2, kInt4Rows = 3, kInt8Amx = 4, kInt4Amx = 5, kInt8Vnni = 6,
  kInt4Vnni = 7
};
constexpr int64_t kLinearTensors = 5, kLinearInts = 2;

at::Tensor slot(const c10::List<std::optional<at::Tensor>>& ts, int64_t i) {
  const std::optional<at::Tensor> t = ts.get(i);
  TORCH_CHECK(t.has_value() && t->defined(), "decode_layers: tensor slot ", i, " is empty");
  return *t;
}

c10::optional<at::Tensor> maybe_slot(const c10::List<std::optional<at::Tensor>>& ts, int64_t i) {
  const std::optional<at::Tensor> t = ts.get(i);
  if (t.has_value() && t->defined()) return *t;
  return c10::nullopt;
}

at::Tensor run_linear(const at::Tensor& x, int64_t kind, const c10::List<std::optional<at::Tensor>>& ts, int64_t t,
                      const int64_t* n) {
  switch (kind) {
    case kGemvBf16: return gemv_bf16(x, slot(ts, t), n[0], maybe_slot(ts, t + 1));
    case kGemvF32: return gemv_f32(x, slot(ts, t), n[0], maybe_slot(ts, t + 1));
    case kInt8Rows: return linear_int8(x, slot(ts, t), slot(ts, t + 1), slot(ts, t + 2), maybe_slot(ts, t + 3));
    case kInt4Rows:
      return linear_int4(x, slot(ts, t), slot(ts, t + 1), slot(ts, t + 2), n[0], maybe_slot(ts, t + 3));
    case kInt8Amx:
    case kInt8Vnni:
      return int8_tiles(x, slot(ts, t), slot(ts, t + 1), slot(ts, t + 2), maybe_slot(ts, t + 3), n[0],
                        kind == kInt8Vnni);
    case kInt4Amx:
    case kInt4Vnni:
      return int4_tiles(x, slot(ts, t), slot(ts, t + 1), slot(ts, t + 2), slot(ts, t + 3), n[0],
                        maybe_slot(ts, t + 4), n[1], kind == kInt4Vnni);
    default: TORCH_CHECK(false, "decode_layers: unknown projection kind ", kind);
  }
}

// Per layer: tensors [input norm weight, post-attention norm weight, kv_scales, then the
// qkv, o, gate_up and down projections' slots]; ints [Hq, Hkv, head_dim, window, then per
// projection kind and its int slots]; floats [input eps, post-attention eps, scale, softcap].
// x [T, hidden] is the embedded batch (residual None) or, with residual, the running state
// x + residual; returns (x, residual) after the last layer, for the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::TensorList k_caches, at::TensorList v_caches,
    const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints, at::ArrayRef<double> floats) {
  constexpr int64_t kTensors = 3 + 4 * kLinearTensors, kInts = 4 + 4 * (1 + kLinearInts), kFloats = 4;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && static_cast<int64_t>(tensors.size()) == L * kTensors &&
                  static_cast<int64_t>(ints.size()) == L * kInts && static_cast<int64_t>(floats.size()) == L * kFloats,
              "decode_layers: ", L, " layers need ", kTensors, " tensors, ", kInts, " ints and ", kFloats,
              " floats each");
  at::Tensor x = x_in, residual = residual_in.has_value() ? *residual_in : at::Tensor();
  const int64_t T = x.size(0);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t t0 = l * kTensors;
    const int64_t* n = ints.data() + l * kInts;
    const double* f = floats.data() + l * kFloats;
    const int64_t Hq = n[0], Hkv = n[1], D = n[2], window = n[3];
    at::Tensor h;
    std::tie(h, residual) = residual.defined() ? norm(x, &residual, slot(tensors, t0), f[0])
                                               : std::make_tuple(std::get<0>(norm(x, nullptr, slot(tensors, t0), f[0])), x);
    const at::Tensor kv_scales = slot(tensors, t0 + 2);
    int64_t t = t0 + 3;
    const int64_t* p = n + 4;
    const at::Tensor qkv = run_linear(h, p[0], tensors, t, p + 1);
    const int64_t q_size = Hq * D, kv_size = Hkv * D;
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: qkv has ", qkv.size(1), " features, expected ",
                q_size + 2 * kv_size);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, Hq, D});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    q = rope_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, kv_scales);
    h = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, f[2], window, kv_scales, f[3]);
    t += kLinearTensors;
    p += 1 + kLinearInts;
    h = run_linear(h, p[0], tensors, t, p + 1);
    std::tie(h, residual) = norm(h, &residual, slot(tensors, t0 + 1), f[1]);
    t += kLinearTensors;
    p += 1 + kLinearInts;
    h = silu_and_mul(run_linear(h, p[0], tensors, t, p + 1));
    t += kLinearTensors;
    p += 1 + kLinearInts;
    x = run_linear(h, p[0], tensors, t, p + 1);
  }
  return {x, residual};
}

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("isa() -> str");
  m.def("set_isa(str isa) -> str");
  m.def("amx_permitted() -> bool");
  m.def("amx_active() -> bool");
  m.def("linear_int8_amx(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int4_amx(Tensor x, Tensor tiles, Tensor scales, Tensor code_sums, Tensor offsets, int group_size, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_bf16_f32out(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_bf16_f32out(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor wsum, Tensor? bias) -> Tensor");
  m.def("linear_int8_f32out(Tensor x, Tensor weight, Tensor scales, Tensor wsum, Tensor? bias) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int group_size, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rope_kv_write(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor kv_scales) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, Tensor kv_scales, float softcap=0.0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start, float scale, int window, Tensor kv_scales, "
        "float softcap=0.0) -> Tensor");
  m.def("linear_int8_vnni(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int4_vnni(Tensor x, Tensor tiles, Tensor scales, Tensor code_sums, Tensor offsets, int group_size, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor? residual, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor?[] tensors, "
        "int[] ints, float[] floats) -> (Tensor, Tensor)");
  m.impl("isa", &tokenmill::isa);
  m.impl("set_isa", &tokenmill::set_isa);
  m.impl("amx_permitted", &tokenmill::amx_permitted);
  m.impl("amx_active", &tokenmill::amx_active);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("linear_bf16", &tokenmill::linear_bf16);
  m.impl("gemv_bf16", &tokenmill::gemv_bf16);
  m.impl("gemv_bf16_f32out", &tokenmill::gemv_bf16_f32out);
  m.impl("linear_bf16_f32out", &tokenmill::linear_bf16_f32out);
  m.impl("gemv_f32", &tokenmill::gemv_f32);
  m.impl("linear_int8", &tokenmill::linear_int8);
  m.impl("linear_int8_f32out", &tokenmill::linear_int8_f32out);
  m.impl("linear_int4", &tokenmill::linear_int4);
  m.impl("linear_int8_amx", &tokenmill::linear_int8_amx);
  m.impl("linear_int4_amx", &tokenmill::linear_int4_amx);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("add_rms_norm", &tokenmill::add_rms_norm);
  m.impl("silu_and_mul", &tokenmill::silu_and_mul);
  m.impl("rope", &tokenmill::rope);
  m.impl("paged_decode_attention", &tokenmill::paged_decode_attention);
  m.impl("rope_kv_write", &tokenmill::rope_kv_write);
  m.impl("paged_prefill_attention", &tokenmill::paged_prefill_attention);
  m.impl("linear_int8_vnni", &tokenmill::linear_int8_vnni);
  m.impl("linear_int4_vnni", &tokenmill::linear_int4_vnni);
  m.impl("decode_layers", &tokenmill::decode_layers);
}
