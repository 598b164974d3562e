"""The same GGUF file served by tokenmill and by llama.cpp's server, one after the other.

For each file: ``tokenmill serve FILE.gguf`` (its quantized blocks on tokenmill's int
kernels, ``model/gguf_weights.py``) and ``llama-server -m FILE.gguf``, every core computing,
measured with ``tokenmill bench serve``: one stream (TPOT of ``--output-len`` tokens after an
``--input-len`` prompt, ``--one-stream-prompts`` requests) and ``--streams`` streams
(twice as many requests); greedy, EOS ignored, 2 warm-ups. Peak RSS of each server's
process tree over its whole life (loading included).

    .venv/bin/python benchmarks/gguf_peers.py ~/.cache/tokenmill-real/SmolLM2-135M-Instruct.Q4_1.gguf \
        ~/.cache/tokenmill-real/gemma-3-270m-q4_k_m.gguf --out results/gguf-peers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PEERS_ROOT, Server, free_port, tokenmill_command
from busy_host import cpu_isa, measure

from tokenmill.model.source import resolve_model_path


def commands(args: argparse.Namespace, gguf: Path, port: int) -> dict[str, list[str]]:
    threads = str(os.cpu_count() or 1)
    binary = args.llama_server or PEERS_ROOT / "build-llama" / "bin" / "llama-server"
    return {
        "tokenmill": tokenmill_command(
            "serve", str(gguf), "--port", str(port), "--max-model-len", "2048",
            "--max-num-seqs", str(args.streams), "--kv-cache-memory", "1GiB",
            "--disable-access-log",
        ),
        "llama.cpp": [
            str(binary), "-m", str(gguf), "--port", str(port), "-t", threads,
            "-np", str(args.streams), "-c", str(args.streams * 1024), "-cb",
        ],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path, nargs="+")
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--one-stream-prompts", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/gguf-peers"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "isa": cpu_isa(),
        "files": {},
    }
    for gguf in args.gguf:
        saved = sys.path[:]  # a module here could shadow a package transformers probes
        here = str(Path(__file__).resolve().parent)
        sys.path[:] = [p for p in sys.path if p not in ("", here)]
        try:
            tokenizer = resolve_model_path(str(gguf))  # the folder tokenmill reads it through
        finally:
            sys.path[:] = saved
        per_file: dict[str, Any] = {}
        for name, command in commands(args, gguf, port).items():
            print(f"{gguf.name} {name}: {' '.join(command)}", flush=True)
            log = args.out / "logs" / f"{gguf.stem}-{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            figures: dict[str, Any] = {"command": command}
            with Server(command, base_url, log=log, ready_timeout_s=900, poll_rss=True) as server:
                figures.update(measure(args, f"{gguf.stem}-{name}", base_url, "quiet", tokenizer))
                assert server.rss is not None
                figures["peak_rss_mib"] = round(server.rss.stop() / 2**20)
            per_file[name] = figures
            results["files"][gguf.name] = per_file
            (args.out / "result.json").write_text(json.dumps(results, indent=2))
        tm, lc = per_file["tokenmill"], per_file["llama.cpp"]
        per_file["ratios"] = {
            "one_stream_tpot_tokenmill_over_llamacpp": round(
                tm["one_stream"]["mean_tpot_ms"] / lc["one_stream"]["mean_tpot_ms"], 2
            ),
            "streams_throughput_tokenmill_over_llamacpp": round(
                tm["streams"]["output_throughput"] / lc["streams"]["output_throughput"], 2
            ),
        }
        print(f"{gguf.name}: {per_file['ratios']}", flush=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
