// One decode step through a stack of pre-norm decoder layers (model/fused_decode.py).
// The same ops as the Python layers call, in the same order on the same tensors (so the
// outputs are bit-identical), called from here: one stream's step made ~130 calls through
// Python and the dispatcher, with module and view overheads in between, ~15% of its time.
#include "ops.h"

namespace tokenmill {
namespace {

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

}  // namespace

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

}  // namespace tokenmill
