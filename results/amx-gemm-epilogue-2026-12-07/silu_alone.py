import time, torch
import tokenmill
from tokenmill import kernels
kernels.ops.load()
g=torch.randn(1024,5632).bfloat16()
f=lambda: kernels.silu_and_mul(g)
for _ in range(3): f()
ts=[]
for _ in range(20):
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
print("silu_and_mul", sorted(ts)[10]*1e3, "ms")
