// RoPE fused with the paged KV-cache write: per token, the query heads are rotated into
// q_out, and the key heads are rotated and the value heads copied straight into the
// token's cache slot, so K never lands in a temporary and the two index_copy_ calls of
// the torch path (model/attention.py write_kv) go away. Included after common.h (its
// rope_head does the rotation, so the rounding is the plain RoPE kernel's).
#pragma once
#include <cstdint>
#include <cstring>
#include "kernels.h"

namespace {

template <int FMT>
void rope_kv_impl(const tokenmill::RopeKvArgs& a, int64_t t0, int64_t t1) {
  const tokenmill::RopeArgs& r = a.rope;
  const int64_t D = r.D, row_elems = r.Hk * D;
  const int64_t elem = FMT == tokenmill::F32 ? 4 : 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = r.cos + r.positions[t] * D;
    const float* s = r.sin + r.positions[t] * D;
    for (int64_t hd = 0; hd < r.Hq; ++hd)
      rope_head<FMT>(r.q, t * r.ldq + hd * D, r.q_out, (t * r.Hq + hd) * D, c, s, D);
    const int64_t row = (a.dst_rows ? a.dst_rows[t] : t) * row_elems;
    for (int64_t hd = 0; hd < r.Hk; ++hd) rope_head<FMT>(r.k, t * r.ldk + hd * D, a.k_dst, row + hd * D, c, s, D);
    if (a.v_dst)  // heads are contiguous within a token: one copy of Hk * D elements
      std::memcpy(static_cast<char*>(a.v_dst) + row * elem, static_cast<const char*>(a.v) + t * a.ldv * elem,
                  row_elems * elem);
  }
}

void rope_kv_kernel(const tokenmill::RopeKvArgs& a, int64_t t0, int64_t t1) {
  if (a.rope.fmt == tokenmill::BF16) rope_kv_impl<tokenmill::BF16>(a, t0, t1);
  else rope_kv_impl<tokenmill::F32>(a, t0, t1);
}

}  // namespace
