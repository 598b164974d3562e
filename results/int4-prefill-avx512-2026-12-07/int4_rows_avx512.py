# As int4_prefill_avx512.py, for int4 groups a GGUF file gives (codes, fp32 scales and offsets
# per group of 32: the "rows" layout and linear_int4, what `make run`'s SmolLM2 Q4_1 loads as):
# rows = linear_int4, fp32 = dequantize to fp32 + torch fp32 GEMM (the path from 512 rows),
# onednn = dequantize to bf16 + torch bf16 GEMM. Medians of 11 alternating calls (ms), 2 threads.
#   PYTHONPATH=src .venv/bin/python results/int4-prefill-avx512-2026-12-07/int4_rows_avx512.py
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
for N, K in [(3072, 576), (576, 1536), (960, 576)]:
    w = (torch.randn(N, K) * 0.05).bfloat16()
    codes = torch.randint(0, 16, (N, K))
    scale, low = torch.rand(N, K // 32) * 0.01, torch.rand(N, K // 32) - 0.5
    L = Int4Linear(w, None, 32, (codes, scale, low))
    assert L.kernel == "rows", L.kernel
    args = (L.packed, L.kernel_scales, L.kernel_offsets, 32)
    for M in (64, 256, 512, 1024):
        x = torch.randn(M, K).bfloat16()
        fs = {
            "rows": lambda: kernels.linear_int4(x, *args, None),
            "fp32": lambda: F.linear(x.float(), kernels.dequantize_int4(*args, K)).bfloat16(),
            "onednn": lambda: F.linear(x, kernels.dequantize_int4(*args, K).bfloat16()),
        }
        res = {k: [] for k in fs}
        for _ in range(11):
            for k, f in fs.items():
                t = time.perf_counter()
                f()
                res[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        print(f"smollm2 {N}x{K} M={M}: " + " ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
