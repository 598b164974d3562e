"""API overhead benchmark: what Responses and Messages cost per request beyond chat
completions, and /v1/embeddings throughput at batch 1 and 32.

  overhead    one in-process ``tokenmill serve demo``; the same one-turn conversation, greedy,
              one output token, sent sequentially to /v1/chat/completions, /v1/responses and
              /v1/messages (interleaved, so drift hits all three alike); per-request latency
              (median, mean) and each API's difference from chat
  embeddings  one in-process ``tokenmill serve demo --runner pooling``; /v1/embeddings with
              1 input per request and with 32, sequentially; inputs/s and prompt tokens/s

    .venv/bin/python benchmarks/api_overhead.py --out results/api_overhead.json
    .venv/bin/python benchmarks/api_overhead.py --embeddings-url http://127.0.0.1:8001 --model M
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.entrypoints.openai.server import GracefulServer, build_app
from tokenmill.entrypoints.openai.state import ServerConfig

SYSTEM, USER = "Be brief.", "Tell me about the sea."
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": "demo",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            "max_tokens": 1,
            "temperature": 0,
        },
    ),
    "responses": (
        "/v1/responses",
        {
            "model": "demo",
            "instructions": SYSTEM,
            "input": USER,
            "max_output_tokens": 1,
            "temperature": 0,
            "store": False,
        },
    ),
    "messages": (
        "/v1/messages",
        {
            "model": "demo",
            "system": SYSTEM,
            "messages": [{"role": "user", "content": USER}],
            "max_tokens": 1,
            "temperature": 0,
        },
    ),
}


def _serve(engine_config: EngineConfig) -> tuple[GracefulServer, threading.Thread, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(port=port, disable_access_log=True)
    app = build_app(AsyncLLMEngine(engine_config), config, engine_config)
    server = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"), app
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return server, thread, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the in-process server did not become healthy")


def _stop(server: GracefulServer, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(60)


def measure_overhead(num_requests: int, num_threads: int) -> dict[str, Any]:
    server, thread, base_url = _serve(
        EngineConfig(model="demo", num_threads=num_threads, max_model_len=512)
    )
    latencies: dict[str, list[float]] = {name: [] for name in BODIES}
    try:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            for path, body in BODIES.values():  # warm-up, and a check each one works
                http.post(path, json=body).raise_for_status()
            for _ in range(num_requests):
                for name, (path, body) in BODIES.items():
                    start = time.perf_counter()
                    http.post(path, json=body).raise_for_status()
                    latencies[name].append((time.perf_counter() - start) * 1e3)
    finally:
        _stop(server, thread)
    chat_median = statistics.median(latencies["chat"])
    return {
        name: {
            "median_ms": round(statistics.median(values), 3),
            "mean_ms": round(statistics.fmean(values), 3),
            "median_over_chat_ms": round(statistics.median(values) - chat_median, 3),
            "num_requests": len(values),
        }
        for name, values in latencies.items()
    }


def measure_embeddings(
    num_inputs: int, num_threads: int, base_url: str | None = None, model: str = "demo"
) -> dict[str, Any]:
    """In-process on the demo model, or against ``base_url`` (e.g. ``vllm serve --runner pooling``)."""
    running = None
    if base_url is None:
        server, thread, base_url = _serve(
            EngineConfig(model="demo", num_threads=num_threads, runner="pooling", max_num_seqs=64)
        )
        running = (server, thread)
    texts = [f"{USER} Input number {i} of the benchmark." for i in range(num_inputs)]
    result: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            warm_up = {"model": model, "input": texts[:32]}
            http.post("/v1/embeddings", json=warm_up).raise_for_status()
            for batch in (1, 32):
                num_tokens = 0
                start = time.perf_counter()
                for i in range(0, num_inputs, batch):
                    body = {"model": model, "input": texts[i : i + batch]}
                    answer = http.post("/v1/embeddings", json=body)
                    answer.raise_for_status()
                    num_tokens += answer.json()["usage"]["prompt_tokens"]
                elapsed = time.perf_counter() - start
                result[f"batch_{batch}"] = {
                    "inputs_per_s": round(num_inputs / elapsed, 1),
                    "tokens_per_s": round(num_tokens / elapsed, 1),
                    "num_inputs": num_inputs,
                    "mean_tokens_per_input": round(num_tokens / num_inputs, 1),
                }
    finally:
        if running is not None:
            _stop(*running)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--num-requests", type=int, default=100, help="per API (overhead)")
    parser.add_argument("--num-inputs", type=int, default=256, help="per batch size (embeddings)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch compute threads")
    parser.add_argument(
        "--embeddings-url",
        default=None,
        help="measure /v1/embeddings of this running server instead (e.g. vLLM with --runner "
        "pooling on the same checkpoint); the overhead part is skipped",
    )
    parser.add_argument("--model", default="demo", help="model name sent with --embeddings-url")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.embeddings_url is not None:
        results = {
            "embeddings": measure_embeddings(
                args.num_inputs, args.num_threads, args.embeddings_url, args.model
            )
        }
    else:
        results = {
            "overhead": measure_overhead(args.num_requests, args.num_threads),
            "embeddings": measure_embeddings(args.num_inputs, args.num_threads),
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
