"""Decode attention alone (``paged_decode_attention``), per shape, in the tree on PYTHONPATH.

One decode step's attention over 16 layers' bf16 caches (16-token blocks, each layer its own
pool, so the working set is the engine's and lies beyond L2), for the shapes the benchmark
models have: the 250M Llama (16 query heads over 4 KV heads, head_dim 64), SmolLM2 (9 over
3, 64) and Gemma 3 (4 over 1, 256), at their serving loads (8 x 1,024-token contexts, 16 x
160) and one more group (8 query heads a KV head, which takes the packed-key path). Each
sequence's blocks are consecutive in the pool unless ``--scatter``. Medians of ``--repeats``
steps after one warm-up, ms per step (all 16 layers). The 16 layers' caches (2-31 MB) stay in
L3 from step to step unless ``--cold``, which writes a 700 MB buffer before each step (timed
apart), as a served step's weights evict them: decode reads them from memory there.

Compare trees by running this in each, alternating, on the same machine minutes apart:

    PYTHONPATH=src .venv/bin/python benchmarks/decode_attention_kernel.py [--threads 1]
    PYTHONPATH=OLD_TREE/src .venv/bin/python benchmarks/decode_attention_kernel.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import tokenmill  # first: it sets the OpenMP wait policy before torch loads the runtime

# isort: split
import torch

from tokenmill import kernels

LAYERS, BLOCK = 16, 16
SHAPES = {
    # name: (sequences, context, query heads, KV heads, head_dim)
    "250M 8 x 1024": (8, 1024, 16, 4, 64),
    "SmolLM2 16 x 160": (16, 160, 9, 3, 64),
    "SmolLM2 1 x 1024": (1, 1024, 9, 3, 64),
    "Gemma 3 16 x 160": (16, 160, 4, 1, 256),
    "Gemma 3 4 x 1024": (4, 1024, 4, 1, 256),
    "8:1 groups 8 x 1024": (8, 1024, 16, 2, 64),
}


def step_ms(
    shape: tuple[int, int, int, int, int], repeats: int, scatter: bool, cold: bool
) -> float:
    seqs, context, hq, hkv, dim = shape
    width = context // BLOCK
    pool = seqs * width + 1
    gen = torch.Generator().manual_seed(0)
    caches = [
        (
            torch.randn(pool, BLOCK, hkv, dim, generator=gen).bfloat16(),
            torch.randn(pool, BLOCK, hkv, dim, generator=gen).bfloat16(),
        )
        for _ in range(LAYERS)
    ]
    order = torch.randperm(pool - 1, generator=gen) if scatter else torch.arange(pool - 1)
    tables = order[: seqs * width].view(seqs, width)
    lens = torch.full((seqs,), context)
    q = torch.randn(seqs, hq, dim, generator=gen).bfloat16()
    scales = torch.ones(2)

    def step() -> None:
        for k_cache, v_cache in caches:
            kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, 0, scales)

    step()
    flush = torch.ones(700 * 2**20 // 4) if cold else None
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--scatter", action="store_true", help="blocks in random pool order")
    parser.add_argument("--cold", action="store_true", help="evict the caches before each step")
    args = parser.parse_args()
    assert kernels.available(), "the CPU kernels did not load"
    torch.set_num_threads(args.threads)
    row = {
        "tree": tokenmill.__file__,
        "isa": kernels.active_isa(),
        "threads": args.threads,
        "cold": args.cold,
        **{
            name: round(step_ms(s, args.repeats, args.scatter, args.cold), 2)
            for name, s in SHAPES.items()
        },
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
