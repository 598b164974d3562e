"""One-stream TPOT (and N-stream throughput) of the 250M benchmark Llama, A/B across trees.

The in-process engine (``LLMEngine.step``) decodes one request (``--streams N``: N at once),
a 128-token prompt and 64 output tokens each, greedy; TPOT is the median decode step after
every request's first token, throughput the output tokens over the whole timed run. Each case runs
in a fresh process from either tree (``--tree``, one ``src`` folder each), the trees
alternating and their order swapped every round, so load drift hits both alike; the report
is per-case medians and each tree's ratio to the first. Greedy tokens of every tree must be
identical (printed if not). A case is ``precision:strategy``: bf16/int8/int4 and paged,
static or paged-compiled (paged with its decode step compiled, ``--compile-batch-sizes 1``).

    PYTHONPATH=src .venv/bin/python benchmarks/one_stream_tpot.py \\
        --tree /tmp/base/src --tree src --cases bf16:paged,int4:paged --rounds 3 --threads 1
    PYTHONPATH=src .venv/bin/python benchmarks/one_stream_tpot.py \\
        --tree /tmp/base/src --tree src --cases bf16:paged --streams 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

DEFAULT_MODEL_DIR = Path.home() / ".cache/tokenmill/bench-llama-250m"


def child(args: argparse.Namespace) -> None:
    """One case in this process; prints one JSON line. tokenmill is imported before torch, so
    that its OpenMP wait policy is set before torch loads the runtime, as in ``tokenmill
    serve`` (imported after, the cases ran at libgomp's own ~300,000 spins)."""
    import tokenmill  # noqa: I001, F401
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    quant, kv = args.case.split(":")
    compiled = kv in ("static", "paged-compiled")  # paged-compiled: paged, its decode compiled
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(args.model_dir),
            dtype="bfloat16",
            kv_cache=kv.removesuffix("-compiled"),
            max_num_seqs=max(args.max_num_seqs, args.streams),
            max_model_len=args.prompt_len + args.output_len + 8,
            num_threads=args.threads,
            quantization=None if quant == "bf16" else quant,
            compile_batch_sizes=(1,) if compiled else None,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    steps: list[float] = []
    rates: list[float] = []
    tokens: list[int] = []
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for i in range(args.streams):
            prompt = [4 + (t * 31 + i * 997) % 31000 for t in range(args.prompt_len)]
            engine.add_request(f"r{rep}-{i}", prompt, params)
        times: list[float] = []
        started: set[str] = set()
        decoding_from = None  # the step after the one that gave the last first token
        began = time.perf_counter()
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - start)
            for out in outs:
                started.add(out.request_id)
                if out.finished and out.request_id == f"r{rep}-0":
                    tokens = list(out.outputs[0].token_ids)
            if decoding_from is None and len(started) == args.streams:
                decoding_from = len(times) + 1  # skip the first all-decode step too
        if rep:
            steps += times[decoding_from or len(times) :]
            rates.append(args.streams * args.output_len / (time.perf_counter() - began))
    print(
        json.dumps(
            {
                "tpot_ms": 1e3 * statistics.median(steps),
                "tok_s": statistics.median(rates),
                "tokens": tokens,
            }
        )
    )


def run_case(src: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--case", case]
    command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    command += ["--model-dir", str(args.model_dir), "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--streams", str(args.streams)]
    src, _, extra = src.partition("?")  # "src?KEY=VALUE,KEY=VALUE": that tree with env set
    env = {**os.environ, "PYTHONPATH": src}
    env.update(kv.split("=", 1) for kv in extra.split(",") if kv)
    done = subprocess.run(command, capture_output=True, env=env, check=True)
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="bf16:paged", help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=[], help="a src folder (repeat)")
    parser.add_argument("--cases", default="bf16:paged,int8:paged,int4:paged")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="requests timed per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--streams", type=int, default=1, help="requests decoded together")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=1,
        help="the engine's max_num_seqs (a server's default is 32)",
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    trees = args.tree or ["src"]
    if not args.model_dir.exists():
        from engine_core import build_model

        build_model(args.model_dir)
    for case in args.cases.split(","):
        tpot: dict[str, list[float]] = {t: [] for t in trees}
        rate: dict[str, list[float]] = {t: [] for t in trees}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                result = run_case(tree, case, args)
                tpot[tree].append(result["tpot_ms"])
                rate[tree].append(result["tok_s"])
                tokens[tree] = result["tokens"]
        base = statistics.median(tpot[trees[0]])
        base_rate = statistics.median(rate[trees[0]])
        cells = []
        for tree in trees:
            med, tok_s = statistics.median(tpot[tree]), statistics.median(rate[tree])
            cells.append(
                f"{tree}: {med:.2f} ms (x{med / base:.3f}) {[round(t, 1) for t in tpot[tree]]}, "
                f"{tok_s:.1f} tok/s (x{tok_s / base_rate:.3f})"
            )
        same = all(tokens[t] == tokens[trees[0]] for t in trees)
        label = f"{case} x{args.streams}"
        print(f"{label} | " + " | ".join(cells) + ("" if same else " | TOKENS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
