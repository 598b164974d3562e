#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[M, N] bf16 = x[M, K] @ W^T, W in [N/NB, K/2, NB, 2] blocks (NB = 16 or 32), via oneDNN's
// brgemm ukernel; rows in chunks of `mb`, 256-row passes, blocks split over threads.
torch::Tensor brg(torch::Tensor x, torch::Tensor w, int64_t N, int64_t nb, int64_t mb) {
  const int64_t M = x.size(0), K = x.size(1), blocks = N / nb;
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const at::BFloat16*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  for (int64_t r0 = 0; r0 < M; r0 += 256) {
    const int64_t rows = std::min<int64_t>(256, M - r0);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      alignas(64) float c[64 * 32];
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t m0 = 0; m0 < rows; m0 += mb) {
          const int64_t m = std::min<int64_t>(mb, rows - m0);
          at::native::cpublas::brgemm(m, nb, K, K, nb, nb, false, xp + (r0 + m0) * K, wp + b * K * nb, c);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < nb; j += 16)
              _mm256_storeu_si256((__m256i*)(yp + (r0 + m0 + i) * N + b * nb + j),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + i * nb + j)));
        }
      }
      at::native::cpublas::brgemm_release();
    });
  }
  return y;
}

bool can_pack() { return at::native::cpublas::could_pack(at::kBFloat16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("brg", &brg);
  m.def("can_pack", &can_pack);
}
