import os, sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
cases = [('qkv', 1536, 1024, None), ('o', 1024, 1024, None), ('gate_up', 5632, 1024, 'silu'), ('down', 1024, 2816, None),
         ('s_qkv', 960, 576, None), ('s_gu', 3072, 576, 'silu'), ('s_down', 576, 1536, None), ('g_qkv', 1280, 640, None), ('g_gu', 4096, 640, 'gelu_tanh'), ('g_down', 640, 2048, None)]
data = []
for name, N, K, act in cases:
    x = torch.randn(M, K).bfloat16()
    p = gemv_layout.pack((torch.randn(N, K) * 0.02).bfloat16())
    f = (lambda x=x, p=p, N=N, act=act: kernels.gemv_bf16_act(x, p, N, None, act)) if act else (lambda x=x, p=p, N=N: kernels.gemv_bf16(x, p, N, None))
    data.append((name, f))
modes = ["flush", "carry"]
res = {m: {n: [] for n, _ in data} for m in modes}
for rep in range(int(os.environ.get("REPS", "20"))):
    for m in (modes if rep % 2 == 0 else modes[::-1]):
        if m == "flush": os.environ["TM_NO_CARRY2"] = "1"
        else: os.environ.pop("TM_NO_CARRY2", None)
        for name, f in data:
            f(); t = time.perf_counter(); f(); f(); res[m][name].append((time.perf_counter() - t) / 2)
tot = {m: 0.0 for m in modes}
for name, _ in data:
    med = {m: sorted(res[m][name])[len(res[m][name]) // 2] * 1e3 for m in modes}
    for m in modes: tot[m] += med[m]
    print(f"{name:8s} flush {med['flush']:6.2f}  carry {med['carry']:6.2f}  carry/flush {med['carry']/med['flush']:.3f}")
print(f"sum      flush {tot['flush']:6.2f}  carry {tot['carry']:6.2f}  carry/flush {tot['carry']/tot['flush']:.3f}")
