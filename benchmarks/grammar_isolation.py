"""Grammar compiles vs another stream's inter-token gaps, in-process.

One unconstrained stream runs on the ``AsyncLLMEngine`` (the server's engine thread) while
``--num-compiles`` distinct ~155 KB JSON schemas compile on a thread pool of
``--pool-sizes`` workers, as the server compiles them (``--max-concurrent-grammar-compiles``,
threads at nice 19; the old pool had 2 threads at normal priority:
``--pool-sizes 2 --no-low-priority``). The gaps between the stream's tokens are recorded
while compiles are in flight, and once with no compile at all. llguidance holds the GIL
little while it builds a grammar, but a compile is seconds of CPU that the engine's step
needs on a small machine.

    .venv/bin/python benchmarks/grammar_isolation.py --out results/grammar_isolation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.entrypoints.openai.state import new_grammar_pool


def big_schema(seed: int, size: int) -> dict[str, Any]:
    """An object schema of about ``size`` bytes: strings, bounded integers, enums, objects."""
    props: dict[str, Any] = {}
    i = num_bytes = 0
    while num_bytes < size - 200:
        kind = i % 4
        if kind == 0:
            props[f"s{seed}_{i}"] = {"type": "string", "maxLength": 20 + i % 30}
        elif kind == 1:
            props[f"n{seed}_{i}"] = {"type": "integer", "minimum": i, "maximum": i * 10 + 5}
        elif kind == 2:
            props[f"e{seed}_{i}"] = {"enum": [f"v{i}_{j}" for j in range(4)]}
        else:
            props[f"o{seed}_{i}"] = {
                "type": "object",
                "properties": {"a": {"type": "boolean"}, "b": {"type": "number"}},
                "required": ["a"],
            }
        key = next(reversed(props))
        num_bytes += len(json.dumps({key: props[key]}))
        i += 1
    return {"type": "object", "properties": props, "required": list(props)[:50]}


def _stats(gaps: list[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    return {
        "num_gaps": len(ordered),
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
    }


async def _phase(
    engine: AsyncLLMEngine, args: argparse.Namespace, pool_size: int, seed: int
) -> dict:
    params = SamplingParams(
        temperature=0.0, max_tokens=100_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    request = engine.process_prompt(f"stream-{seed}", "The license", engine.check_params(params))
    gaps: list[float] = []
    compiles: list[asyncio.Future] = []
    pool = (
        (new_grammar_pool if args.low_priority else ThreadPoolExecutor)(pool_size)
        if pool_size
        else None
    )
    constraints = [  # built before the stream starts: only compiling runs alongside it
        SamplingParams(
            structured_outputs=StructuredOutputsParams(
                json=big_schema(seed * 100 + i, args.schema_bytes)
            )
        )
        for i in range(args.num_compiles if pool_size else 0)
    ]
    start = time.monotonic()
    last = None
    async for _ in engine.generate(request):
        now = time.monotonic()
        if last is not None and (compiles or pool is None):
            gaps.append(now - last)
        last = now
        if pool is not None and not compiles and now - start > 1.0:  # the stream is decoding
            compiles = [
                asyncio.wrap_future(pool.submit(engine.compile_grammar, c)) for c in constraints
            ]
        if pool is None and now - start > args.idle_s:
            break
        if compiles and all(c.done() for c in compiles):
            break
    compile_s = time.monotonic() - start
    if pool is not None:
        pool.shutdown()
    return {
        "pool_size": pool_size,
        "low_priority": args.low_priority,
        "num_compiles": args.num_compiles if pool_size else 0,
        "seconds": round(compile_s, 1),
        "schema_bytes": len(json.dumps(constraints[0].structured_outputs.json))
        if constraints
        else 0,  # type: ignore[union-attr]
        **_stats(gaps),
    }


async def _run(args: argparse.Namespace) -> list[dict]:
    engine = AsyncLLMEngine(EngineConfig(model=args.model, num_threads=args.num_threads))
    engine.start()
    await engine.wait_ready()
    results = []
    try:
        for seed, pool_size in enumerate([0, *args.pool_sizes], 1):
            results.append(await _phase(engine, args, pool_size, seed))
            print(json.dumps(results[-1]), flush=True)
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--schema-bytes", type=int, default=155_000)
    parser.add_argument("--num-compiles", type=int, default=8)
    parser.add_argument("--pool-sizes", type=int, nargs="+", default=[8, 2, 1])
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument(
        "--low-priority",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile threads at nice 19, as the server's (--no-low-priority: as the old pool)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(_run(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {**vars(args), "out": str(args.out)}, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
