"""Peak RSS of one tokenmill server, per workload phase.

Starts ``peers_servers.tokenmill_serve``'s server on the 250M benchmark Llama (1 GiB of
KV, 32 sequences, every core, plus any flags given), polls the RSS of its process tree every 0.2 s from its
start, and runs three workloads through it with ``tokenmill bench serve``: single = 3 x
(128 -> 32) at 1 stream, many = 32 x (128 -> 64) at 16, long = 16 x (1024 -> 64) at 8.
Prints the RSS once ready (after the load) and each phase's peak.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_rss.py --quantization int8
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/serve_rss.py   # another tree
    PYTHONPATH=src .venv/bin/python benchmarks/serve_rss.py --model DIR --only single --dtype bfloat16

``--model`` serves another folder (its tokenizer drives the bench), ``--only`` runs some
phases; every other argument goes to ``tokenmill serve``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, bench_serve
from peers_servers import tokenmill_serve

MODEL = Path.home() / ".cache" / "tokenmill" / "bench-llama-250m"
PORT = 8655
PHASES = [("single", 3, 1, 128, 32), ("many", 32, 16, 128, 64), ("long", 16, 8, 1024, 64)]
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--only", default=None, help="comma list of phases: single, many, long")
    args, serve_flags = parser.parse_known_args()
    model: Path = args.model
    phases = [p for p in PHASES if args.only is None or p[0] in args.only.split(",")]
    command = tokenmill_serve(PORT, model, serve_flags, max_model_len=2048)
    url = f"http://127.0.0.1:{PORT}"
    out = Path(tempfile.mkdtemp(prefix="serve-rss-"))
    with Server(command, url, log=out / "server.log", poll_rss=True) as server:
        assert server.rss is not None
        print(f"ready in {server.ready_s:.1f} s: RSS {server.rss.rss() / GIB:.3f} GiB", flush=True)
        for name, prompts, streams, input_len, output_len in phases:
            server.rss.mark()
            result = bench_serve(
                url,
                out / f"{name}.json",
                num_prompts=prompts,
                concurrency=streams,
                input_len=input_len,
                output_len=output_len,
                tokenizer=model,
            )
            time.sleep(0.5)
            print(
                f"{name}: peak {server.rss.peak_since_mark / GIB:.3f} GiB, "
                f"{result['output_throughput']:.1f} tok/s",
                flush=True,
            )
        print(f"peak over the whole run (load included): {server.rss.peak / GIB:.3f} GiB")


if __name__ == "__main__":
    main()
