"""Per-step engine overhead: this tree against another ref, interleaved.

On the demo model (3.8M parameters) a decode step is nearly all engine and per-op Python
cost, so its TPOT measures the overhead itself. Each case runs in a fresh process from
either source tree, the two trees alternating (order swapped every round), so load drift
hits both alike; the report gives per-case medians and the head/base ratio. Cases:
  inproc-1   ``LLM.generate``, one prompt, greedy, ``--output-len`` tokens (paged, static)
  inproc-16  16 prompts at once: output tok/s
  server-1   ``tokenmill serve demo``, one streaming completion: mean gap between chunks
Greedy outputs of both trees are compared token for token (they must be identical).

    git worktree add --detach /tmp/base 693936e
    .venv/bin/python benchmarks/step_overhead.py --base-src /tmp/base/src --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, Server, free_port, source_env, tokenmill_command

PROMPT = "The quick brown fox jumps over the lazy dog"


def child(args: argparse.Namespace) -> None:
    """One in-process case; prints one JSON line."""
    import tokenmill
    from tokenmill.core.sampling_params import SamplingParams

    llm = tokenmill.LLM("demo", kv_cache=args.kv, num_threads=args.num_threads or None)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(args.streams)]
    llm.generate(prompts, params)  # warm-up (compiled buckets, allocator)
    best = float("inf")
    tokens: list[list[int]] = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(len(t) for t in tokens)
    print(
        json.dumps(
            {"tpot_ms": 1000 * best / len(tokens[0]), "tok_s": total / best, "tokens": tokens}
        )
    )


def run_inproc(src: Path, kv: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        "--kv",
        kv,
        "--streams",
        str(streams),
        "--output-len",
        str(args.output_len),
        "--repeats",
        str(args.repeats),
        "--num-threads",
        str(args.num_threads),
    ]
    done = subprocess.run(command, capture_output=True, env=source_env(src), check=True)
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def run_server(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One streaming completion; the mean gap between streamed chunks after the first."""
    port = free_port() if args.port == 0 else args.port
    base = f"http://127.0.0.1:{port}"
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads else []
    command = tokenmill_command("serve", "demo", "--port", str(port), *threads)
    body = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with Server(command, base, env=source_env(src), ready_path="/health"):
        best = float("inf")
        for _ in range(args.repeats + 1):  # the first is the warm-up
            stamps: list[float] = []
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{src}: HTTP {r.status_code}: {r.read().decode()[:300]}")
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.perf_counter())
            gaps = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
            best = min(best, gaps)
    return {"tpot_ms": 1000 * best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-src", type=Path, help="the other tree's src/ (e.g. main)")
    parser.add_argument("--head-src", type=Path, default=REPO / "src")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process (best)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=0, help="0: the engine's default")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--cases", default="inproc-1,inproc-16,server-1")
    parser.add_argument("--kv", default="paged,static", help="KV strategies of inproc cases")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.base_src is None:
        parser.error("--base-src is required")
    trees = {"base": args.base_src, "head": args.head_src}
    cases: list[tuple[str, str]] = []
    for case in args.cases.split(","):
        if case.startswith("inproc"):
            cases += [(case, kv) for kv in args.kv.split(",")]
        else:
            cases.append((case, "paged"))
    samples: dict[tuple[str, str, str], list[float]] = {}
    tokens: dict[tuple[str, str, str], list[list[int]]] = {}
    for rnd in range(args.rounds):
        order = ["base", "head"] if rnd % 2 == 0 else ["head", "base"]
        for case, kv in cases:
            for name in order:
                if case == "server-1":
                    result = run_server(trees[name], args)
                else:
                    result = run_inproc(trees[name], kv, int(case.split("-")[1]), args)
                    tokens[(case, kv, name)] = result["tokens"]
                metric = result["tok_s"] if case == "inproc-16" else result["tpot_ms"]
                samples.setdefault((case, kv, name), []).append(metric)
                print(f"round {rnd} {case} {kv} {name}: {metric:.3f}", file=sys.stderr)
    report = []
    for case, kv in cases:
        base = statistics.median(samples[(case, kv, "base")])
        head = statistics.median(samples[(case, kv, "head")])
        same = tokens.get((case, kv, "base")) == tokens.get((case, kv, "head"))
        unit = "tok/s" if case == "inproc-16" else "ms/token"
        report.append(
            {
                "case": case,
                "kv": kv,
                "unit": unit,
                "base": base,
                "head": head,
                "head_over_base": head / base,
                "same_tokens": same,
            }
        )
        print(
            f"{case:10s} {kv:7s} {unit:9s} base {base:9.3f} head {head:9.3f} "
            f"head/base {head / base:.3f}{'' if same else '  TOKENS DIFFER'}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args)
                    | {
                        "base_src": str(args.base_src),
                        "head_src": str(args.head_src),
                        "out": str(args.out),
                    },
                    "results": report,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
