// What the op files (ops_*.cpp) share: the active kernel table, the tensor checks, the split
// of an op's range across ATen's threads, and the ops one file calls from another (the
// decode step calls the others; ops.cpp registers them all).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>

#include "kernels.h"

namespace tokenmill {

// ---- dispatch (ops.cpp) ----------------------------------------------------------------
// The kernel table in use (null: this CPU has neither table), and it checked non-null.
const KernelTable*& active();
const KernelTable& kernels();
// Whether the Linux kernel granted this process the AMX tile state, and whether the AMX
// kernels are on (granted, with the AVX-512 table, not switched off).
bool amx_permitted();
bool amx_active();
bool amx_bf16_active();

int fmt_of(const at::Tensor& t);
int act_fmt(const at::Tensor& t);  // F32 or BF16, else an error
void check_rows(const at::Tensor& x, const char* name);

// ---- threading ---------------------------------------------------------------------------
// Every op splits [0, range) in chunks that ATen's threads claim one at a time, not in one fixed share
// each: a thread that loses its core for a while (the server's event loop, another
// process) leaves its chunks to the others instead of holding up the whole op. Outputs do
// not depend on which thread computes which chunk. A range of one chunk runs inline.
// ``done()`` runs on every thread that took part, after its last chunk: a kernel that leaves
// work pending on its thread from one chunk to the next (amx_gemm_bf16) finishes it there.
template <class F, class D>
void parallel_chunks(int64_t range, int64_t chunk, const F& fn, const D& done) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (range + chunk - 1) / chunk);
  if (tasks <= 1 || at::in_parallel_region()) {
    if (range > 0) fn(int64_t{0}, range);
    done();
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    for (int64_t s = next.fetch_add(chunk, std::memory_order_relaxed); s < range;
         s = next.fetch_add(chunk, std::memory_order_relaxed))
      fn(s, std::min(range, s + chunk));
    done();
  });
}

template <class F>
void parallel_chunks(int64_t range, int64_t chunk, const F& fn) {
  parallel_chunks(range, chunk, fn, [] {});
}

inline int64_t rows_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// Output channels per task: whole 16-channel blocks, and no task under ~64 KB of weights.
inline int64_t gemm_grain(int64_t K, int64_t bytes_per_weight_x2) {
  int64_t rows = (131072 / std::max<int64_t>(1, K * bytes_per_weight_x2) + 15) / 16 * 16;
  return std::max<int64_t>(16, rows);
}

// ---- linear ops (ops_linear.cpp) -----------------------------------------------------------
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear_bf16_f32out(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor gemv_bf16_f32out(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias);
at::Tensor gemv_bf16_act(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         const std::string& act);
at::Tensor gemv_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         bool f32_out);
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& wsum, const c10::optional<at::Tensor>& bias);
at::Tensor linear_int8_f32out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                              const at::Tensor& wsum, const c10::optional<at::Tensor>& bias);
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias);
at::Tensor dequantize_int4(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                           int64_t group_size, int64_t in_features);
at::Tensor linear_int4_x8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const at::Tensor& offsets, const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor dequantize_int4_x8(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                              int64_t out_features, int64_t in_features, bool bf16);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int4_groups(const at::Tensor& weight, int64_t group_size,
                                                                    bool half, at::ArrayRef<double> levels,
                                                                    int64_t rounds);
at::Tensor dequantize_int4_x8_blocks(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                                     int64_t out_features, int64_t in_features);
// The AMX tile layout's int8 / int4 products, on AMX or (vnni) on AVX-512 VNNI.
at::Tensor int8_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor& wsum,
                      const c10::optional<at::Tensor>& bias, int64_t out_features, bool vnni, bool f32_out);
at::Tensor int4_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                      const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, int64_t out_features, bool vnni);
at::Tensor linear_int8_amx(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                           const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor linear_int4_amx(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                           const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                           const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor linear_int8_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor linear_int8_amx_f32out(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                                  const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor linear_int8_vnni_f32out(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                                   const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor linear_int4_vnni(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                            const at::Tensor& code_sums, const at::Tensor& offsets, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features);

// ---- sampling (ops_sampling.cpp) ---------------------------------------------------------------
// The first index of each row's maximum, as torch.argmax(x, 1).
at::Tensor argmax_rows(const at::Tensor& x);

// ---- norms, activation, RoPE (ops_norm_rope.cpp) ---------------------------------------------
// (norm(x [+ *residual]) * weight, x + *residual); residual null: the second is undefined.
// offset (Gemma): the scale is 1 + weight, applied in fp32 before the one rounding.
std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual,
                                        const at::Tensor& weight, double eps, bool offset = false);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool offset);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope_kv_write(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& kv_scales);
// The decode step's attention prologue on the qkv projection's rows as they lie: each head's
// RMSNorm of q and k where the layer has them (q_norm / k_norm weights; undefined: none),
// then rope_kv_write into caches of the activation dtype, in one parallel region over the
// tokens. positions and slots: int64, contiguous (each slot is checked against the caches).
// Returns the rotated q [T, Hq, D]: the same bits as narrowing qkv, rms_norm on
// each head and rope_kv_write, without their copies and serial calls.
at::Tensor qkv_rope_kv_write(const at::Tensor& qkv, int64_t Hq, int64_t Hk, int64_t D, const at::Tensor& q_norm,
                             double q_eps, const at::Tensor& k_norm, double k_eps, bool norm_offset,
                             const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);
// The same as an op (norm weights optional), for the tests and kernels.qkv_rope_kv_write.
at::Tensor qkv_rope_kv_write_op(const at::Tensor& qkv, int64_t Hq, int64_t Hk, int64_t D,
                                const c10::optional<at::Tensor>& q_norm, double q_eps,
                                const c10::optional<at::Tensor>& k_norm, double k_eps, bool norm_offset,
                                const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);

// ---- paged attention (ops_attention.cpp) -----------------------------------------------------
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const at::Tensor& kv_scales, double softcap);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                                   const at::Tensor& query_start, double scale, int64_t window,
                                   const at::Tensor& kv_scales, double softcap);

}  // namespace tokenmill

namespace torch {
class Library;
}

namespace tokenmill {

// ---- one decode step through a stack of decoder layers (ops_decode.cpp) ----------------------
// Registers the DecodeLayers class and the decode_layers op that reads it (from ops.cpp's
// TORCH_LIBRARY block: the class before the schema that names it).
void register_decode_layers(torch::Library& m);

}  // namespace tokenmill
