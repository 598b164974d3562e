import sys, time, torch
import tokenmill
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
out=[]
for M,N,K,act in ((1024,3072,576,'silu'),(1024,4096,640,'gelu_tanh'),(16,3072,576,'silu'),(16,4096,640,'gelu_tanh'),(16,5632,1024,'silu')):
    x=torch.randn(M,K).bfloat16()
    w=torch.randn(N,K).bfloat16()*0.02; p=gemv_layout.pack(w)
    f=lambda: kernels.gemv_bf16_act(x,p,N,None,act)
    for _ in range(5): f()
    ts=[]
    for _ in range(200 if M<100 else 40):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort()
    out.append(f"{M}x{N}x{K} {ts[0]*1e3:.3f}/{ts[len(ts)//2]*1e3:.3f}")
print(" | ".join(out))
