import sys, time
import tokenmill
import torch
from tokenmill import kernels
from tokenmill.kernels import amx_layout
kernels.ops.load()
torch.manual_seed(0)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
shapes = {'qkv': (1536, 1024), 'gate_up': (5632, 1024), 'down': (1024, 2816), 's_gu': (3072, 576), 's_down': (576, 1536)}
def bench(f, n=21):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2], ts and sorted(ts)[0]
out = []
for name, (N, K) in shapes.items():
    x = torch.randn(M, K).bfloat16()
    w = torch.randn(N, K) * 0.02
    s = w.abs().amax(1) / 127
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    tiles = amx_layout.pack_int8(q)
    sc = amx_layout.block_channels(s.float()); rs = amx_layout.block_channels(q.sum(1, dtype=torch.int32))
    med, mn = bench(lambda: kernels.linear_int8_amx(x, tiles, sc, rs, None, N))
    out.append(f"{name} {med*1e3:.2f}/{mn*1e3:.2f}")
print(sys.argv[2] if len(sys.argv) > 2 else "", " ".join(out))
