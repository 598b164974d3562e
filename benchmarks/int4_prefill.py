"""int4 projections at prefill sizes: the int kernel against dequantize + torch's fp32 GEMM.

For the projection shapes of SmolLM2-135M (hidden 576), Gemma 3 270M (640) and the random
250M Llama (1024), int4 groups of 32 (a GGUF file's Q4 blocks) or ``--group-size``: the
milliseconds of ``kernels.linear_int4`` and of ``kernels.dequantize_int4`` followed by
``F.linear`` in fp32, at each row count, interleaved, median of ``--repeats``. This is what
``Int4Linear.dequantized_gemm_rows`` was chosen from.

    PYTHONPATH=src .venv/bin/python benchmarks/int4_prefill.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_host import cpu_isa

from tokenmill import kernels
from tokenmill.model.quant import Int4Linear

SHAPES = {
    "SmolLM2 gate_up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "Gemma 3 gate_up": (4096, 640),
    "Gemma 3 down": (640, 2048),
    "250M gate_up": (5632, 1024),
    "250M down": (1024, 2816),
}


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def on_kernel(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return kernels.linear_int4(
        x, layer.packed, layer.kernel_scales, layer.kernel_offsets, layer.group_size, None
    )


def on_gemm(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    w = kernels.dequantize_int4(
        layer.packed, layer.kernel_scales, layer.kernel_offsets, layer.group_size,
        layer.in_features,
    )  # fmt: skip
    return F.linear(x.float(), w).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--rows", default="16,64,128,256,512,2048")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the tokenmill CPU kernels are not built here")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"ISA {cpu_isa()} (kernel table {kernels.active_isa()}), {args.threads} threads, "
          f"int4 groups of {args.group_size}; ms int kernel / dequantize + fp32 GEMM")  # fmt: skip
    print("| shape | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name, (n, k) in SHAPES.items():
        layer = Int4Linear(torch.randn(n, k).bfloat16(), None, args.group_size)
        if layer.kernel != "rows":
            print(f"| {name} | stored as {layer.kernel} tiles: not this path |")
            continue
        cells = []
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            a = timed(functools.partial(on_kernel, layer, x), args.repeats)
            b = timed(functools.partial(on_gemm, layer, x), args.repeats)
            cells.append(f"{a:.2f} / {b:.2f} ({a / b:.2f}x)")
        print(f"| {name} ({n}x{k}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
