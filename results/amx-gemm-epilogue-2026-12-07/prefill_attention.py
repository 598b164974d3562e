import sys, time, torch
sys.path.insert(0,'/work/main/benchmarks')
import tokenmill
from tokenmill import kernels
from tokenmill.model import attention
from tokenmill.model.attention_backend import BatchGroup, StepBatch, TorchSDPABackend
kernels.ops.load()
BLOCK, KV_HEADS, HEADS, HEAD_DIM = 16, 4, 16, 64
prefix, new = 0, 1024
reps=int(sys.argv[1]) if len(sys.argv)>1 else 30
ctx=prefix+new; width=-(-ctx//BLOCK); pool=width+8
torch.manual_seed(0)
k_cache=torch.randn(pool,BLOCK,KV_HEADS,HEAD_DIM).bfloat16(); v_cache=torch.randn(pool,BLOCK,KV_HEADS,HEAD_DIM).bfloat16()
table=torch.randperm(pool)[:width].tolist()
group=BatchGroup(False,[list(range(new))],[list(range(prefix,ctx))],[table],[ctx])
meta=TorchSDPABackend(torch.device("cpu")).build_metadata(StepBatch([0]*new,[group],new))
q=torch.randn(new,HEADS,HEAD_DIM).bfloat16()
attention.PREFILL_KERNEL=True
f=lambda: attention.paged_attention(q,k_cache,v_cache,meta,0.125,None)
for _ in range(3): f()
ts=[]
for _ in range(reps):
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
ts.sort(); print(f"prefill 1024: min {ts[0]*1e3:.3f} med {ts[len(ts)//2]*1e3:.3f} ms")
