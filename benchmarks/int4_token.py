"""A token's int4 projections at one row (the one-stream decode's GEMVs), in groups of 32:
the per-channel rows (``kernels.linear_int4``, fp32 scales and offsets) against 8 output
channels interleaved (``kernels.linear_int4_x8``, fp16 scales and offsets).

The shapes are the model's (its ``config.json``: q/k/v, o, gate/up and down per layer, every
layer), the codes random: a decode step reads each projection once, so this is the step's
int4 weight traffic without its attention, norms and head. The two layouts run alternately,
round by round, and each figure is a median over rounds, so the machine's bandwidth drift
hits both alike; read the ratio.

    PYTHONPATH=src .venv/bin/python benchmarks/int4_token.py \\
        --model-dir ~/.cache/tokenmill-real/smollm2-135m-instruct --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

from tokenmill import kernels
from tokenmill.kernels import int4_layout


def shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every projection a token passes through, layer after layer."""
    text = config.get("text_config", config)
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv = text.get("num_key_value_heads", heads)
    layer = [
        ((heads + 2 * kv) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]
    return layer * text["num_hidden_layers"]


def runners(projections: list[tuple[int, int]]) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    rows, channels8 = [], []
    for n, k in projections:
        k_pad, n8 = int4_layout.padded_in(k, 32), -(-n // 8) * 8
        codes = torch.randint(0, 16, (n8, k_pad), generator=g)
        scales = torch.rand(n8, k_pad // 32, generator=g) * 0.02 + 1e-3
        offsets = -8 * scales
        x = torch.randn(1, k, generator=g).bfloat16()
        packed = int4_layout.pack(codes[:n])
        rows.append((x, packed, scales[:n].contiguous(), offsets[:n].contiguous()))
        block = int4_layout.block_channels8
        blocks = int4_layout.pack_channels8(codes)
        channels8.append((x, blocks, block(scales).half(), block(offsets).half(), n))

    def run_rows() -> None:
        for x, packed, s, o in rows:
            kernels.linear_int4(x, packed, s, o, 32, None)

    def run_channels8() -> None:
        for x, blocks, s, o, n in channels8:
            kernels.linear_int4_x8(x, blocks, s, o, None, n)

    return {"per-channel rows": run_rows, "8 channels": run_channels8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="tokens timed per round")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("tokenmill's CPU kernels are not available on this machine")
    torch.set_num_threads(args.threads)
    config = json.loads((args.model_dir / "config.json").read_text())
    cases = runners(shapes(config))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            run()
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
    base = statistics.median(times["per-channel rows"])
    print(f"{args.model_dir.name}, {args.threads} threads, ISA {kernels.active_isa()}:")
    for name, values in times.items():
        median = statistics.median(values)
        spread = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name}: {median:.2f} ms a token [{spread}] (x{median / base:.2f})")


if __name__ == "__main__":
    main()
