"""Microbenchmark of tokenmill's CPU kernels against the torch paths they replace, in one run.

Per op at the 250M benchmark Llama's shapes (benchmarks/engine_core.py), at M = 1, 2, 4, 16, 64
rows: the bf16 projection (tokenmill kernel vs oneDNN prepacked, today's path), int8 and
int4 weight-only projections (kernel vs torch's int kernels / dequantize + GEMM, as
model/quant.py dispatches), add + RMSNorm, SiLU*mul, RoPE and paged decode attention (kernel
vs the torch code in model/). With ``--profile``, one decode step of the 250M model (16
sequences, short and long context) under torch.profiler with the kernels off and on.

    PYTHONPATH=src .venv/bin/python benchmarks/kernel_ops.py --threads 2
    PYTHONPATH=src .venv/bin/python benchmarks/kernel_ops.py --profile
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import DEFAULT_MODEL_DIR, MODEL_SHAPE, build_model

from tokenmill import kernels
from tokenmill.model.attention import _attend, attention_mask
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.quant import Int4Linear, Int8Linear

HIDDEN = MODEL_SHAPE["hidden_size"]
INTER = MODEL_SHAPE["intermediate_size"]
HEADS, KV_HEADS = MODEL_SHAPE["num_attention_heads"], MODEL_SHAPE["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS
PROJECTIONS = {
    "qkv": (HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}
"""in -> out features of one layer's projections."""


def timed_ms(fn, min_s: float = 0.3) -> float:
    """Fastest of repeated calls, after a warm-up (the least disturbed run)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + min_s
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def layer_linears(kind: str) -> list[torch.nn.Module]:
    """One layer's four projections as the model builds them for ``kind``."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for in_f, out_f in PROJECTIONS.values():
        w = (torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16()
        if kind == "int8":
            out.append(Int8Linear(w, None))
        elif kind == "int4":
            out.append(Int4Linear(w, None, 128))
        else:
            lin = Linear(in_f, out_f)
            lin.weight.data = w
            lin.pack_for_onednn()
            out.append(lin)
    return out


def bench_linears(rows: list[int]) -> dict[str, dict[str, float]]:
    """ms per layer (4 projections) per row count, kernels on and off, per weight kind."""
    results: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    raw = [(torch.randn(o, i, generator=gen) * 0.02).bfloat16() for i, o in PROJECTIONS.values()]
    for m in rows:  # the kernels' own bf16 GEMV op (not wired in: oneDNN runs bf16 on AMX)
        xs = [torch.randn(m, w.shape[1]).bfloat16() for w in raw]
        results.setdefault("bf16 tokenmill GEMV op", {})[str(m)] = round(
            timed_ms(
                lambda xs=xs: [
                    kernels.linear_bf16(x, w, None) for x, w in zip(xs, raw, strict=True)
                ]
            ),
            3,
        )
    for kind, uses in (("bf16", (False,)), ("int8", (False, True)), ("int4", (False, True))):
        for use in uses:
            kernels.set_enabled(use)
            mods = layer_linears(kind)
            for m in rows:
                xs = [torch.randn(m, p[0]).bfloat16() for p in PROJECTIONS.values()]

                def step(mods=mods, xs=xs):
                    for mod, x in zip(mods, xs, strict=True):
                        mod(x)

                key = f"{kind} {'kernel' if use else 'torch'}"
                if kind == "bf16":
                    key = "bf16 oneDNN (the model's path)"
                results.setdefault(key, {})[str(m)] = round(timed_ms(step), 3)
    kernels.set_enabled(True)
    weight_bytes = sum(i * o for i, o in PROJECTIONS.values())
    for key, per_weight in (
        ("bf16 oneDNN (the model's path)", 2),
        ("bf16 tokenmill GEMV op", 2),
        ("int8 kernel", 1),
        ("int4 kernel", 0.5),
    ):
        results[f"{key} GB/s (weights as stored)"] = {
            m: round(weight_bytes * per_weight / ms / 1e6, 1) for m, ms in results[key].items()
        }
    return results


def bench_elementwise(rows: int) -> dict[str, dict[str, float]]:
    x = torch.randn(rows, HIDDEN).bfloat16()
    res = torch.randn(rows, HIDDEN).bfloat16()
    norm = RMSNorm(HIDDEN, 1e-6).bfloat16()
    gate_up = torch.randn(rows, 2 * INTER).bfloat16()
    rope = RotaryEmbedding(HEAD_DIM, 2048, 10000.0, None)
    pos = torch.randint(0, 2048, (rows,))
    q = torch.randn(rows, HEADS, HEAD_DIM).bfloat16()
    k = torch.randn(rows, KV_HEADS, HEAD_DIM).bfloat16()
    out = {}
    ops = {
        "add+rmsnorm": (
            lambda: norm._norm(x + res),
            lambda: kernels.rms_norm(x, norm.weight, 1e-6, res),
        ),
        "silu*mul": (
            lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:],
            lambda: kernels.silu_and_mul(gate_up),
        ),
        "rope": (lambda: rope(pos, q, k), lambda: kernels.rope(pos, q, k, rope.cos, rope.sin)),
    }
    for name, (torch_fn, kernel_fn) in ops.items():
        out[name] = {"torch": round(timed_ms(torch_fn), 4), "kernel": round(timed_ms(kernel_fn), 4)}
    return out


def bench_attention(
    batch: int, context: int, kv_dtype: torch.dtype, softcap: float = 0.0
) -> dict[str, float]:
    """One layer's decode attention over ``context`` tokens per sequence, 16-token blocks
    (the kernel splits long contexts of small batches across threads)."""
    block = 16
    width = -(-context // block)
    num_blocks = batch * width + 1
    k_cache = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM).to(kv_dtype)
    tables = torch.randperm(num_blocks - 1)[: batch * width].view(batch, width)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    scales = torch.ones(2)
    mask = attention_mask((lens - 1)[:, None], lens, width * block, None)
    return {
        "torch": round(
            timed_ms(
                lambda: _attend(
                    q.unsqueeze(1), k_cache, v_cache, tables, mask, 0.125, scales, softcap
                )
            ),
            3,
        ),
        "kernel": round(
            timed_ms(
                lambda: kernels.paged_decode_attention(
                    q, k_cache, v_cache, tables, lens, 0.125, 0, scales, softcap
                )
            ),
            3,
        ),
    }


def bench_prefill_attention(prefix: int, new: int) -> dict[str, float]:
    """One layer's attention for one request's chunk of ``new`` tokens after ``prefix``
    cached ones: torch's causal flash path (model/attention.py; fresh prompts only) and
    explicit mask, and the kernels' paged prefill attention."""
    import dataclasses

    from tokenmill.model.attention import paged_attention
    from tokenmill.model.attention_backend import BatchGroup, StepBatch, TorchSDPABackend

    block = 16
    context = prefix + new
    width = -(-context // block)
    k_cache = torch.randn(width, block, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn(width, block, KV_HEADS, HEAD_DIM).bfloat16()
    group = BatchGroup(
        False, [list(range(new))], [list(range(prefix, context))], [list(range(width))], [context]
    )
    meta = TorchSDPABackend(torch.device("cpu")).build_metadata(StepBatch([0] * new, [group], new))
    masked = dataclasses.replace(meta, groups=[dataclasses.replace(meta.groups[0], segments=None)])
    q = torch.randn(new, HEADS, HEAD_DIM).bfloat16()
    from tokenmill.model import attention

    def timed(flag: bool, m) -> float:  # PREFILL_KERNEL off: torch's paths
        attention.PREFILL_KERNEL = flag
        try:
            return round(timed_ms(lambda: paged_attention(q, k_cache, v_cache, m, 0.125, None)), 3)
        finally:
            attention.PREFILL_KERNEL = True

    return {
        "mask": timed(False, masked),
        "causal flash": timed(False, meta),
        "paged prefill kernel": timed(True, meta),
    }


def profile_decode_step(model_dir: Path, kv_cache: str, context: int, steps: int) -> list[dict]:
    """Per-op CPU time of decode steps (16 sequences at ``context`` tokens), kernels off/on.

    Kernels off means the layers' torch code for norms, SiLU, RoPE and attention (bf16
    projections run on oneDNN either way)."""
    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine.llm_engine import LLMEngine

    rows = []
    for use in (False, True):
        kernels.set_enabled(use)
        engine = LLMEngine(
            EngineConfig.from_kwargs(
                model=str(model_dir),
                dtype="bfloat16",
                kv_cache=kv_cache,
                max_num_seqs=16,
                max_model_len=context + steps + 8,
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(16):
            engine.add_request(str(i), [4 + (i + t) % 1000 for t in range(context)], params)
        while any(r.num_computed_tokens < context for r in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()  # prefill everything first
        engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            step_ms = (time.perf_counter() - start) / steps * 1e3
        top = [
            {"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3)}
            for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[
                :12
            ]
        ]
        rows.append(
            {
                "kernels": use,
                "kv_cache": kv_cache,
                "context": context,
                "step_ms": round(step_ms, 2),
                "top_ops": top,
            }
        )
        del engine
    kernels.set_enabled(True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,4,16,64")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--profile", action="store_true", help="also profile decode steps of the 250M model"
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--profile-steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the tokenmill CPU kernels did not build here; nothing to compare")
    rows = [int(r) for r in args.rows.split(",")]
    results = {
        "threads": args.threads,
        "isa": kernels.active_isa(),
        "linear_ms_per_layer": bench_linears(rows),
        "elementwise_ms_16_rows": bench_elementwise(16),
        "attention_ms_per_layer": {
            f"{name} B=16 ctx={ctx}": bench_attention(16, ctx, dtype)
            for ctx in (192, 1088)
            for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn))
        }
        | {
            "bf16 B=1 ctx=4096": bench_attention(1, 4096, torch.bfloat16),
            "bf16 B=16 ctx=1088 softcap=50": bench_attention(16, 1088, torch.bfloat16, 50.0),
        },
        "prefill_attention_ms_per_layer": {
            f"prefix={p} new={n}": bench_prefill_attention(p, n)
            for p, n in ((0, 128), (0, 1024), (512, 512))
        },
    }
    if args.profile:
        build_model(args.model_dir)
        results["decode_step_profile"] = [
            row
            for kv_cache, context in (("paged", 128), ("paged", 1024))
            for row in profile_decode_step(args.model_dir, kv_cache, context, args.profile_steps)
        ]
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
