import os, sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
values = sys.argv[2].split(",") if len(sys.argv) > 2 else ["2", "8"]
cases = [('qkv', 1536, 1024, None), ('o', 1024, 1024, None), ('gate_up', 5632, 1024, 'silu'), ('down', 1024, 2816, None),
         ('s_qkv', 960, 576, None), ('s_gu', 3072, 576, 'silu'), ('s_down', 576, 1536, None), ('g_gu', 4096, 640, 'gelu_tanh')]
data = []
for name, N, K, act in cases:
    x = torch.randn(M, K).bfloat16()
    p = gemv_layout.pack((torch.randn(N, K) * 0.02).bfloat16())
    f = (lambda x=x, p=p, N=N, act=act: kernels.gemv_bf16_act(x, p, N, None, act)) if act else (lambda x=x, p=p, N=N: kernels.gemv_bf16(x, p, N, None))
    data.append((name, f))
res = {v: {n: [] for n, _ in data} for v in values}
for rep in range(int(os.environ.get("REPS", "15"))):
    for v in values[rep % len(values):] + values[:rep % len(values)]:
        os.environ["TM_TASK_BLOCKS"] = v
        for name, f in data:
            f()
            t = time.perf_counter(); f(); f(); f(); res[v][name].append((time.perf_counter() - t) / 3)
for name, _ in data:
    meds = {v: sorted(res[v][name])[len(res[v][name]) // 2] * 1e3 for v in values}
    print(f"{name:8s} " + "  ".join(f"{v}: {meds[v]:6.2f}" for v in values) + "   ratios " + " ".join(f"{meds[v]/meds[values[0]]:.3f}" for v in values[1:]))
