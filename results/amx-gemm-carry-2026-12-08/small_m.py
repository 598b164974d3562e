import sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import amx_layout
kernels.ops.load()
torch.manual_seed(0)
shapes = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]
layers = []
for l in range(16):
    for N, K in shapes:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s = torch.rand(N) * 0.01 + 1e-3
        layers.append((N, K, amx_layout.pack_int8(q), amx_layout.block_channels(s), amx_layout.block_channels(q.sum(1, dtype=torch.int32))))
xs = {}
def run(M, op):
    t = time.perf_counter()
    for N, K, tiles, sc, rs in layers:
        x = xs[(M, K)]
        op(x, tiles, sc, rs, None, N)
    return time.perf_counter() - t
res = {}
for M in (2, 4, 8, 16, 32, 64):
    for K in (1024, 2816):
        xs[(M, K)] = torch.randn(M, K).bfloat16()
    ta, tv = [], []
    for r in range(7):
        kernels.set_isa("amx"); ta.append(run(M, kernels.linear_int8_amx))
        kernels.set_isa("avx512"); tv.append(run(M, kernels.linear_int8_vnni))
    ta.sort(); tv.sort()
    print(f"M={M:3d} amx {ta[3]*1e3:7.2f} ms  vnni {tv[3]*1e3:7.2f} ms  vnni/amx {tv[3]/ta[3]:.2f}  (weights {sum(l[2].numel() for l in layers)/1e6:.0f} MB)", flush=True)
kernels.set_isa("auto")
