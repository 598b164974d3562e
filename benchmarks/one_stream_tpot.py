"""One-stream TPOT of the 250M benchmark Llama, A/B across source trees.

The in-process engine (``LLMEngine.step``) decodes one request, a 128-token prompt and 64
output tokens, greedy; TPOT is the median decode step after the first token. Each case runs
in a fresh process from either tree (``--tree``, one ``src`` folder each), the trees
alternating and their order swapped every round, so load drift hits both alike; the report
is per-case medians and each tree's ratio to the first. Greedy tokens of every tree must be
identical (printed if not). A case is ``precision:strategy``: bf16/int8/int4 and paged,
static or paged-compiled (paged with its decode step compiled, ``--compile-batch-sizes 1``).

    PYTHONPATH=src .venv/bin/python benchmarks/one_stream_tpot.py \\
        --tree /tmp/base/src --tree src --cases bf16:paged,int4:paged --rounds 3 --threads 1
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
    """One case in this process; prints one JSON line."""
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
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.prompt_len + args.output_len + 8,
            num_threads=args.threads,
            quantization=None if quant == "bf16" else quant,
            compile_batch_sizes=(1,) if compiled else None,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = [4 + (t * 31) % 31000 for t in range(args.prompt_len)]
    steps: list[float] = []
    tokens: list[int] = []
    for rep in range(args.repeats + 1):  # the first is a warm-up
        engine.add_request(f"r{rep}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - start)
            for out in outs:
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        if rep:
            steps += times[2:]  # after prefill and the first decode step
    print(json.dumps({"tpot_ms": 1e3 * statistics.median(steps), "tokens": tokens}))


def run_case(src: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--case", case]
    command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    command += ["--model-dir", str(args.model_dir), "--max-num-seqs", str(args.max_num_seqs)]
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
    for case in args.cases.split(","):
        tpot: dict[str, list[float]] = {t: [] for t in trees}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                result = run_case(tree, case, args)
                tpot[tree].append(result["tpot_ms"])
                tokens[tree] = result["tokens"]
        base = statistics.median(tpot[trees[0]])
        cells = []
        for tree in trees:
            med = statistics.median(tpot[tree])
            cells.append(
                f"{tree}: {med:.2f} ms (x{med / base:.3f}) {[round(t, 1) for t in tpot[tree]]}"
            )
        same = all(tokens[t] == tokens[trees[0]] for t in trees)
        print(f"{case} | " + " | ".join(cells) + ("" if same else " | TOKENS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
