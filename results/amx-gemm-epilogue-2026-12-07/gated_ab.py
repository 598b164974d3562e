import sys, time, torch
import tokenmill
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
kernels.ops.load()
torch.manual_seed(0)
M=int(sys.argv[1]) if len(sys.argv)>1 else 1024
N,K=int(sys.argv[2]) if len(sys.argv)>2 else 5632, int(sys.argv[3]) if len(sys.argv)>3 else 1024
x=torch.randn(M,K).bfloat16()
w=torch.randn(N,K).bfloat16()*0.02; p=gemv_layout.pack(w)
out=[]
for act in (1,0):
    f=(lambda: kernels.gemv_bf16_act(x,p,N,None,'silu')) if act else (lambda: kernels.gemv_bf16(x,p,N,None))
    for _ in range(3): f()
    ts=[]
    for _ in range(60):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort()
    out.append(f"{'act' if act else 'noact'} min {ts[0]*1e3:.2f} med {ts[30]*1e3:.2f}")
print(" | ".join(out))
