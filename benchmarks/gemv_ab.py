"""tokenmill's GEMV layout against prepacked oneDNN, per row count, for fp32 and bf16 weights.

``layers.gemv_layout_wanted`` packs every bf16/fp32 CPU projection for ``kernels.gemv_bf16``
/ ``gemv_f32`` when this says the kernel of the running ISA is no slower than oneDNN where it
matters (decode rows) and close at prefill sizes. Per 250M-Llama projection shape and row
count it times both paths on the same weights, interleaved round by round (medians), cycling
through enough weight copies to exceed the L3 cache so one-row cases read memory as a decode
step does. Ratios > 1 favour the GEMV.

    PYTHONPATH=src .venv/bin/python benchmarks/gemv_ab.py --threads 2
    TOKENMILL_CPU_ISA=avx2 PYTHONPATH=src .venv/bin/python benchmarks/gemv_ab.py  # the AVX2 table
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gemv_bandwidth import L3_BYTES, SHAPES

from tokenmill import kernels
from tokenmill.model.layers import Linear


def linears(k: int, n: int, dtype: torch.dtype, copies: int) -> dict[str, list[Linear]]:
    """Per path, ``copies`` Linear layers holding the same weight in that path's layout. The
    ``onednn`` path is what the loader does without the GEMV: prepacked oneDNN where it runs
    the dtype, else F.linear on the plain weight (bf16 on CPUs without AVX-512 BF16)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).mul_(0.02).to(dtype)
    out: dict[str, list[Linear]] = {"onednn": [], "gemv": []}
    for _ in range(copies):
        for path in out:
            lin = Linear(k, n)
            lin.weight.data = w.clone()
            if path == "gemv":
                assert lin.pack_for_gemv(), f"no GEMV for {dtype} ({kernels.describe()})"
            else:
                lin.pack_for_onednn()
            out[path].append(lin)
    return out


def time_round(mods: list[Linear], x: torch.Tensor, min_s: float) -> float:
    """ms per call, cycling through ``mods``."""
    calls, start = 0, time.perf_counter()
    while True:
        for m in mods:
            m(x)
        calls += len(mods)
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-s", type=float, default=0.1, help="seconds per case and round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {kernels.describe()}; threads {args.threads}")
    rows = [int(r) for r in args.rows.split(",")]
    print("| dtype | shape | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for shape in args.shapes.split(","):
            k, n = SHAPES[shape]
            copies = max(2, L3_BYTES // (k * n * dtype.itemsize))
            mods = linears(k, n, dtype, copies)
            cells = []
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                # many rows are compute-bound: a few copies keep the round short
                use = {p: v[: max(2, copies // m)] for p, v in mods.items()}
                times: dict[str, list[float]] = {p: [] for p in use}
                for r in range(args.rounds):
                    order = list(use) if r % 2 == 0 else list(reversed(use))
                    for p in order:
                        times[p].append(time_round(use[p], x, args.min_s))
                onednn, gemv = (statistics.median(times[p]) for p in ("onednn", "gemv"))
                cells.append(f"{onednn / gemv:.2f}x ({gemv:.3f} ms)")
            print(f"| {name} | {shape} {k}->{n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
