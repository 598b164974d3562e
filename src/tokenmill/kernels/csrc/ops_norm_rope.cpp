// RMSNorm (with the residual add), SiLU * mul and GELU-tanh * mul, and RoPE (alone, or fused with the paged
// KV-cache write).
#include "ops.h"

namespace tokenmill {

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual,
                                        const at::Tensor& weight, double eps, bool offset) {
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
  a.offset = offset;
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  return std::get<0>(norm(x, nullptr, weight, eps, offset));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool offset) {
  return norm(x, &residual, weight, eps, offset);
}

namespace {

// act(gate) * up over x [R, 2D] = [gate | up], by one of the table's gated activations.
at::Tensor act_and_mul(const at::Tensor& x, void (*KernelTable::*fn)(const ActMulArgs&, int64_t, int64_t),
                       const char* op) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": the last dimension must be even");
  ActMulArgs a{};
  a.fmt = act_fmt(x);
  a.D = x.size(1) / 2;
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  at::Tensor out = at::empty({x.size(0), a.D}, x.options());
  a.out = out.data_ptr();
  const auto kernel = kernels().*fn;
  parallel_chunks(x.size(0), rows_grain(a.D), [&](int64_t r0, int64_t r1) { kernel(a, r0, r1); });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) { return act_and_mul(x, &KernelTable::silu_mul, "silu_and_mul"); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return act_and_mul(x, &KernelTable::gelu_tanh_mul, "gelu_tanh_and_mul");
}

namespace {

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

}  // namespace

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

namespace {

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

// Every int64 slot of `slots` a row of the cache [blocks, block_size, ...], or `op`'s error.
void check_slots(const at::Tensor& slots, const at::Tensor& cache, const char* op) {
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot ", sp[t], " outside the cache");
}

}  // namespace

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
  check_slots(slots, k_cache, "rope_kv_write");
  const int64_t* sp = slots.data_ptr<int64_t>();
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

// Tokens per task of qkv_rope_kv_write: ~2,048 values a task (norms, rotations and the V
// copy of a token), so a decode step's 16 tokens split across the threads. One task of 25+
// tokens, as rope_kv_write's rows_grain gives there, left the other thread idle long enough
// to sleep (GOMP_SPINCOUNT) before the attention after it: Gemma 3's serial prologue (q/k
// norms through reshaped copies, then rope_kv_write) was ~85 us a layer at 16 streams.
namespace {
int64_t prologue_grain(int64_t values_per_token) {
  return std::max<int64_t>(1, 2048 / std::max<int64_t>(1, values_per_token));
}
}  // namespace

at::Tensor qkv_rope_kv_write(const at::Tensor& qkv, int64_t Hq, int64_t Hk, int64_t D, const at::Tensor& q_norm,
                             double q_eps, const at::Tensor& k_norm, double k_eps, bool norm_offset,
                             const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), ld = qkv.stride(0);
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hk) * D, "qkv_rope_kv_write: qkv has ", qkv.size(1), " features, expected ",
              (Hq + 2 * Hk) * D);
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == Hk && k_cache.size(3) == D,
              "qkv_rope_kv_write: K and V caches [blocks, block_size, Hk, D] in the activation dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "qkv_rope_kv_write: int64 slots and positions, one per token");
  check_slots(slots, k_cache, "qkv_rope_kv_write");
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "qkv_rope_kv_write: cos and sin float32 [positions, head_dim], head_dim even");
  const bool normed = q_norm.defined();
  TORCH_CHECK(normed == k_norm.defined(), "qkv_rope_kv_write: q and k norms come together");
  if (normed)
    TORCH_CHECK(q_norm.scalar_type() == qkv.scalar_type() && k_norm.scalar_type() == qkv.scalar_type() &&
                    q_norm.is_contiguous() && k_norm.is_contiguous() && q_norm.numel() == D && k_norm.numel() == D,
                "qkv_rope_kv_write: q and k norm weights [head_dim] in the activation dtype");
  const int64_t elem = qkv.element_size();
  const char* q_src = static_cast<const char*>(qkv.data_ptr());
  const char* k_src = q_src + Hq * D * elem;
  const char* v_src = k_src + Hk * D * elem;
  RopeKvArgs a{};
  RopeArgs& r = a.rope;
  r.fmt = act_fmt(qkv);
  r.Hq = Hq;
  r.Hk = Hk;
  r.D = D;
  r.positions = positions.data_ptr<int64_t>();
  r.cos = cos.data_ptr<float>();
  r.sin = sin.data_ptr<float>();
  at::Tensor qn, kn;  // the normed heads, contiguous, as rms_norm returns them
  if (normed) {
    qn = at::empty({T, Hq, D}, qkv.options());
    kn = at::empty({T, Hk, D}, qkv.options());
    r.q = qn.data_ptr();
    r.k = kn.data_ptr();
    r.ldq = Hq * D;
    r.ldk = Hk * D;
  } else {
    r.q = q_src;
    r.k = k_src;
    r.ldq = ld;
    r.ldk = ld;
  }
  at::Tensor qo = at::empty({T, Hq, D}, qkv.options());
  r.q_out = qo.data_ptr();
  a.v = v_src;
  a.ldv = ld;
  a.k_dst = k_cache.data_ptr();
  a.v_dst = v_cache.data_ptr();
  a.dst_rows = slots.data_ptr<int64_t>();
  NormArgs qa{}, ka{};  // one token's heads are rows D apart
  for (NormArgs* n : {&qa, &ka}) {
    n->fmt = r.fmt;
    n->D = D;
    n->ldx = D;
    n->offset = norm_offset;
  }
  if (normed) {
    qa.weight = q_norm.data_ptr();
    qa.eps = static_cast<float>(q_eps);
    ka.weight = k_norm.data_ptr();
    ka.eps = static_cast<float>(k_eps);
  }
  const KernelTable& kt = kernels();
  parallel_chunks(T, prologue_grain((Hq + 2 * Hk) * D), [&](int64_t t0, int64_t t1) {
    if (normed) {
      for (int64_t t = t0; t < t1; ++t) {
        NormArgs qt = qa, kt_ = ka;
        qt.x = q_src + t * ld * elem;
        qt.out = static_cast<char*>(qn.data_ptr()) + t * Hq * D * elem;
        kt_.x = k_src + t * ld * elem;
        kt_.out = static_cast<char*>(kn.data_ptr()) + t * Hk * D * elem;
        kt.rms_norm(qt, 0, Hq);
        kt.rms_norm(kt_, 0, Hk);
      }
    }
    kt.rope_kv(a, t0, t1);
  });
  return qo;
}

at::Tensor qkv_rope_kv_write_op(const at::Tensor& qkv, int64_t Hq, int64_t Hk, int64_t D,
                                const c10::optional<at::Tensor>& q_norm, double q_eps,
                                const c10::optional<at::Tensor>& k_norm, double k_eps, bool norm_offset,
                                const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  return qkv_rope_kv_write(qkv, Hq, Hk, D, q_norm.value_or(at::Tensor()), q_eps, k_norm.value_or(at::Tensor()), k_eps,
                           norm_offset, positions, cos, sin, k_cache, v_cache, slots);
}

}  // namespace tokenmill
