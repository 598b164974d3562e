// Greedy sampling's argmax over fp32 logits rows. torch's argmax over [rows, vocab] ran at
// ~3 GB/s on the AMX Xeon: 1.0 ms a decode step for 16 rows of SmolLM2's 49,152 logits and
// 4.9 ms for Gemma 3's 262,144, where the head that wrote them took 3.2 and ~20. Here the
// kernel table's row_max takes the maxima of the rows' chunks (SIMD, two in flight), and
// each row's first index of its maximum is found in the first chunk that holds it, so that
// ties keep torch's answer (the lowest index).
#include <vector>

#include "ops.h"

namespace tokenmill {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be fp32 [rows, cols > 0] with contiguous rows");
  const int64_t R = x.size(0), C = x.size(1);
  constexpr int64_t kChunk = 4096;               // 16 KB of a row per task
  constexpr int64_t kParallelFloats = 1 << 21;  // 8 MB of logits
  const int64_t chunks = (C + kChunk - 1) / kChunk;
  std::vector<float> maxima(R * chunks);
  std::vector<uint8_t> nonfinite(R * chunks);
  const float* xp = x.data_ptr<float>();
  const RowMaxArgs a{xp, x.stride(0), C, kChunk, chunks, maxima.data(), nonfinite.data()};
  const KernelTable& k = kernels();
  // Split across threads only for large batches: on one thread the kernel takes 16 rows of
  // SmolLM2's logits in 0.15 ms (two: 0.09), and a served A/B with every batch split ran
  // 0.94x at 16 streams there; 16 rows of Gemma 3's take 1.25 ms on one thread, 0.46 on two.
  if (R * C < kParallelFloats) k.row_max(a, 0, R * chunks);
  else parallel_chunks(R * chunks, 2, [&](int64_t t0, int64_t t1) { k.row_max(a, t0, t1); });
  for (uint8_t f : nonfinite)
    if (f) return at::argmax(x, 1);  // NaN or inf somewhere: torch's order for them
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* m = maxima.data() + r * chunks;
    int64_t best = 0;
    for (int64_t c = 1; c < chunks; ++c)
      if (m[c] > m[best]) best = c;  // strictly: the first chunk holding the maximum
    const float* row = xp + r * x.stride(0);
    int64_t j = best * kChunk;
    while (row[j] != m[best]) ++j;  // the maximum is in this chunk
    o[r] = j;
  }
  return out;
}

}  // namespace tokenmill
