import time, statistics, sys, torch
from torch.utils.cpp_extension import load
ext = load("tm_brg", [str(__import__("pathlib").Path(__file__).with_name("brg.cpp"))], extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src"))
from tokenmill.kernels import build; assert build.load()
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
torch.set_num_threads(2)
print("could_pack", ext.can_pack())
def pack32(w):  # [N, K] -> [N/32, K/2, 32, 2]
    N, K = w.shape
    return w.view(N // 32, 32, K // 2, 2).permute(0, 2, 1, 3).contiguous()
for M in (2048, 256):
  for N, K in [(3072, 576), (960, 576), (576, 1536)]:
    w = (torch.randn(N, K) * 0.05).bfloat16(); x = torch.randn(M, K).bfloat16()
    p16 = gemv_layout.pack(w); p32 = pack32(w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    fs = {"ours": lambda: kernels.gemv_bf16(x, p16, N, None)}
    for mb in (32, 64):
        fs[f"brg16 m{mb}"] = lambda mb=mb: ext.brg(x, p16, N, 16, mb)
        fs[f"brg32 m{mb}"] = lambda mb=mb: ext.brg(x, p32, N, 32, mb)
    wp = torch.ops.mkldnn._reorder_linear_weight(w, M)
    fs["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    for k, f in fs.items():
        err = (f().float() - ref).abs().max().item()
        assert err < 0.05 * ref.abs().max().item() + 0.1, (k, err)
    res = {k: [] for k in fs}
    for i in range(20):
        for k, f in fs.items():
            t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
    fl = 2 * M * N * K
    print(f"{N}x{K}@{M}: " + " | ".join(f"{k} {fl / statistics.median(v) / 1e12:.2f}TF" for k, v in res.items()), flush=True)
