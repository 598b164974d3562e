import sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
M = int(sys.argv[1])
cases = [('qkv', 1536, 1024, None), ('gate_up', 5632, 1024, 'silu'), ('down', 1024, 2816, None),
         ('g_qkv', 1280, 640, None), ('g_gu', 4096, 640, 'gelu_tanh'), ('g_down', 640, 2048, None), ('g_head', 262144, 640, None)]
out = []
for name, N, K, act in cases:
    # 8 copies of the weight so that decode-size calls read it from memory, not L2
    ps = [gemv_layout.pack((torch.randn(N, K) * 0.02).bfloat16()) for _ in range(1 if N > 100000 else 8)]
    x = torch.randn(M, K).bfloat16()
    def f():
        for p in ps:
            (kernels.gemv_bf16_act(x, p, N, None, act) if act else kernels.gemv_bf16(x, p, N, None))
    for _ in range(3): f()
    ts = []
    for _ in range(31):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    out.append(f"{name} {sorted(ts)[15]*1e3/len(ps):.3f}")
print(sys.argv[2], ' '.join(out), flush=True)
