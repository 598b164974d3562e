# Per projection, int4 groups of 32 in 8 channels on AVX-512 BF16 without AMX (Zen 5), 2 threads,
# medians of 11 alternating calls (ms):
# x8 = linear_int4_x8 (the VNNI int4 kernel), fp32 = dequantize to fp32 + torch fp32 GEMM (the
# path from 512 rows before), blocks = dequantize to bf16 GEMV blocks + kernels.gemv_bf16 (the
# bf16 projections' own kernel), onednn = dequantize to bf16 rows + torch bf16 GEMM,
# deq = the blocks' dequantize alone.
#   PYTHONPATH=src .venv/bin/python results/int4-prefill-avx512-2026-12-07/int4_prefill_avx512.py
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import build

build.load()
from tokenmill.model.quant_int4 import Int4Linear  # noqa: E402

torch.set_num_threads(2)
print(kernels.active_isa(), "amx_bf16:", kernels.amx_bf16_active())
SHAPES = {
    "smollm2": [(3072, 576), (576, 1536), (960, 576)],
    "250m": [(5632, 1024), (1024, 2816), (1536, 1024)],
    "gemma3": [(4096, 640), (640, 2048), (1536, 640)],
}
for model, shapes in SHAPES.items():
    for N, K in shapes:
        w = (torch.randn(N, K) * 0.05).bfloat16()
        L = Int4Linear(w, None, 32)
        assert L.kernel == "channels8", L.kernel
        args = (L.packed, L.kernel_scales, L.kernel_offsets)
        for M in (16, 32, 64, 128, 256, 512, 1024):
            x = torch.randn(M, K).bfloat16()
            fs = {
                "x8": lambda: kernels.linear_int4_x8(x, *args, None, N),
                "fp32": lambda: F.linear(x.float(), kernels.dequantize_int4_x8(*args, N, K)).bfloat16(),
                "blocks": lambda: kernels.gemv_bf16(x, kernels.dequantize_int4_x8_blocks(*args, N, K), N, None),
                "onednn": lambda: F.linear(x, kernels.dequantize_int4_x8(*args, N, K, True)),
                "deq": lambda: kernels.dequantize_int4_x8_blocks(*args, N, K),
            }
            res = {k: [] for k in fs}
            for _ in range(11):
                for k, f in fs.items():
                    t = time.perf_counter()
                    f()
                    res[k].append(time.perf_counter() - t)
            med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
            print(
                f"{model} {N}x{K} M={M}: "
                + " ".join(f"{k} {v:.2f}" for k, v in med.items())
                + f"  blocks/x8 {med['blocks'] / med['x8']:.2f}",
                flush=True,
            )
