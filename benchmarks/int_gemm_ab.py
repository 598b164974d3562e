"""int8 / int4 projections against bf16 at M rows, per 250M-model layer shape, interleaved.

The goal: quantized decode at 16 streams to be at least as fast as bf16. Per M this
times one decoder layer's four projections (qkv, o, gate_up, down) on each path, summed:

- ``bf16``: oneDNN on the prepacked weight (the engine's bf16 path above 4 rows) and, up to
  4 rows, ``kernels.gemv_bf16`` (its path for small decode batches); the faster is the base.
- ``int8_rows`` / ``int4_rows``: the row-major int kernels (``kernels.linear_int8/int4``),
  dequantize + F.linear above the rows ``Int8Linear`` / ``Int4Linear`` gave them before the
  VNNI tiles (16 and 64): the previous path on AVX-512 machines without AMX.
- ``int8_tiles`` / ``int4_tiles``: the AMX tile layout read by ``kernels.linear_int8_vnni`` /
  ``linear_int4_vnni`` (or the AMX ops where AMX is active).

Each case cycles through enough weight copies to exceed the L3 cache (a decode step reads
every weight from memory), cases alternate round by round and each cell is a median over
rounds. Ratios are base time / case time (above 1: faster than bf16).

    PYTHONPATH=src .venv/bin/python benchmarks/int_gemm_ab.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import amx_layout, gemv_layout, int4_layout

HIDDEN, INTER, KV = 1024, 2816, 256  # bench-llama-250m: 16 heads of 64, 4 KV heads
SHAPES = {
    "qkv": (HIDDEN, HIDDEN + 2 * KV),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}
"""in -> out features."""
L3_BYTES = 64 << 20
GROUP = 128
OLD_ROWS = {"int8": 16, "int4": 64}
"""Rows up to which the previous dispatch ran the row-major int kernel."""


def _copies(nbytes: int) -> int:
    return max(2, -(-L3_BYTES // max(1, nbytes)))


def _int8_cases(w: torch.Tensor, x: torch.Tensor, amx: bool) -> dict[str, Callable[[int], object]]:
    scales = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    sums = q.sum(1, dtype=torch.int32)
    rows = [q.clone() for _ in range(_copies(q.numel()))]
    tiles = [amx_layout.pack_int8(q) for _ in range(_copies(q.numel()))]
    bs, bsum, n = amx_layout.block_channels(scales), amx_layout.block_channels(sums), w.shape[0]
    op = kernels.linear_int8_amx if amx else kernels.linear_int8_vnni

    def old(i: int) -> object:
        r = rows[i % len(rows)]
        if x.shape[0] <= OLD_ROWS["int8"]:
            return kernels.linear_int8(x, r, scales, sums, None)
        return F.linear(x, r.to(torch.bfloat16).mul_(scales.to(torch.bfloat16)[:, None]))

    return {
        "int8_rows": old,
        "int8_tiles": lambda i: op(x, tiles[i % len(tiles)], bs, bsum, None, n),
    }


def _int4_cases(w: torch.Tensor, x: torch.Tensor, amx: bool) -> dict[str, Callable[[int], object]]:
    n, k = w.shape
    k_pad = int4_layout.padded_in(k, GROUP)
    g = w.float().view(n, k // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = (
        torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    )
    codes = F.pad(codes, (0, k_pad - k))
    packed = [int4_layout.pack(codes) for _ in range(_copies(n * k // 2))]
    tiles = [amx_layout.pack_int4(codes) for _ in range(_copies(n * k // 2))]
    block = amx_layout.block_channels
    bs, bo = block(scale), block(low)
    bsum = block(codes.view(n, -1, GROUP).sum(-1, dtype=torch.int32))
    op = kernels.linear_int4_amx if amx else kernels.linear_int4_vnni

    def old(i: int) -> object:
        p = packed[i % len(packed)]
        if x.shape[0] <= OLD_ROWS["int4"]:
            return kernels.linear_int4(x, p, scale, low, GROUP, None)
        wq = int4_layout.unpack(p).to(torch.bfloat16).view(n, -1, GROUP)
        wq.mul_(scale.to(torch.bfloat16)[..., None]).add_(low.to(torch.bfloat16)[..., None])
        return F.linear(x, wq.view(n, -1)[:, :k])

    return {
        "int4_rows": old,
        "int4_tiles": lambda i: op(x, tiles[i % len(tiles)], bs, bsum, bo, GROUP, None, n),
    }


def _bf16_cases(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[int], object]]:
    copies = _copies(w.numel() * 2)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.clone(), 32) for _ in range(copies)]
    out: dict[str, Callable[[int], object]] = {
        "bf16_onednn": lambda i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i % copies], None, "none", [], ""
        )
    }
    if x.shape[0] <= 4:
        blocks = [gemv_layout.pack(w) for _ in range(copies)]
        out["bf16_gemv"] = lambda i: kernels.gemv_bf16(x, blocks[i % copies], w.shape[0], None)
    return out


def measure(m: int, rounds: int, calls: int) -> dict[str, float]:
    """Median ms per layer (the four shapes summed) for every case at ``m`` rows."""
    amx = kernels.amx_active()
    gen = torch.Generator().manual_seed(0)
    per_shape = []
    for k, n in SHAPES.values():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        cases = _bf16_cases(w, x) | _int8_cases(w.float(), x, amx) | _int4_cases(w.float(), x, amx)
        per_shape.append(cases)
    names = list(per_shape[0])
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            total = 0.0
            for cases in per_shape:
                fn = cases[name]
                fn(0)
                t0 = time.perf_counter()
                for i in range(calls):
                    fn(i)
                total += (time.perf_counter() - t0) / calls
            times[name].append(total * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    assert kernels.available(), "the tokenmill CPU kernels are not built"
    print(f"kernels: {kernels.describe()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n--threads {threads}: ms per layer (qkv+o+gate_up+down), ratio = bf16 / case")
        print(
            f"{'M':>4} {'bf16':>8} {'int8_rows':>16} {'int8_tiles':>16} {'int4_rows':>16} {'int4_tiles':>16}"
        )
        for m in args.rows:
            t = measure(m, args.rounds, max(2, args.calls * 16 // max(16, m)))
            base = min(t["bf16_onednn"], t.get("bf16_gemv", float("inf")))
            cells = [
                f"{t[c]:7.3f} {base / t[c]:5.2f}x "
                for c in ("int8_rows", "int8_tiles", "int4_rows", "int4_tiles")
            ]
            print(f"{m:>4} {base:8.3f} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
