// exp over a Vec type, written once for vec_avx2.h and vec_avx512.h: each Vec's exp calls
// exp_f32<Vec>, which needs its min, max, round_nearest, fnma, fma and scale_pow2 (p * 2^n).
// Internal linkage only, like the Vec structs.
#pragma once

namespace {

// exp with a degree-6 polynomial on [-ln2/2, ln2/2]: about 1 ulp in fp32.
template <class V>
inline typename V::R exp_f32(typename V::R x) {
  using R = typename V::R;
  x = V::max(V::min(x, V::set1(88.3762626647949f)), V::set1(-87.3365447505531f));
  const R n = V::round_nearest(V::mul(x, V::set1(1.44269504088896341f)));
  R r = V::fnma(n, V::set1(0.693359375f), x);
  r = V::fnma(n, V::set1(-2.12194440e-4f), r);
  R p = V::set1(1.9875691500E-4f);
  p = V::fma(p, r, V::set1(1.3981999507E-3f));
  p = V::fma(p, r, V::set1(8.3334519073E-3f));
  p = V::fma(p, r, V::set1(4.1665795894E-2f));
  p = V::fma(p, r, V::set1(1.6666665459E-1f));
  p = V::fma(p, r, V::set1(5.0000001201E-1f));
  p = V::fma(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::scale_pow2(p, n);
}

}  // namespace
