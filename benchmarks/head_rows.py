"""A tied LM head's product at 1 to 16 rows (one to 16 streams' logits), in GMAC/s.

The head of the model in ``--model-dir`` (vocabulary x hidden, from its ``config.json``; the
weights random), stored as the engine stores a tied head: bf16 in the GEMV blocks
(``Linear.forward_float32``: ``kernels.gemv_bf16_f32out``) and int8 per channel in rows
(``Int8Linear.forward_float32``: ``kernels.linear_int8_f32out``, W8A8), beside torch's fp32
GEMM of the same shape, and of a square 512 x 2048 x 2048 one as the machine's fp32 compute
(MKL at these skinny shapes is far below it). At one row a head is a stream of
its weight bytes; at 16 rows every weight byte meets 16 activations, and a kernel's rate is
its arithmetic. Cases run alternately, round by round, each figure a median over rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/head_rows.py \\
        --model-dir ~/.cache/tokenmill-real/gemma3-270m --threads 2
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
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.model.layers import Linear
from tokenmill.model.quant import Int8Linear


def heads(vocab: int, hidden: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """One product per storage, each taking bf16 rows [M, hidden] to fp32 logits."""
    weight = (
        torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    ).bfloat16()
    bf16 = Linear(hidden, vocab)
    bf16.weight = torch.nn.Parameter(weight, requires_grad=False)  # packed into a copy
    if not bf16.pack_for_gemv():
        raise SystemExit("no GEMV blocks here (tokenmill's CPU kernels are not built)")
    int8 = Int8Linear(weight, None, tiles_ok=False)
    fp32 = weight.float()
    return {
        "bf16 (GEMV blocks)": bf16.forward_float32,
        f"int8 ({int8.kernel})": int8.forward_float32,
        "torch fp32 GEMM": lambda x: F.linear(x.float(), fp32),
    }


def square_gemm_rate(rounds: int = 5) -> float:
    """GMAC/s of torch's fp32 GEMM where it is compute bound: the machine's fp32 arithmetic."""
    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 512 * 2048 * 2048 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="products timed per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((args.model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    print(f"{kernels.describe()}; head {vocab} x {hidden}, {args.threads} threads")
    print(f"torch fp32 GEMM 512 x 2048 x 2048: {square_gemm_rate():.1f} GMAC/s")
    cases = heads(vocab, hidden)
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, int], list[float]] = {(c, m): [] for c in cases for m in rows}
    for _ in range(args.rounds):
        for m in rows:
            x = torch.randn(m, hidden).bfloat16()
            for name, run in cases.items():
                run(x)  # warm: the first call of a size allocates
                start = time.perf_counter()
                for _ in range(args.repeats):
                    run(x)
                times[name, m].append((time.perf_counter() - start) / args.repeats)
    print("| storage | " + " | ".join(f"{m} rows: ms, GMAC/s" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in cases:
        cells = []
        for m in rows:
            t = statistics.median(times[name, m])
            cells.append(f"{t * 1e3:.1f}, {m * vocab * hidden / t / 1e9:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
