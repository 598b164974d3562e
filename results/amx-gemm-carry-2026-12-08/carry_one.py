import os, sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
N, K = int(sys.argv[1]), int(sys.argv[2])
for M in (256, 512, 1024):
    x = torch.randn(M, K).bfloat16()
    p = gemv_layout.pack((torch.randn(N, K) * 0.02).bfloat16())
    f = lambda: kernels.gemv_bf16(x, p, N, None)
    res = {"flush": [], "carry": []}
    for rep in range(60):
        for m in (("flush", "carry") if rep % 2 == 0 else ("carry", "flush")):
            if m == "flush": os.environ["TM_NO_CARRY2"] = "1"
            else: os.environ.pop("TM_NO_CARRY2", None)
            f(); t = time.perf_counter(); f(); f(); res[m].append((time.perf_counter() - t) / 2)
    a, b = sorted(res["flush"])[30], sorted(res["carry"])[30]
    print(f"{N}x{K} M={M} flush {a*1e3:.3f} carry {b*1e3:.3f} ratio {b/a:.3f}")
