// The torch custom ops (namespace tokenmill_cpu): their schemas and registration, and the
// run-time selection of the kernel table from the CPU's features; the ops themselves live in
// ops_linear.cpp, ops_norm_rope.cpp, ops_attention.cpp and ops_decode.cpp (ops.h: what they
// share). TOKENMILL_CPU_ISA=avx2 forces the AVX2 kernels; set_isa() switches at run time (tests).
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "ops.h"

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

}  // namespace

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

namespace {

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

}  // namespace

bool amx_active() { return amx_on() && active() == avx512_kernels(); }

// AMX-BF16 (CPUID.7.0 EDX bit 22) beside the AMX-INT8 that amx_active() asks for: every
// CPU with AMX so far has both, but they are separate features.
bool amx_bf16_active() {
  static const bool has_bf16 = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
  }();
  return has_bf16 && amx_active();
}

namespace {

std::string isa() {
  if (!active()) return "none";
  return std::string(active()->name) + (amx_active() ? "+amx_int8" : "") + (amx_bf16_active() ? "+amx_bf16" : "");
}

}  // namespace

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

namespace {

// Inputs per int8 activation scale of the active table's gemm_int8 (0: one scale a row).
int64_t int8_x_group() { return active() ? active()->int8_x_group : 0; }

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

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("isa() -> str");
  m.def("set_isa(str isa) -> str");
  m.def("amx_permitted() -> bool");
  m.def("amx_active() -> bool");
  m.def("amx_bf16_active() -> bool");
  m.def("int8_x_group() -> int");
  m.def("linear_int8_amx(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int4_amx(Tensor x, Tensor tiles, Tensor scales, Tensor code_sums, Tensor offsets, int group_size, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_bf16_f32out(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("gemv_bf16_amx(Tensor x, Tensor packed, int out_features, Tensor? bias, bool f32_out) -> Tensor");
  m.def("gemv_bf16_act(Tensor x, Tensor packed, int out_features, Tensor? bias, str act) -> Tensor");
  m.def("linear_bf16_f32out(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor wsum, Tensor? bias) -> Tensor");
  m.def("linear_int8_f32out(Tensor x, Tensor weight, Tensor scales, Tensor wsum, Tensor? bias) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int group_size, Tensor? bias) -> Tensor");
  m.def("dequantize_int4(Tensor weight, Tensor scales, Tensor offsets, int group_size, int in_features) -> Tensor");
  m.def("linear_int4_x8(Tensor x, Tensor packed, Tensor scales, Tensor offsets, Tensor? bias, int out_features) -> Tensor");
  m.def("dequantize_int4_x8(Tensor packed, Tensor scales, Tensor offsets, int out_features, int in_features, bool bf16=False) -> Tensor");
  m.def("quantize_int4_groups(Tensor weight, int group_size, bool half, float[] levels, int rounds) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize_int4_x8_blocks(Tensor packed, Tensor scales, Tensor offsets, int out_features, int in_features) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool offset=False) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rope_kv_write(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor kv_scales) -> Tensor");
  m.def("qkv_rope_kv_write(Tensor qkv, int num_heads, int num_kv_heads, int head_dim, Tensor? q_norm, float q_eps, "
        "Tensor? k_norm, float k_eps, bool norm_offset, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, Tensor kv_scales, float softcap=0.0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start, float scale, int window, Tensor kv_scales, "
        "float softcap=0.0) -> Tensor");
  m.def("linear_int8_vnni(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int8_amx_f32out(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int8_vnni_f32out(Tensor x, Tensor tiles, Tensor scales, Tensor wsum, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_int4_vnni(Tensor x, Tensor tiles, Tensor scales, Tensor code_sums, Tensor offsets, int group_size, "
        "Tensor? bias, int out_features) -> Tensor");
  tokenmill::register_decode_layers(m);  // its class, schema and CPU kernel
  m.impl("isa", &tokenmill::isa);
  m.impl("set_isa", &tokenmill::set_isa);
  m.impl("amx_permitted", &tokenmill::amx_permitted);
  m.impl("amx_active", &tokenmill::amx_active);
  m.impl("amx_bf16_active", &tokenmill::amx_bf16_active);
  m.impl("int8_x_group", &tokenmill::int8_x_group);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("linear_bf16", &tokenmill::linear_bf16);
  m.impl("gemv_bf16", &tokenmill::gemv_bf16);
  m.impl("gemv_bf16_f32out", &tokenmill::gemv_bf16_f32out);
  m.impl("gemv_bf16_amx", &tokenmill::gemv_bf16_amx);
  m.impl("gemv_bf16_act", &tokenmill::gemv_bf16_act);
  m.impl("linear_bf16_f32out", &tokenmill::linear_bf16_f32out);
  m.impl("gemv_f32", &tokenmill::gemv_f32);
  m.impl("linear_int8", &tokenmill::linear_int8);
  m.impl("linear_int8_f32out", &tokenmill::linear_int8_f32out);
  m.impl("linear_int4", &tokenmill::linear_int4);
  m.impl("dequantize_int4", &tokenmill::dequantize_int4);
  m.impl("linear_int4_x8", &tokenmill::linear_int4_x8);
  m.impl("dequantize_int4_x8", &tokenmill::dequantize_int4_x8);
  m.impl("quantize_int4_groups", &tokenmill::quantize_int4_groups);
  m.impl("dequantize_int4_x8_blocks", &tokenmill::dequantize_int4_x8_blocks);
  m.impl("linear_int8_amx", &tokenmill::linear_int8_amx);
  m.impl("linear_int4_amx", &tokenmill::linear_int4_amx);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("add_rms_norm", &tokenmill::add_rms_norm);
  m.impl("silu_and_mul", &tokenmill::silu_and_mul);
  m.impl("argmax_rows", &tokenmill::argmax_rows);
  m.impl("gelu_tanh_and_mul", &tokenmill::gelu_tanh_and_mul);
  m.impl("rope", &tokenmill::rope);
  m.impl("paged_decode_attention", &tokenmill::paged_decode_attention);
  m.impl("rope_kv_write", &tokenmill::rope_kv_write);
  m.impl("qkv_rope_kv_write", &tokenmill::qkv_rope_kv_write_op);
  m.impl("paged_prefill_attention", &tokenmill::paged_prefill_attention);
  m.impl("linear_int8_vnni", &tokenmill::linear_int8_vnni);
  m.impl("linear_int8_amx_f32out", &tokenmill::linear_int8_amx_f32out);
  m.impl("linear_int8_vnni_f32out", &tokenmill::linear_int8_vnni_f32out);
  m.impl("linear_int4_vnni", &tokenmill::linear_int4_vnni);
}
