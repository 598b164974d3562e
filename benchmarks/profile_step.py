"""Per-op profile of one decode step of the 250M benchmark Llama.

torch.profiler over a few decode steps of the real engine (``LLMEngine.step``: scheduling,
input prep, the model, sampling), at 1 and 16 streams and short (128) and long (1024)
contexts, bf16 with the paged KV cache. Every op's own CPU time on the engine's thread is
put in one bucket: the model's call sites are wrapped in ``record_function`` scopes for the
run (projections, norms, RoPE, KV write, attention, SiLU*mul, sampling, input prep), and an
op belongs to its innermost scope; fused kernels that span two buckets have a bucket of
their own. What no op accounts for (Python between ops, the scheduler) is "Python/untracked".

Each bucket's figure is its median over the profiled steps (a step that lost the CPU to
another job moves a median little), and the shares are of the sum of those medians. Shares
are what this measures: the scopes add a few microseconds each, and on a loaded machine
absolute times are noise. Under load, prefer ``--threads 1``: with two threads a parallel
region waits for whichever thread was descheduled, which inflates whatever op was running.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_step.py              # the 4 cases
    PYTHONPATH=src .venv/bin/python benchmarks/profile_step.py --streams 16 --contexts 1024
    PYTHONPATH=src .venv/bin/python benchmarks/profile_step.py --streams 1 --quantization int4
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import build_model

from tokenmill import kernels

DEFAULT_MODEL_DIR = Path.home() / ".cache/tokenmill/bench-llama-250m"
"""The benchmark model (benchmarks/engine_core.py builds it); not under $TOKENMILL_CACHE, so a
private kernel cache still finds the shared model."""

BUCKETS = (
    "GEMM/GEMV",
    "attention",
    "norms",
    "RoPE",
    "KV write",
    "RoPE + KV write (fused)",
    "SiLU*mul",
    "sampling",
    "input prep",
    "other ops",
    "Python/untracked",
)
OP_BUCKETS = {
    "tokenmill_cpu::rope_kv_write": "RoPE + KV write (fused)",
    "tokenmill::rope_kv_write": "RoPE + KV write (fused)",
}
"""Ops that have a bucket of their own wherever they are called."""


def _scoped(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"bucket::{label}"):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def scopes() -> Iterator[None]:
    """Wrap the model's call sites in labelled scopes (undone on exit)."""
    from tokenmill.model import attention_backend, layers, quant
    from tokenmill.sampling.sampler import Sampler
    from tokenmill.worker.model_runner import ModelRunner

    patches: list[tuple[Any, str, str]] = [
        (layers.Linear, "forward", "GEMM/GEMV"),
        (layers.RMSNorm, "forward", "norms"),
        (layers.RotaryEmbedding, "forward", "RoPE"),
        (attention_backend, "write_kv", "KV write"),
        (attention_backend, "paged_attention", "attention"),
        (attention_backend.TorchSDPABackend, "build_metadata", "input prep"),
        (Sampler, "__call__", "sampling"),
        (ModelRunner, "prepare_inputs", "input prep"),
    ]
    if hasattr(kernels, "rope_kv_write"):  # the fused op's Python side too
        patches.append((kernels, "rope_kv_write", "RoPE + KV write (fused)"))
    patches += [
        (quant, name, "GEMM/GEMV")
        for name in ("Int8Linear", "Int4Linear")
        if hasattr(getattr(quant, name, None), "forward")
    ]
    saved = []
    for owner, name, label in patches:
        target = getattr(owner, name)
        if isinstance(target, type):  # a class: wrap its forward
            owner, name = target, "forward"
            target = target.forward
        saved.append((owner, name, target))
        setattr(owner, name, _scoped(label, target))
    acts = dict(layers.ACT_AND_MUL)
    layers.ACT_AND_MUL["silu"] = _scoped("SiLU*mul", acts["silu"])
    try:
        yield
    finally:
        for owner, name, target in reversed(saved):
            setattr(owner, name, target)
        layers.ACT_AND_MUL.update(acts)


def bucket_times(prof: torch.profiler.profile) -> tuple[list[dict[str, float]], dict[str, dict]]:
    """Per profiled step, self CPU time (us) per bucket: each op goes to its own bucket or
    its innermost scope; a step's own time outside every op is "Python/untracked". Also the
    heaviest ops of each bucket (us over all steps), to say what a bucket is made of."""
    steps: dict[str, dict[str, float]] = {}
    ops: dict[str, dict[str, float]] = {b: {} for b in BUCKETS}
    for event in prof.events():
        bucket = OP_BUCKETS.get(event.name)
        step = None
        node = event
        while node is not None:
            if bucket is None and node.name.startswith("bucket::"):
                bucket = node.name.removeprefix("bucket::")
            if node is not event and bucket is None and node.name in OP_BUCKETS:
                bucket = OP_BUCKETS[node.name]
            if node.name.startswith("step::"):
                step = node.name
            node = node.cpu_parent
        if step is None:
            continue
        if event.name == step:
            bucket = "Python/untracked"
        bucket = bucket or "other ops"
        row = steps.setdefault(step, dict.fromkeys(BUCKETS, 0.0))
        row[bucket] += event.self_cpu_time_total
        ops[bucket][event.name] = ops[bucket].get(event.name, 0.0) + event.self_cpu_time_total
    top = {
        b: dict(sorted(((k, round(v)) for k, v in o.items()), key=lambda kv: -kv[1])[:4])
        for b, o in ops.items()
        if o
    }
    return [steps[k] for k in sorted(steps)], top


def profile_case(
    model_dir: Path,
    streams: int,
    context: int,
    steps: int,
    threads: int,
    quantization: str | None = None,
) -> dict[str, Any]:
    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine.llm_engine import LLMEngine

    with scopes():
        engine = LLMEngine(
            EngineConfig.from_kwargs(
                model=str(model_dir),
                dtype=os.environ.get("TM_PROFILE_DTYPE", "bfloat16"),
                kv_cache="paged",
                max_num_seqs=streams,
                max_model_len=context + steps + 8,
                num_threads=threads,
                quantization=quantization,
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(streams):  # distinct prompts: no prefix-cache hits
            vocab = engine.model_config.vocab_size - 4
            prompt = [4 + (i * 7919 + t * 31) % vocab for t in range(context)]
            engine.add_request(str(i), prompt, params)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < context for r in engine.scheduler.running
        ):
            engine.step()  # prefill everything first
        engine.step()
        engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                with torch.profiler.record_function(f"step::{i:04d}"):
                    engine.step()
        del engine
    per_step, top = bucket_times(prof)
    # The median step of each bucket: a step that lost the CPU to another job moves it little.
    median = {b: statistics.median(s[b] for s in per_step) for b in BUCKETS}
    total = sum(median.values())
    return {
        "streams": streams,
        "context": context,
        "steps": steps,
        "step_ms": round(total / 1e3, 2),
        "share_pct": {k: round(100 * v / total, 1) for k, v in median.items()},
        "top_ops_us": top,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["bucket"] + [f"{r['streams']} x ctx {r['context']}" for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bucket in BUCKETS:
        if all(r["share_pct"][bucket] == 0 for r in rows):
            continue
        cells = [f"{r['share_pct'][bucket]:.1f}%" for r in rows]
        lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    lines.append(
        "| (sum of medians, ms: not a result) | "
        + " | ".join(f"{r['step_ms']}" for r in rows)
        + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--streams", default="1,16", help="comma-separated stream counts")
    parser.add_argument("--contexts", default="128,1024", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=12, help="decode steps profiled per case")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="the engine's --num-threads"
    )
    parser.add_argument(
        "--quantization", choices=("int8", "int4"), default=None, help="weights quantized at load"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build_model(args.model_dir)
    print(kernels.describe(), file=sys.stderr)
    rows = [
        profile_case(args.model_dir, int(s), int(c), args.steps, args.threads, args.quantization)
        for c in args.contexts.split(",")
        for s in args.streams.split(",")
    ]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
