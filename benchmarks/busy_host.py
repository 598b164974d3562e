"""One server's speed on a quiet host and beside a busy neighbour, for tokenmill and its peers.

Shared machines and CPU-limited containers run other jobs beside the server. Each server
(tokenmill, llama.cpp's server, vLLM CPU) is started alone on every core, measured with
``tokenmill bench serve`` (one stream: TPOT of ``--output-len`` tokens after an
``--input-len`` prompt; then ``--streams`` streams), then measured again while
``stress-ng --cpu N`` keeps N cores busy. What matters is each server's loaded/quiet ratio
(one run, same neighbour), not the servers' speeds against each other: they may run
different precisions (llama.cpp serves the GGUF file as shipped).

    .venv/bin/python benchmarks/busy_host.py --model ~/.cache/tokenmill-real/smollm2-135m-instruct \
        --gguf ~/.cache/tokenmill-real/SmolLM2-135M-Instruct.Q4_1.gguf --vllm --out results/busy-host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PEERS_ROOT, Server, bench_serve, free_port, peers_dir, tokenmill_command


@contextlib.contextmanager
def neighbour(num_cpus: int) -> Iterator[None]:
    """``stress-ng --cpu num_cpus`` for the duration (nothing when 0)."""
    if num_cpus <= 0:
        yield
        return
    if shutil.which("stress-ng") is None:
        raise SystemExit("stress-ng is not installed (apt-get install stress-ng)")
    proc = subprocess.Popen(
        ["stress-ng", "--cpu", str(num_cpus), "--timeout", "3600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(2)  # let it take its cores
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(30)


def server_commands(args: argparse.Namespace, port: int) -> dict[str, list[str]]:
    """Each server's command line, every core computing."""
    threads = str(os.cpu_count() or 1)
    commands = {
        "tokenmill": tokenmill_command(
            "serve", str(args.model), "--port", str(port), "--max-model-len", "2048",
            "--max-num-seqs", str(args.streams), "--kv-cache-memory", "1GiB",
            "--disable-access-log", *args.tokenmill_arg,
        ),
    }  # fmt: skip
    if args.gguf:
        binary = args.llama_server or PEERS_ROOT / "build-llama" / "bin" / "llama-server"
        commands["llama.cpp"] = [
            str(binary), "-m", str(args.gguf), "--port", str(port), "-t", threads,
            "-np", str(args.streams), "-c", str(args.streams * 1024), "-cb",
        ]  # fmt: skip
    if args.vllm:
        commands["vllm"] = [
            "env", "MAX_MODEL_LEN=2048", f"MAX_NUM_SEQS={args.streams}", "bash",
            str(peers_dir() / "vllm-cpu.sh"), "serve", str(args.model), str(port),
        ]  # fmt: skip
    return commands


def measure(
    args: argparse.Namespace, name: str, base_url: str, tag: str, tokenizer: Path | None = None
) -> dict[str, Any]:
    """One stream, then ``--streams`` streams; the headline figures of each (prompts from
    ``tokenizer``, by default ``--model``)."""
    figures: dict[str, Any] = {}
    for label, prompts, streams in (
        ("one_stream", args.one_stream_prompts, 1),
        ("streams", args.streams * 2, args.streams),
    ):
        raw = bench_serve(
            base_url,
            args.out / "raw" / f"{name}-{tag}-{label}.json",
            num_prompts=prompts,
            concurrency=streams,
            input_len=args.input_len,
            output_len=args.output_len,
            tokenizer=tokenizer or args.model,
            num_warmups=2,
        )
        figures[label] = {
            "mean_tpot_ms": round(raw["mean_tpot_ms"], 2),
            "output_throughput": round(raw["output_throughput"], 1),
            "mean_ttft_ms": round(raw["mean_ttft_ms"], 1),
        }
        print(
            f"  {name:9s} {tag:6s} {label:10s} TPOT {raw['mean_tpot_ms']:8.1f} ms  "
            f"{raw['output_throughput']:7.1f} tok/s",
            flush=True,
        )
    return figures


def cpu_isa() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    names = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx512f", "avx2")
    return next((n for n in names if f" {n}" in flags), "baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="HF folder (tokenmill, vLLM)")
    parser.add_argument("--gguf", type=Path, help="GGUF file for llama.cpp's server")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary")
    parser.add_argument("--vllm", action="store_true", help="also vLLM CPU (vllm-cpu.sh)")
    parser.add_argument("--busy-cpus", type=int, default=1, help="stress-ng --cpu N beside")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--one-stream-prompts", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tokenmill-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--only", help="comma list of servers to run")
    parser.add_argument("--out", type=Path, default=Path("bench-results/busy-host"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "isa": cpu_isa(),
        "busy_cpus": args.busy_cpus,
        "servers": {},
    }
    only = set(args.only.split(",")) if args.only else None
    for name, command in server_commands(args, port).items():
        if only and name not in only:
            continue
        print(f"{name}: {' '.join(command)}", flush=True)
        log = args.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with Server(command, base_url, log=log, ready_timeout_s=900):
            quiet = measure(args, name, base_url, "quiet")
            with neighbour(args.busy_cpus):
                loaded = measure(args, name, base_url, "loaded")
        ratio = loaded["one_stream"]["mean_tpot_ms"] / quiet["one_stream"]["mean_tpot_ms"]
        share = loaded["streams"]["output_throughput"] / quiet["streams"]["output_throughput"]
        results["servers"][name] = {
            "command": command,
            "quiet": quiet,
            "loaded": loaded,
            "one_stream_tpot_loaded_over_quiet": round(ratio, 2),
            "streams_throughput_loaded_over_quiet": round(share, 2),
        }
        (args.out / "result.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "servers"}, indent=2))
    for name, r in results["servers"].items():
        print(
            f"{name:9s} one-stream TPOT loaded/quiet {r['one_stream_tpot_loaded_over_quiet']:.2f}x, "
            f"{args.streams}-stream throughput loaded/quiet {r['streams_throughput_loaded_over_quiet']:.2f}x"
        )


if __name__ == "__main__":
    main()
