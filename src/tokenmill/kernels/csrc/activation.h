// The gated MLP's activations over one Vec of gate values, in torch's order of operations
// (rounding to the dtype is the caller's): the layered kernels (common.h's silu_mul and
// gelu_tanh_mul) and the AMX GEMM's gated epilogue (amx.cpp) compute them with these same
// instructions, so the fused projection gives the layered path's bits.
// Included after a Vec header (vec_avx512.h or vec_avx2.h); internal linkage only.
#pragma once

namespace {

// SiLU: g / (1 + exp(-g)).
inline Vec::R silu(Vec::R g) {
  return Vec::div(g, Vec::add(Vec::set1(1.0f), Vec::exp(Vec::sub(Vec::zero(), g))));
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): no overflow at any x.
inline Vec::R tanh_vec(Vec::R x) {
  const Vec::R one = Vec::set1(1.0f);
  Vec::R ax = Vec::max(x, Vec::sub(Vec::zero(), x));
  Vec::R e = Vec::exp(Vec::mul(ax, Vec::set1(-2.0f)));
  Vec::R t = Vec::div(Vec::sub(one, e), Vec::add(one, e));
  return Vec::copysign(t, x);
}

// GELU's tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
inline Vec::R gelu_tanh(Vec::R g) {
  const Vec::R cube = Vec::mul(Vec::mul(g, g), g);
  const Vec::R inner = Vec::mul(Vec::set1(0.7978845608028654f), Vec::add(g, Vec::mul(Vec::set1(0.044715f), cube)));
  return Vec::mul(Vec::mul(Vec::set1(0.5f), g), Vec::add(Vec::set1(1.0f), tanh_vec(inner)));
}

}  // namespace
