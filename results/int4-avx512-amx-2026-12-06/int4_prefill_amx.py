# Per projection (SmolLM2 shapes), int4 groups of 32 in 8 channels on the AMX Xeon, 2 threads, medians of 15 alternating calls (ms):
# x8 = linear_int4_x8, fp32 = dequantize to fp32 + torch fp32 GEMM, bf16 = dequantize to bf16 + torch bf16 GEMM (AMX), deq = the bf16 dequantize alone.
#   PYTHONPATH=src .venv/bin/python results/int4-avx512-amx-2026-12-06/int4_prefill_amx.py   (output: int4_prefill_amx.txt)
import time, statistics, torch, torch.nn.functional as F
from tokenmill import kernels
from tokenmill.kernels import build; build.load()
from tokenmill.model.quant_int4 import Int4Linear
torch.set_num_threads(2)
print(kernels.active_isa(), kernels.amx_bf16_active())
for N, K in [(3072, 576), (576, 1536), (960, 576)]:
    w = (torch.randn(N, K) * 0.05).bfloat16()
    L = Int4Linear(w, None, 32); print(L.kernel)
    args = (L.packed, L.kernel_scales, L.kernel_offsets)
    for M in (64, 128, 256, 512, 2048):
        x = torch.randn(M, K).bfloat16()
        fs = {
          "x8": lambda: kernels.linear_int4_x8(x, *args, None, N),
          "fp32": lambda: F.linear(x.float(), kernels.dequantize_int4_x8(*args, N, K)).bfloat16(),
          "bf16": lambda: F.linear(x, kernels.dequantize_int4_x8(*args, N, K, True)),
          "deq": lambda: kernels.dequantize_int4_x8(*args, N, K, True),
        }
        res = {k: [] for k in fs}
        for i in range(15):
            for k, f in fs.items():
                t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
        print(f"{N}x{K} M={M}: " + " ".join(f"{k} {statistics.median(v)*1e3:.2f}" for k, v in res.items()), flush=True)
