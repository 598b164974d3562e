"""The cost of the Transformers fallback: one Llama, native against ``--model-impl transformers``.

Both engines load the same checkpoint (the ~250M benchmark Llama of ``engine_core.py`` by
default) in fp32 with the paged KV cache and run the same greedy workload, interleaved
round by round: ``--streams`` lists the concurrencies (1 and 8 by default), each request
``--input-len`` prompt tokens and ``--output-len`` output tokens (EOS ignored), fresh prompts
every round. Reported: output tok/s per implementation and concurrency, the fallback's
share of native, and whether both produced the same tokens.

    .venv/bin/python benchmarks/fallback.py --out results/fallback.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed_batch, warm_up
from engine_core import DEFAULT_MODEL_DIR, build_model

from tokenmill.entrypoints.llm import LLM

IMPLS = ("native", "transformers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = str(build_model(args.model_dir))
    engines: dict[str, LLM] = {}
    load_s: dict[str, float] = {}
    for impl in IMPLS:
        start = time.perf_counter()
        engines[impl] = LLM(
            model,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=max(args.streams),
            num_threads=args.threads,
            model_impl=impl,
        )
        load_s[impl] = time.perf_counter() - start
        warm_up(engines[impl])
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        impl: {str(n): [] for n in args.streams} for impl in IMPLS
    }
    same_tokens = True
    for rnd in range(args.rounds):
        for n in args.streams:
            outputs = []
            for impl in IMPLS:
                seed = rnd * 100 + n
                result, tokens = timed_batch(
                    engines[impl], n, args.input_len, args.output_len, seed
                )
                runs[impl][str(n)].append(result)
                outputs.append(tokens)
                print(
                    f"round {rnd} {impl:12s} {n:3d} streams {result['output_tok_s']:7.1f} output tok/s",
                    flush=True,
                )
            same_tokens &= outputs[0] == outputs[1]
    summary = {
        impl: {n: statistics.mean(r["output_tok_s"] for r in rs) for n, rs in by_n.items()}
        for impl, by_n in runs.items()
    }
    ratio = {n: summary["transformers"][n] / summary["native"][n] for n in summary["native"]}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads,
        "torch": torch.__version__,
        "model": model,
        "workload": {
            "streams": args.streams,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
        },
        "load_s": load_s,
        "runs": runs,
        "output_tok_s": summary,
        "transformers_vs_native": ratio,
        "same_tokens": same_tokens,
    }
    for n, value in ratio.items():
        print(
            f"{n:>3s} streams: native {summary['native'][n]:7.1f}, transformers "
            f"{summary['transformers'][n]:7.1f} output tok/s ({value:.0%} of native)"
        )
    print(f"same greedy tokens: {same_tokens}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
