"""int4 groups of 32 in 8 channels on AMX: the VNNI kernel against GEMV blocks rebuilt + the bf16
tiles (kernels.gemv_bf16), 16-192 rows, SmolLM2's projection shapes, medians of 15 alternating calls.

    PYTHONPATH=src .venv/bin/python results/int4-prompt-rows-amx-2026-12-07/int4_rows_amx.py
"""
import torch, time, statistics
from tokenmill.kernels import build; assert build.load()
from tokenmill import kernels
from tokenmill.model.quant_int4 import Int4Linear
torch.manual_seed(0)
for (N, K) in [(3072, 576), (960, 576), (576, 1536)]:
    L = Int4Linear(torch.randn(N, K, dtype=torch.bfloat16), None, 32)
    args = (L.packed, L.kernel_scales, L.kernel_offsets)
    for M in (16, 32, 48, 64, 96, 128, 192):
        x = torch.randn(M, K).bfloat16()
        fs = {"vnni": lambda: kernels.linear_int4_x8(x, *args, None, N),
              "blocks": lambda: kernels.gemv_bf16(x, kernels.dequantize_int4_x8_blocks(*args, N, K), N, None)}
        res = {k: [] for k in fs}
        for _ in range(15):
            for k, f in fs.items():
                t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        print(f"{N}x{K} M={M}: vnni {med['vnni']:.3f} blocks {med['blocks']:.3f} ratio {med['blocks']/med['vnni']:.2f}", flush=True)
