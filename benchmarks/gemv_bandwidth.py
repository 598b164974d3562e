"""One-row projections of the 250M benchmark Llama in GB/s of the weight bytes each kernel reads.

One-stream TPOT is weight-bandwidth bound: each decode step reads every weight
once. Per projection shape at M = 1 this prints how fast each path reads what it stores:
bf16 on oneDNN (prepacked), ``kernels.linear_bf16`` (row-major) and ``kernels.gemv_bf16``
(``kernels.gemv_layout`` blocks), and the int8 / int4 projections (model/quant.py) as
stored. (torch reductions are no streaming reference: ``t.view(torch.int32).sum()`` read
below the kernels; a plain AVX-512 sequential read in C measured about the GEMV layout's
rate.)

Every case cycles through enough copies of its weight to exceed the L3 cache (the model's
460 MB never fits; a single 3 MB matrix in a loop would be read from cache). Cases run
interleaved, round by round, and each cell is a median over rounds, so load drift hits all
of them alike; on a shared machine use ``--threads 1`` and read the ratios. Under
``PYTHONPATH`` of another tree it measures that tree's kernels (A/B by alternating runs).

    PYTHONPATH=src .venv/bin/python benchmarks/gemv_bandwidth.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import MODEL_SHAPE

from tokenmill import kernels
from tokenmill.model.layers import Linear
from tokenmill.model.quant import Int4Linear, Int8Linear

HIDDEN = MODEL_SHAPE["hidden_size"]
INTER = MODEL_SHAPE["intermediate_size"]
KV = MODEL_SHAPE["num_key_value_heads"] * HIDDEN // MODEL_SHAPE["num_attention_heads"]
SHAPES = {
    "qkv": (HIDDEN, HIDDEN + 2 * KV),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
    "lm_head": (HIDDEN, MODEL_SHAPE["vocab_size"]),
}
"""in -> out features."""

L3_BYTES = 96 << 20
"""Bytes each case cycles through (a few times any L3 here)."""


def stored_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers()) + sum(
        p.numel() * p.element_size() for p in module.parameters()
    )


def cases(k: int, n: int, kinds: set[str]) -> dict[str, tuple[list[Callable[[], object]], int]]:
    """name -> (one call per weight copy, bytes read per call), for ``kinds`` (bf16, int8,
    int4)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).mul_(0.02).to(torch.bfloat16)
    copies = max(2, L3_BYTES // w.nbytes)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    out: dict[str, tuple[list[Callable[[], object]], int]] = {}
    plain = [w.clone() for _ in range(copies)]
    if "bf16" not in kinds:
        plain = []
    onednn = []
    for _ in plain:
        lin = Linear(k, n)
        lin.weight.data = w.clone()
        lin.pack_for_onednn()
        onednn.append(lin)
    out["onednn"] = ([lambda m=m: m(x) for m in onednn], w.nbytes)
    if kernels.available():
        out["linear_bf16"] = (
            [lambda t=t: kernels.linear_bf16(x, t, None) for t in plain],
            w.nbytes,
        )
        if hasattr(kernels, "gemv_bf16"):
            from tokenmill.kernels import gemv_layout

            packed = [gemv_layout.pack(t) for t in plain]
            out["gemv_bf16"] = (
                [lambda p=p: kernels.gemv_bf16(x, p, n, None) for p in packed],
                w.nbytes,
            )
    del onednn
    for name, make in (
        ("int8", lambda: Int8Linear(w, None)),
        ("int4", lambda: Int4Linear(w, None, 128)),
    ):
        if name not in kinds:
            continue
        first = make()
        nbytes = stored_bytes(first)
        mods = [first] + [make() for _ in range(max(2, L3_BYTES // nbytes) - 1)]
        out[f"{name}[{first.kernel}]"] = ([lambda m=m: m(x) for m in mods], nbytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kinds", default="bf16,int8,int4", help="weight formats to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(kernels.describe() if kernels.available() else "no kernels", file=sys.stderr)
    print(f"threads {args.threads}; GB/s of stored weight bytes, median of {args.rounds} rounds")
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        cs = {name: c for name, c in cases(k, n, set(args.kinds.split(","))).items() if c[0]}
        times: dict[str, list[float]] = {name: [] for name in cs}
        for _ in range(args.rounds):
            for name, (calls, _) in cs.items():
                for c in calls:  # warm: page in, first-call costs
                    c()
                start = time.perf_counter()
                for _ in range(2):
                    for c in calls:
                        c()
                times[name].append((time.perf_counter() - start) / (2 * len(calls)))
        row = []
        for name, (_, nbytes) in cs.items():
            t = statistics.median(times[name])
            row.append(f"{name} {nbytes / t / 1e9:.1f} ({t * 1e6:.0f}us)")
        print(f"{shape} {k}->{n}: " + " | ".join(row), flush=True)
        del cs


if __name__ == "__main__":
    main()
