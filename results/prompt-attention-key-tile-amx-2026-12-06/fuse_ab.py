"""The one-pass softmax (softmax_row_bf16) against the five-pass one on the AVX-512-BF16 path, in one
process: it needs a scratch build whose prefill.h reads `fused = fast && !(a.softcap > 0) && !std::getenv("TM_NOFUSE")`
(not in the tree). TOKENMILL_CPU_ISA=avx512 PYTHONPATH=src .venv/bin/python fuse_ab.py {prefill|decode} BxN HQ,HKV,D"""
import os, statistics, sys, time, torch
from tokenmill import kernels
assert kernels.available()
torch.manual_seed(0); torch.set_num_threads(2)
mode = sys.argv[1]; B, N = map(int, sys.argv[2].split("x")); Hq, Hkv, D = map(int, sys.argv[3].split(","))
bs = 16; per = (N + bs - 1) // bs; nb = 2 * B * per
k = torch.randn(nb, bs, Hkv, D, dtype=torch.bfloat16); v = torch.randn(nb, bs, Hkv, D, dtype=torch.bfloat16)
bt = torch.randperm(nb)[: B * per].view(B, per).to(torch.int32); sc = torch.ones(2)
cl = torch.full((B,), N, dtype=torch.int32)
if mode == "prefill":
    q = torch.randn(B * N, Hq, D, dtype=torch.bfloat16); qs = torch.arange(0, B * N + 1, N, dtype=torch.int32)
    call = lambda: kernels.paged_prefill_attention(q, k, v, bt, cl, qs, D**-0.5, 0, sc)
else:
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    call = lambda: kernels.paged_decode_attention(q, k, v, bt, cl, D**-0.5, 0, sc)
outs = {}
for f in ("0", "1"):
    if f == "0": os.environ["TM_NOFUSE"] = "1"
    else: os.environ.pop("TM_NOFUSE", None)
    outs[f] = call().float()
print("diff", (outs["0"] - outs["1"]).abs().max().item())
ts = {"unfused": [], "fused": []}
for _ in range(int(os.environ.get("ROUNDS", 30))):
    for name in ts:
        if name == "unfused": os.environ["TM_NOFUSE"] = "1"
        else: os.environ.pop("TM_NOFUSE", None)
        s = time.perf_counter(); call(); ts[name].append(time.perf_counter() - s)
a, b = statistics.median(ts["unfused"]), statistics.median(ts["fused"])
print(f"{os.environ.get('TOKENMILL_CPU_ISA','auto')} {mode} {sys.argv[2]} {sys.argv[3]}: unfused {a*1e3:.3f} ms fused {b*1e3:.3f} ms x{a/b:.2f}")
