"""One SmolLM2 layer's prompt attention (1024 fresh tokens, 9 q heads over 3 KV heads, head_dim 64,
bf16, 16-token blocks scattered over the pool): tokenmill's paged prefill kernel against torch's
causal flash SDPA on the same keys gathered contiguous, interleaved in one process.

    PYTHONPATH=src .venv/bin/python results/prompt-step-ops-vllm-amx-2026-12-06/attention_vs_sdpa.py [THREADS]
"""

import statistics
import sys
import time

import torch

from tokenmill import kernels

assert kernels.available(), "the tokenmill CPU kernels did not build here"
print(kernels.describe())
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
Hq, Hkv, D, N, bs, nblocks = 9, 3, 64, 1024, 16, 512
k_cache = torch.randn(nblocks, bs, Hkv, D, dtype=torch.bfloat16)
v_cache = torch.randn(nblocks, bs, Hkv, D, dtype=torch.bfloat16)
perm = torch.randperm(nblocks)[: N // bs]
bt = perm.view(1, -1).to(torch.int32)
q = torch.randn(N, Hq, D, dtype=torch.bfloat16)
cl = torch.tensor([N], dtype=torch.int32)
qs = torch.tensor([0, N], dtype=torch.int32)
sc = torch.ones(2)
kk = k_cache[perm].reshape(N, Hkv, D).transpose(0, 1).unsqueeze(0).contiguous()
vv = v_cache[perm].reshape(N, Hkv, D).transpose(0, 1).unsqueeze(0).contiguous()
qq = q.transpose(0, 1).unsqueeze(0).contiguous()


def ours() -> torch.Tensor:
    return kernels.paged_prefill_attention(q, k_cache, v_cache, bt, cl, qs, D**-0.5, 0, sc)


def sdpa() -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)


print("max diff", (ours().view(N, Hq, D).float() - sdpa()[0].transpose(0, 1).float()).abs().max().item())
flops = 4 * N * N / 2 * D * Hq
times: dict[str, list[float]] = {"ours": [], "sdpa": []}
for _ in range(15):
    for name, fn in (("ours", ours), ("sdpa", sdpa)):
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{name}: {m * 1e3:.2f} ms  {flops / m / 1e9:.0f} GFLOP/s")
