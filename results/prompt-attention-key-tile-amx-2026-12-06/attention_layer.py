"""One layer's paged prompt attention in the tree on PYTHONPATH: B sequences of N fresh
tokens, bf16, 16-token blocks scattered over the pool, median of 15 calls (2 threads).

    PYTHONPATH=TREE/src .venv/bin/python attention_layer.py BxN HQ,HKV,D [WINDOW]
"""

import statistics
import sys
import time

import torch

from tokenmill import kernels

assert kernels.available()
torch.manual_seed(0)
torch.set_num_threads(2)
B, N = map(int, sys.argv[1].split("x"))
Hq, Hkv, D = map(int, sys.argv[2].split(","))
window = int(sys.argv[3]) if len(sys.argv) > 3 else 0
bs = 16
per = (N + bs - 1) // bs
nblocks = 2 * B * per
k_cache = torch.randn(nblocks, bs, Hkv, D, dtype=torch.bfloat16)
v_cache = torch.randn(nblocks, bs, Hkv, D, dtype=torch.bfloat16)
bt = torch.randperm(nblocks)[: B * per].view(B, per).to(torch.int32)
q = torch.randn(B * N, Hq, D, dtype=torch.bfloat16)
cl = torch.full((B,), N, dtype=torch.int32)
qs = torch.arange(0, B * N + 1, N, dtype=torch.int32)
sc = torch.ones(2)


def call() -> torch.Tensor:
    return kernels.paged_prefill_attention(q, k_cache, v_cache, bt, cl, qs, D**-0.5, window, sc)


call()
ts = []
for _ in range(15):
    start = time.perf_counter()
    call()
    ts.append(time.perf_counter() - start)
print(f"{sys.argv[1]} heads {Hq}/{Hkv} dim {D} window {window}: {statistics.median(ts) * 1e3:.3f} ms")
