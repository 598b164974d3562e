import sys, time, torch
import tokenmill
from tokenmill import kernels
from tokenmill.kernels import ops, gemv_layout
ops.load() if hasattr(ops,'load') else None
torch.manual_seed(0)
M=int(sys.argv[1]) if len(sys.argv)>1 else 1024
shapes={'qkv':(1536,1024),'o':(1024,1024),'gate_up':(5632,1024),'down':(1024,2816)}
x={K:torch.randn(M,K).bfloat16() for K in (1024,2816)}
tot=0
for name,(N,K) in shapes.items():
    w=torch.randn(N,K).bfloat16()*0.02
    p=gemv_layout.pack(w)
    if name=='gate_up':
        f=lambda: kernels.gemv_bf16_act(x[K],p,N,None,'silu')
    else:
        f=lambda: kernels.gemv_bf16(x[K],p,N,None)
    for _ in range(3): f()
    ts=[]
    for _ in range(15):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    t=sorted(ts)[len(ts)//2]
    tot+=t
    print(f"{name:8s} {N}x{K} {t*1e3:7.2f} ms {2*M*N*K/t/1e12:5.2f} TF/s")
print(f"layer {tot*1e3:.2f} ms x16 = {tot*16e3:.0f} ms")
N,K=5632,1024
w=torch.randn(N,K).bfloat16()*0.02; p=gemv_layout.pack(w)
for nm,f in (('gu-noact',lambda: kernels.gemv_bf16(x[K],p,N,None)),('gu-act',lambda: kernels.gemv_bf16_act(x[K],p,N,None,'silu'))):
    for _ in range(3): f()
    ts=[]
    for _ in range(15):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    t=sorted(ts)[len(ts)//2]
    print(f"{nm:8s} {t*1e3:7.2f} ms {2*M*N*K/t/1e12:5.2f} TF/s")
