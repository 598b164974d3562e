"""Reduced precision through the server: single-stream TPOT against the bandwidth bound,
16-stream throughput, peak RSS, tokenmill and llama.cpp's server side by side.

For each configuration a server is started (``tokenmill serve`` or llama.cpp's
``llama-server`` via ../shared/peers/build-llamacpp.sh), driven by ``tokenmill bench serve``
with 128-token prompts and 64 output tokens (EOS ignored): 8 requests one at a time, then 32
requests 16 at a time. Peak RSS is the server process's, polled. Read bandwidth (a sum over
1 GiB) is measured at the start of the same run; a configuration's bound is the bytes one
decode step must read (projection and LM-head weights in their stored form) over that
bandwidth.

    .venv/bin/python benchmarks/precision.py --out results/precision.json
    .venv/bin/python benchmarks/precision.py --configs fp32,bf16 --no-llamacpp  # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import PEERS_ROOT, RSSPoller, Server, bench_serve, peers_dir
from engine_core import DEFAULT_MODEL_DIR, MODEL_SHAPE, build_model, read_bandwidth_gbs

PEERS = peers_dir() / "build-llamacpp.sh"
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
GGUF_DIR = PEERS_ROOT / "gguf"

TOKENMILL_CONFIGS: dict[str, list[str]] = {
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "fp16": ["--dtype", "float16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4", "--quantization-group-size", "32"],
    "int8-fp8kv": ["--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "fp8"],
}
LLAMACPP_CONFIGS = {"fp32": "f32", "fp16": "f16", "int8": "q8_0", "int4": "q4_0"}
"""llama.cpp's nearest format per tokenmill configuration (Q8_0/Q4_0: blocks of 32)."""


def decode_weight_bytes(config: str) -> float:
    """Bytes one decode step reads: every projection and the LM head, as stored."""
    h, i, n = (
        MODEL_SHAPE["hidden_size"],
        MODEL_SHAPE["intermediate_size"],
        MODEL_SHAPE["num_hidden_layers"],
    )
    kv = h // MODEL_SHAPE["num_attention_heads"] * MODEL_SHAPE["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 2 * h * i + i * h
    head = MODEL_SHAPE["vocab_size"] * h
    width = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
    if config in width:
        return (n * per_layer + head) * width[config]
    layer_bytes = {"int8": 1.0, "int8-fp8kv": 1.0, "int4": 0.5 + 4 / 32}[
        config
    ]  # int4: bf16 scale+zero per 32
    return n * per_layer * layer_bytes + head * 1.0  # the LM head is int8 in both modes


def llama_server_command(binary: Path | None, gguf: Path, port: int) -> list[str]:
    """``build-llamacpp.sh serve``, or the same flags on another build of llama-server."""
    if binary is None:
        return ["bash", str(PEERS), "serve", str(gguf), str(port)]
    threads = str(os.cpu_count() or 1)
    return [
        str(binary),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "-t",
        threads,
        "-np",
        "16",
        "-c",
        "16384",
        "-cb",
    ]


def run_server(
    command: list[str], base_url: str, tokenizer: Path, workdir: Path, name: str
) -> dict[str, Any]:
    def bench(num_prompts: int, concurrency: int) -> dict[str, Any]:
        return bench_serve(
            base_url,
            workdir / f"{name}-{concurrency}.json",
            num_prompts=num_prompts,
            concurrency=concurrency,
            input_len=128,
            output_len=64,
            tokenizer=tokenizer,
        )

    with Server(command, base_url, log=workdir / f"{name}.log") as server:
        poller = RSSPoller(server.pid)
        single = bench(8, 1)
        many = bench(32, 16)
        peak_rss = poller.stop()
    return {
        "ready_s": server.ready_s,
        "single_tpot_ms": single["median_tpot_ms"],
        "single_ttft_ms": single["median_ttft_ms"],
        "tok_s_16": many["output_throughput"],
        "ttft_16_ms": many["median_ttft_ms"],
        "tpot_16_ms": many["median_tpot_ms"],
        "peak_rss_gib": peak_rss / 2**30,
        "engine_config": (many.get("server_metrics") or {}).get("engine_config"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
    )
    parser.add_argument("--configs", default=",".join(TOKENMILL_CONFIGS))
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument(
        "--llama-server",
        type=Path,
        help="a llama-server binary to run instead of build-llamacpp.sh's (same flags); e.g. one "
        "built without AMX where the OS refuses AMX tile state (llama.cpp dies with SIGILL)",
    )
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model = build_model(args.model_dir)
    base_url = f"http://127.0.0.1:{args.port}"
    torch.set_num_threads(psutil.cpu_count(logical=False) or 1)
    bandwidth = read_bandwidth_gbs()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_flags": sorted(
            f
            for f in Path("/proc/cpuinfo").read_text().split()
            if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
        ),
        "read_bandwidth_gbs": bandwidth,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in args.configs.split(","):
            command = [
                TOKENMILL,
                "serve",
                str(model),
                "--port",
                str(args.port),
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "32",
                "--kv-cache-memory",
                "1GiB",
                "--disable-access-log",
                *TOKENMILL_CONFIGS[name],
            ]
            run = run_server(command, base_url, model, workdir, f"tokenmill-{name}")
            run["bound_ms"] = decode_weight_bytes(name) / (bandwidth * 1e9) * 1e3
            results["runs"][f"tokenmill {name}"] = run
            print(f"tokenmill {name}: {run}", flush=True)
            llama = LLAMACPP_CONFIGS.get(name)
            gguf = GGUF_DIR / f"llama250m-{llama}.gguf"
            if args.no_llamacpp or llama is None or not gguf.is_file():
                continue
            run = run_server(
                llama_server_command(args.llama_server, gguf, args.port),
                base_url,
                model,
                workdir,
                f"llamacpp-{llama}",
            )
            results["runs"][f"llama.cpp {llama}"] = run
            print(f"llama.cpp {llama}: {run}", flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
