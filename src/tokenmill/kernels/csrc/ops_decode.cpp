// One decode step through a stack of decoder layers (model/fused_decode.py): pre-norm
// (Llama), sandwich-norm (Gemma 2/3) or post-norm (OLMo 2), with optional q/k norms per head
// (Qwen3, Gemma 3) or over all heads (OLMo 2),
// Gemma's 1 + weight norms, SiLU or GELU-tanh, a sliding window, a logit softcap and a
// RoPE table of the layer's own. The same ops as the Python layers call, in the same order
// on the same tensors (so the outputs are bit-identical), called from here: one stream's
// step made ~130 calls through Python and the dispatcher, with module and view overheads in
// between, ~15% of its time.
//
// The layers arrive once, at start-up, as a DecodeLayers object (a torch custom class)
// filled by name: add_layer takes a layer's fields, add_projection one projection's op and
// that op's arguments after x, each under its name in the op's schema. Names are read here
// once into plain structs; a missing or unknown name is an error then, not a wrong slot;
// an optional field is left out where a layer does not have it.
// Each step names the object by its handle, an int: a custom-class argument costs ~15 us a
// call in the Python dispatcher's argument parsing, more than the lists it replaced.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

// Named fields read once: each read marks its name, and done() rejects any name not read.
class Fields {
 public:
  Fields(std::string what, c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> ints,
         c10::Dict<std::string, double> floats = c10::Dict<std::string, double>(),
         c10::Dict<std::string, std::string> strings = c10::Dict<std::string, std::string>())
      : what_(std::move(what)),
        tensors_(std::move(tensors)),
        ints_(std::move(ints)),
        floats_(std::move(floats)),
        strings_(std::move(strings)) {}

  at::Tensor tensor(const std::string& name) {
    TORCH_CHECK(tensors_.contains(name), what_, ": no tensor '", name, "'");
    used_.insert(name);
    at::Tensor t = tensors_.at(name);
    TORCH_CHECK(t.defined(), what_, ": tensor '", name, "' is undefined");
    return t;
  }

  c10::optional<at::Tensor> maybe_tensor(const std::string& name) {
    if (!tensors_.contains(name)) return c10::nullopt;
    return tensor(name);
  }

  int64_t integer(const std::string& name) {
    TORCH_CHECK(ints_.contains(name), what_, ": no int '", name, "'");
    used_.insert(name);
    return ints_.at(name);
  }

  double real(const std::string& name) {
    TORCH_CHECK(floats_.contains(name), what_, ": no float '", name, "'");
    used_.insert(name);
    return floats_.at(name);
  }

  std::string string(const std::string& name) {
    TORCH_CHECK(strings_.contains(name), what_, ": no string '", name, "'");
    used_.insert(name);
    return strings_.at(name);
  }

  void done() const {
    for (const auto& e : tensors_) TORCH_CHECK(used_.count(e.key()), what_, ": unexpected tensor '", e.key(), "'");
    for (const auto& e : ints_) TORCH_CHECK(used_.count(e.key()), what_, ": unexpected int '", e.key(), "'");
    for (const auto& e : floats_) TORCH_CHECK(used_.count(e.key()), what_, ": unexpected float '", e.key(), "'");
    for (const auto& e : strings_) TORCH_CHECK(used_.count(e.key()), what_, ": unexpected string '", e.key(), "'");
  }

 private:
  std::string what_;
  c10::Dict<std::string, at::Tensor> tensors_;
  c10::Dict<std::string, int64_t> ints_;
  c10::Dict<std::string, double> floats_;
  c10::Dict<std::string, std::string> strings_;
  std::set<std::string> used_;
};

// A projection as its op is called: which op, and the op's arguments after x.
struct Projection {
  enum class Op { kNone, kGemvBf16, kGemvF32, kInt8Rows, kInt4Rows, kInt4X8, kInt8Amx, kInt4Amx, kInt8Vnni, kInt4Vnni };
  Op op = Op::kNone;
  at::Tensor weight;                   // the op's packed, weight or tiles
  at::Tensor scales, wsum, offsets;    // wsum: the int8 ops' wsum, the int4 tile ops' code_sums
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0, group_size = 0;

  // `op` by its registered name, its arguments by their schema names.
  static Projection parse(const std::string& what, const std::string& op, c10::Dict<std::string, at::Tensor> tensors,
                          c10::Dict<std::string, int64_t> ints) {
    Fields f(what + " (" + op + ")", std::move(tensors), std::move(ints));
    Projection p;
    if (op == "gemv_bf16" || op == "gemv_f32") {
      p.op = op == "gemv_bf16" ? Op::kGemvBf16 : Op::kGemvF32;
      p.weight = f.tensor("packed");
      p.out_features = f.integer("out_features");
    } else if (op == "linear_int8") {
      p.op = Op::kInt8Rows;
      p.weight = f.tensor("weight");
      p.scales = f.tensor("scales");
      p.wsum = f.tensor("wsum");
    } else if (op == "linear_int4") {
      p.op = Op::kInt4Rows;
      p.weight = f.tensor("weight");
      p.scales = f.tensor("scales");
      p.offsets = f.tensor("offsets");
      p.group_size = f.integer("group_size");
    } else if (op == "linear_int4_x8") {
      p.op = Op::kInt4X8;
      p.weight = f.tensor("packed");
      p.scales = f.tensor("scales");
      p.offsets = f.tensor("offsets");
      p.out_features = f.integer("out_features");
    } else if (op == "linear_int8_amx" || op == "linear_int8_vnni") {
      p.op = op == "linear_int8_amx" ? Op::kInt8Amx : Op::kInt8Vnni;
      p.weight = f.tensor("tiles");
      p.scales = f.tensor("scales");
      p.wsum = f.tensor("wsum");
      p.out_features = f.integer("out_features");
    } else if (op == "linear_int4_amx" || op == "linear_int4_vnni") {
      p.op = op == "linear_int4_amx" ? Op::kInt4Amx : Op::kInt4Vnni;
      p.weight = f.tensor("tiles");
      p.scales = f.tensor("scales");
      p.wsum = f.tensor("code_sums");
      p.offsets = f.tensor("offsets");
      p.group_size = f.integer("group_size");
      p.out_features = f.integer("out_features");
    } else {
      TORCH_CHECK(false, what, ": decode_layers does not call ", op);
    }
    p.bias = f.maybe_tensor("bias");
    f.done();
    return p;
  }

  // act(gate) * up of an MLP's [gate | up] projection: bf16 blocks fuse the activation into
  // the GEMM (gemv_bf16_act, the same bits); other weights run it after.
  at::Tensor gated(const at::Tensor& x, bool gelu_tanh) const {
    if (op == Op::kGemvBf16) return gemv_bf16_act(x, weight, out_features, bias, gelu_tanh ? "gelu_tanh" : "silu");
    const at::Tensor h = (*this)(x);
    return gelu_tanh ? gelu_tanh_and_mul(h) : silu_and_mul(h);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (op) {
      case Op::kGemvBf16: return gemv_bf16(x, weight, out_features, bias);
      case Op::kGemvF32: return gemv_f32(x, weight, out_features, bias);
      case Op::kInt8Rows: return linear_int8(x, weight, scales, wsum, bias);
      case Op::kInt4Rows: return linear_int4(x, weight, scales, offsets, group_size, bias);
      case Op::kInt4X8: return linear_int4_x8(x, weight, scales, offsets, bias, out_features);
      case Op::kInt8Amx:
      case Op::kInt8Vnni: return int8_tiles(x, weight, scales, wsum, bias, out_features, op == Op::kInt8Vnni, false);
      case Op::kInt4Amx:
      case Op::kInt4Vnni:
        return int4_tiles(x, weight, scales, wsum, offsets, group_size, bias, out_features, op == Op::kInt4Vnni);
      default: TORCH_CHECK(false, "decode_layers: a projection was never set");
    }
  }
};

// One RMSNorm: its weight (undefined: the layer has none here) and eps.
struct Norm {
  at::Tensor weight;
  double eps = 0.0;

  bool defined() const { return weight.defined(); }
};

struct Layer {
  // Pre-norm: input_norm before attention, post_attn_norm (with the residual add) before the
  // MLP. Sandwich (Gemma 2/3, pre_mlp_norm and post_mlp_norm set): post_attn_norm on the
  // attention output alone, pre_mlp_norm (with the residual add) before the MLP and
  // post_mlp_norm on its output. Post-norm (OLMo 2, no input_norm): the attention reads the
  // running state x + residual itself, post_attn_norm normalises its output before the add,
  // and post_mlp_norm the MLP's output. q_norm and k_norm (Qwen3, Gemma 3): per head, after
  // the q/k projections and before RoPE; qk_full (OLMo 2): over all heads at once.
  // norm_offset: every norm scales by 1 + weight (Gemma).
  Norm input_norm, post_attn_norm, pre_mlp_norm, post_mlp_norm, q_norm, k_norm;
  bool norm_offset = false, post_norm = false, qk_full = false;
  at::Tensor kv_scales;
  at::Tensor rope_cos, rope_sin;  // undefined: the step's tables (else this layer's own)
  int64_t num_heads, num_kv_heads, head_dim, window;  // window 0: full attention
  double scale, logit_softcap;  // softcap 0: none
  bool gelu_tanh = false;       // the MLP's activation: GELU-tanh, else SiLU
  Projection qkv, o, gate_up, down;
};

struct DecodeLayers;

// The live DecodeLayers objects by handle (weak: Python's reference keeps one alive).
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, c10::weak_intrusive_ptr<DecodeLayers>> objects;
  int64_t next = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: objects may outlive static teardown
  return *r;
}

// The layers decode_layers runs, in order (a torch custom class: tokenmill_cpu.DecodeLayers).
struct DecodeLayers : torch::CustomClassHolder {
  std::vector<Layer> layers;
  int64_t id = 0;  // its handle, once asked for

  // Called once the last strong reference is gone (the registry's weak one still holds the
  // memory): unlisted, so that the memory goes too.
  void release_resources() override {
    if (id == 0) return;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.objects.erase(id);
  }

  // The int that names this object to decode_layers (while Python holds the object).
  int64_t handle() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (id == 0) {
      id = r.next++;
      r.objects.emplace(id, c10::weak_intrusive_ptr<DecodeLayers>(c10::intrusive_ptr<DecodeLayers>::reclaim_copy(this)));
    }
    return id;
  }

  // The object a handle names, held for the call (an error once it was freed).
  static c10::intrusive_ptr<DecodeLayers> find(int64_t handle) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.objects.find(handle);
    c10::intrusive_ptr<DecodeLayers> found;
    if (it != r.objects.end()) found = it->second.lock();
    TORCH_CHECK(found.defined(), "decode_layers: no DecodeLayers object with handle ", handle, " (freed?)");
    return found;
  }

  void add_layer(c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> ints,
                 c10::Dict<std::string, double> floats, c10::Dict<std::string, std::string> strings) {
    const std::string what = "decode_layers: layer " + std::to_string(layers.size());
    Fields f(what, std::move(tensors), std::move(ints), std::move(floats), std::move(strings));
    const auto norm_of = [&f](const std::string& name, bool required) {
      Norm n;
      const c10::optional<at::Tensor> w = required ? f.tensor(name + "_weight") : f.maybe_tensor(name + "_weight");
      if (w.has_value()) {
        n.weight = *w;
        n.eps = f.real(name + "_eps");
      }
      return n;
    };
    Layer y;
    y.input_norm = norm_of("input_norm", false);
    y.post_attn_norm = norm_of("post_attn_norm", true);
    y.pre_mlp_norm = norm_of("pre_mlp_norm", false);
    y.post_mlp_norm = norm_of("post_mlp_norm", false);
    y.q_norm = norm_of("q_norm", false);
    y.k_norm = norm_of("k_norm", false);
    TORCH_CHECK(y.q_norm.defined() == y.k_norm.defined(), what, ": q_norm and k_norm come together");
    const std::string placement = f.string("norm_placement");
    TORCH_CHECK(placement == "pre" || placement == "sandwich" || placement == "post", what,
                ": norm_placement must be pre, sandwich or post, got ", placement);
    y.post_norm = placement == "post";
    TORCH_CHECK(y.input_norm.defined() != y.post_norm, what, ": an input_norm comes with pre and sandwich norms only");
    TORCH_CHECK(y.pre_mlp_norm.defined() == (placement == "sandwich"), what,
                ": pre_mlp_norm comes with sandwich norms only");
    TORCH_CHECK(y.post_mlp_norm.defined() == (placement != "pre"), what,
                ": post_mlp_norm comes with sandwich and post norms");
    y.qk_full = f.integer("qk_norm_full") != 0;
    y.norm_offset = f.integer("norm_offset") != 0;
    y.kv_scales = f.tensor("kv_scales");
    const c10::optional<at::Tensor> cos = f.maybe_tensor("rope_cos"), sin = f.maybe_tensor("rope_sin");
    TORCH_CHECK(cos.has_value() == sin.has_value(), what, ": rope_cos and rope_sin come together");
    if (cos.has_value()) {
      y.rope_cos = *cos;
      y.rope_sin = *sin;
    }
    y.num_heads = f.integer("num_heads");
    y.num_kv_heads = f.integer("num_kv_heads");
    y.head_dim = f.integer("head_dim");
    y.window = f.integer("window");
    y.scale = f.real("scale");
    y.logit_softcap = f.real("logit_softcap");
    const std::string act = f.string("activation");
    TORCH_CHECK(act == "silu_and_mul" || act == "gelu_tanh_and_mul", what,
                ": activation must be silu_and_mul or gelu_tanh_and_mul, got ", act);
    y.gelu_tanh = act == "gelu_tanh_and_mul";
    f.done();
    layers.push_back(std::move(y));
  }

  // The last added layer's projection `name` (qkv, o, gate_up or down).
  void add_projection(const std::string& name, const std::string& op, c10::Dict<std::string, at::Tensor> tensors,
                      c10::Dict<std::string, int64_t> ints) {
    TORCH_CHECK(!layers.empty(), "decode_layers: add_projection before any add_layer");
    Layer& y = layers.back();
    const std::string what = "decode_layers: layer " + std::to_string(layers.size() - 1) + " projection " + name;
    Projection* p = name == "qkv" ? &y.qkv : name == "o" ? &y.o : name == "gate_up" ? &y.gate_up
                  : name == "down" ? &y.down : nullptr;
    TORCH_CHECK(p != nullptr, what, ": expected qkv, o, gate_up or down");
    *p = Projection::parse(what, op, std::move(tensors), std::move(ints));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
};

// The attention of one layer from its qkv rows through the layered ops: narrowed q, k, v,
// the q/k norms (over all heads, or per head through a reshaped copy), rope_kv_write (any
// cache dtype, fp8 by the layer's scales), then decode attention.
at::Tensor layered_prologue_attention(const Layer& y, const at::Tensor& qkv, int64_t T, const at::Tensor& positions,
                                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                      const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const int64_t Hq = y.num_heads, Hkv = y.num_kv_heads, D = y.head_dim;
  const int64_t q_size = Hq * D, kv_size = Hkv * D;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: qkv has ", qkv.size(1), " features, expected ",
              q_size + 2 * kv_size);
  const auto alone = [&y](const at::Tensor& h, const Norm& n) {
    return std::get<0>(norm(h, nullptr, n.weight, n.eps, y.norm_offset));
  };
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, Hq, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  if (y.q_norm.defined() && y.qk_full) {  // over all heads, as RMSNorm on q's [T, Hq * D]
    q = alone(qkv.narrow(1, 0, q_size), y.q_norm).view({T, Hq, D});
    k = alone(qkv.narrow(1, q_size, kv_size), y.k_norm).view({T, Hkv, D});
  } else if (y.q_norm.defined()) {  // per head, as RMSNorm on [T, H, D] (kernels.rms_norm's rows)
    q = alone(q.reshape({-1, D}), y.q_norm).view({T, Hq, D});
    k = alone(k.reshape({-1, D}), y.k_norm).view({T, Hkv, D});
  }
  q = rope_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, y.kv_scales);
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, y.scale, y.window, y.kv_scales,
                                y.logit_softcap);
}

// x [T, hidden] is the embedded batch (residual None) or, with residual, the running state
// x + residual; returns (x, residual) after the last layer, for the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::TensorList k_caches, at::TensorList v_caches,
    int64_t handle) {
  const c10::intrusive_ptr<DecodeLayers> stack = DecodeLayers::find(handle);
  const std::vector<Layer>& layers = stack->layers;
  const size_t L = layers.size();
  TORCH_CHECK(k_caches.size() == L && v_caches.size() == L, "decode_layers: ", L, " layers need ", L,
              " K and V caches, got ", k_caches.size(), " and ", v_caches.size());
  at::Tensor x = x_in, residual = residual_in.has_value() ? *residual_in : at::Tensor();
  const int64_t T = x.size(0);
  // Once a step, not once a layer: the positions and slots as int64 (rope_kv_write's own
  // conversions and checks cost a few ATen calls each, on one thread, every layer).
  const at::Tensor pos = positions.to(at::kLong).contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slots.numel() == T, "decode_layers: one position and one slot per token");
  for (size_t l = 0; l < L; ++l) {
    const Layer& y = layers[l];
    const int64_t Hq = y.num_heads, Hkv = y.num_kv_heads, D = y.head_dim;
    // RMSNorm of h alone (as RMSNorm(h) returns it), or of h + residual (the new residual too).
    const auto alone = [&y](const at::Tensor& h, const Norm& n) {
      return std::get<0>(norm(h, nullptr, n.weight, n.eps, y.norm_offset));
    };
    const auto with_residual = [&y, &residual](const at::Tensor& h, const Norm& n) {
      at::Tensor out;
      std::tie(out, residual) = norm(h, &residual, n.weight, n.eps, y.norm_offset);
      return out;
    };
    at::Tensor h;
    if (y.post_norm) {  // the layer reads the running state itself, as DecoderLayer does
      h = residual.defined() ? at::add(x, residual) : x;
      residual = h;
    } else if (residual.defined()) {
      h = with_residual(x, y.input_norm);
    } else {
      h = alone(x, y.input_norm);
      residual = x;
    }
    const at::Tensor qkv = y.qkv(h);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    const bool own_rope = y.rope_cos.defined();
    const at::Tensor& rope_cos = own_rope ? y.rope_cos : cos;
    const at::Tensor& rope_sin = own_rope ? y.rope_sin : sin;
    if (!y.qk_full && k_cache.scalar_type() == qkv.scalar_type()) {
      // The norms, RoPE and KV write on qkv's rows in one parallel region: the bits of
      // layered_prologue_attention's ops, which a cache of another dtype or norms over all
      // heads still take.
      const at::Tensor q = qkv_rope_kv_write(qkv, Hq, Hkv, D, y.q_norm.weight, y.q_norm.eps, y.k_norm.weight,
                                             y.k_norm.eps, y.norm_offset, pos, rope_cos, rope_sin, k_cache, v_cache,
                                             slots);
      h = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, y.scale, y.window, y.kv_scales,
                                 y.logit_softcap);
    } else {
      h = layered_prologue_attention(y, qkv, T, positions, rope_cos, rope_sin, k_cache, v_cache, slot_mapping,
                                     block_tables, context_lens);
    }
    h = y.o(h);
    if (y.post_norm) {
      residual = at::add(residual, alone(h, y.post_attn_norm));
      x = alone(y.down(y.gate_up.gated(residual, y.gelu_tanh)), y.post_mlp_norm);
      continue;
    }
    const bool sandwich = y.pre_mlp_norm.defined();
    if (sandwich) h = alone(h, y.post_attn_norm);
    h = with_residual(h, sandwich ? y.pre_mlp_norm : y.post_attn_norm);
    x = y.down(y.gate_up.gated(h, y.gelu_tanh));
    if (sandwich) x = alone(x, y.post_mlp_norm);
  }
  return {x, residual};
}

}  // namespace

void register_decode_layers(torch::Library& m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_projection", &DecodeLayers::add_projection)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("handle", &DecodeLayers::handle);
  m.def("decode_layers(Tensor x, Tensor? residual, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "int layers) -> (Tensor, Tensor)");
  m.impl("decode_layers", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(decode_layers)));
}

}  // namespace tokenmill
