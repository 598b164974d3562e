"""Attention kernels A/B: the paged prefill and decode kernels against the paths
they replace, interleaved in one process so that load drift hits both alike.

Kernel alone (one layer of the 250M benchmark Llama's shape: 16 q heads, 4 KV heads,
head_dim 64, bf16, 16-token blocks scattered over the pool):
  prefill  a chunk of ``new`` tokens after ``prefix`` cached ones: the prefill kernel
           against torch's paths (gather + causal flash for fresh prompts, gather + masked
           SDPA after a prefix); ``model.attention.PREFILL_KERNEL`` switches.
  decode   16 x 1024, 1 x 1024, 1 x 4096, 1 x 160: rotating over 16 layers' caches (the
           engine's working set, beyond L3), the kernel at 1 thread against 2 threads
           (``speedup``: how its split of work items scales).
Engine (the 250M model, benchmarks/engine_core.py builds it):
  prefill  one 1024-token prompt in ``--chunk``-token chunks, wall time of its steps

    PYTHONPATH=src .venv/bin/python benchmarks/attention_ab.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tokenmill import kernels
from tokenmill.model import attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 16, 4, 64, 16, 16
DEFAULT_MODEL_DIR = Path.home() / ".cache/tokenmill/bench-llama-250m"


def interleave(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each fn, the fns alternating (order reversed every round)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def ratio(medians: dict[str, float], old: str, new: str) -> dict[str, float]:
    return {
        f"{old}_ms": round(medians[old] * 1e3, 3),
        f"{new}_ms": round(medians[new] * 1e3, 3),
        "speedup": round(medians[old] / medians[new], 3),
    }


def kernel_prefill(prefix: int, new: int, rounds: int) -> dict[str, float]:
    from tokenmill.model.attention_backend import BatchGroup, StepBatch, TorchSDPABackend

    ctx = prefix + new
    width = -(-ctx // BLOCK)
    pool = width + 8
    k_cache = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    table = torch.randperm(pool)[:width].tolist()
    group = BatchGroup(False, [list(range(new))], [list(range(prefix, ctx))], [table], [ctx])
    meta = TorchSDPABackend(torch.device("cpu")).build_metadata(StepBatch([0] * new, [group], new))
    q = torch.randn(new, HEADS, HEAD_DIM).bfloat16()

    def run(flag: bool) -> Callable[[], Any]:
        def fn() -> Any:
            attention.PREFILL_KERNEL = flag
            return attention.paged_attention(q, k_cache, v_cache, meta, 0.125, None)

        return fn

    medians = interleave({"torch": run(False), "kernel": run(True)}, rounds)
    attention.PREFILL_KERNEL = True
    return ratio(medians, "torch", "kernel")


def kernel_decode(
    batch: int, context: int, rounds: int, kv_dtype: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """The decode kernel at 1 and at 2 threads, alternating in this process (the thread
    count is set before each pass over the 16 layers): how the 2-thread split scales."""
    width = -(-context // BLOCK)
    pool = batch * width + 1
    layers = [
        (
            torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(kv_dtype),
            torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(kv_dtype),
        )
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(pool - 1)[: batch * width].view(batch, width)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    scales = torch.ones(2)
    before = torch.get_num_threads()

    def run(threads: int) -> Callable[[], Any]:
        def fn() -> Any:
            torch.set_num_threads(threads)
            for k_cache, v_cache in layers:
                kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 0, scales)

        return fn

    medians = interleave({"1 thread": run(1), "2 threads": run(2)}, rounds)
    torch.set_num_threads(before)
    return {
        k: v / LAYERS if k.endswith("_ms") else v
        for k, v in ratio(medians, "1 thread", "2 threads").items()
    }


def engine(model_dir: Path, threads: int, chunk: int, rounds: int) -> dict[str, Any]:
    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine.llm_engine import LLMEngine

    context = 1024
    eng = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            dtype="bfloat16",
            kv_cache="paged",
            max_num_seqs=1,
            max_model_len=context + 64,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=False,
            num_threads=threads,
        )
    )
    serial = iter(range(10**6))

    def prefill(flag: bool) -> Callable[[], Any]:
        def fn() -> Any:
            attention.PREFILL_KERNEL = flag
            i = next(serial)
            prompt = [4 + (i * 7919 + t * 31) % 31000 for t in range(context)]
            eng.add_request(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            while eng.has_unfinished_requests():
                eng.step()

        return fn

    out: dict[str, Any] = {
        f"prefill 1024 in {chunk}-token chunks": ratio(
            interleave({"torch": prefill(False), "kernel": prefill(True)}, rounds),
            "torch",
            "kernel",
        )
    }
    attention.PREFILL_KERNEL = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true", help="no kernel-alone prefill")
    parser.add_argument("--skip-decode", action="store_true", help="no kernel-alone decode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the tokenmill CPU kernels did not build here; nothing to compare")
    results: dict[str, Any] = {"threads": args.threads, "isa": kernels.active_isa()}
    if not args.skip_prefill:
        results["kernel prefill (ms per layer)"] = {
            f"prefix={p} new={n}": kernel_prefill(p, n, args.rounds)
            for p, n in ((0, 512), (512, 512), (0, 1024), (1024, 64), (0, 64))
        }
    if not args.skip_decode:
        results["kernel decode, 1 vs 2 threads (ms per layer)"] = {
            f"B={b} ctx={c}": kernel_decode(b, c, args.rounds)
            for b, c in ((16, 1024), (1, 1024), (1, 4096), (1, 160))
        } | {"B=16 ctx=1024 fp8_e4m3": kernel_decode(16, 1024, args.rounds, torch.float8_e4m3fn)}
    if not args.skip_engine:
        from engine_core import build_model

        build_model(args.model_dir)
        results["engine (ms)"] = engine(args.model_dir, args.threads, args.chunk, args.rounds)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
