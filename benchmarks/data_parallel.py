"""Data parallelism: 2 replicas behind the front end, prefix-aware routing against the others.

Workload: ``bench serve --dataset prefix`` (a few shared system prompts, each
followed by a unique suffix, interleaved) against ``tokenmill serve -dp 2`` once per
``--dp-routing`` policy, each on a fresh server. Reported per policy: the replicas' prefix
cache hit rate over the run (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, summed
over the replicas, from the front end's ``/metrics``), how the requests spread over the
replicas, and bench serve's TTFT. Threads: ``--threads-per-replica`` each (default 1, so 2
replicas use 2 cores).

    .venv/bin/python benchmarks/data_parallel.py --model demo --out results/data_parallel.json
    .venv/bin/python benchmarks/data_parallel.py --num-prompts 8 --prefix-len 64  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import free_port

from tokenmill.bench.server_metrics import sum_by_label

REPO = Path(__file__).resolve().parents[1]


def series(base_url: str, name: str) -> dict[str, float]:
    """A metric's values by ``replica`` label ('' for the aggregate)."""
    return sum_by_label(httpx.get(f"{base_url}/metrics", timeout=30).text, name, "replica")


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            state = httpx.get(f"{base_url}/dp/replicas", timeout=5).json()["replicas"]
            if all(r["ready"] for r in state):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise SystemExit("replicas did not become ready")


def run_policy(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", args.model,
        "--port", str(port), "--data-parallel-size", str(args.replicas),
        "--dp-routing", policy, "--num-threads", str(args.threads_per_replica),
        "--dtype", args.dtype, "--disable-log-stats", *shlex.split(args.server_flags),
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix=f"dp-{policy}-", suffix=".log", delete=False)  # noqa: SIM115  (outlives the function: named in the result)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_ready(base_url, server)
        hits0 = series(base_url, "vllm:prefix_cache_hits_total")
        queries0 = series(base_url, "vllm:prefix_cache_queries_total")
        routed0 = series(base_url, "tokenmill:dp_requests_routed_total")
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            bench = [
                sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve",
                "--base-url", base_url, "--dataset", "prefix",
                "--num-prompts", str(args.num_prompts), "--prefix-len", str(args.prefix_len),
                "--num-prefixes", str(args.num_prefixes), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
                "--save-result", result.name, "--seed", str(args.seed),
            ]  # fmt: skip
            subprocess.run(bench, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            report = json.loads(Path(result.name).read_text())
        hits = series(base_url, "vllm:prefix_cache_hits_total")
        queries = series(base_url, "vllm:prefix_cache_queries_total")
        routed = series(base_url, "tokenmill:dp_requests_routed_total")
    finally:
        server.terminate()
        server.wait(timeout=120)
    d_hits = hits.get("", 0.0) - hits0.get("", 0.0)
    d_queries = queries.get("", 0.0) - queries0.get("", 0.0)
    summary = report.get("summary", report)
    return {
        "policy": policy,
        "prefix_cache_hit_rate": d_hits / d_queries if d_queries else None,
        "requests_per_replica": {
            r: routed.get(r, 0.0) - routed0.get(r, 0.0) for r in sorted(routed) if r
        },
        "ttft": {
            k: v for k, v in summary.items() if "ttft" in k.lower() and not isinstance(v, list)
        },
        "server_log": log.name,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--server-flags",
        default="",
        help="more tokenmill serve flags, e.g. '--kv-cache-memory 10MiB' so that one replica "
        "cannot hold every prefix (the case prefix-aware routing is for)",
    )
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = [run_policy(args, policy) for policy in args.policies]
    for r in results:
        rate = r["prefix_cache_hit_rate"]
        print(
            f"{r['policy']:>13}: prefix cache hit rate "
            f"{'n/a' if rate is None else f'{rate:.1%}'}, per replica {r['requests_per_replica']}, "
            f"TTFT {r['ttft']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"config": vars(args) | {"out": str(args.out)}, "results": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
