"""Soak: thousands of mixed requests against a real server, watching its RSS.

Starts ``tokenmill serve`` (the demo model by default), sends ``--num-requests`` requests
from a fixed mix at ``--concurrency``: completions and chat (plain and streamed), n=2,
stop strings, logprobs and prompt logprobs, beam search, structured outputs (a few shared
JSON schemas and a unique regex each time, so the grammar cache fills), bad requests (400)
and clients that leave mid-stream. The server's RSS is sampled every ``--sample-every``
requests; the verdict compares the RSS at the end with the RSS halfway (flat: within 5%).

    .venv/bin/python benchmarks/soak.py --out results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, free_port, tokenmill_command

WORDS = [
    "the",
    "license",
    "of",
    "this",
    "software",
    "is",
    "granted",
    "to",
    "any",
    "person",
    "who",
    "obtains",
    "a",
    "copy",
]
SCHEMAS = [
    {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
    for i in range(4)
]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))


def _request(rng: random.Random, i: int) -> tuple[str, str, dict[str, Any], bool]:
    """(kind, path, body, leave early) for request ``i``."""
    roll = rng.random()
    chat = {"messages": [{"role": "user", "content": _prompt(rng)}]}
    base = {"max_tokens": rng.randint(2, 12), "temperature": rng.choice([0, 0.7, 1.0])}
    if roll < 0.25:
        return "completion", "/v1/completions", {"prompt": _prompt(rng), **base, "seed": i}, False
    if roll < 0.40:
        return "chat_stream", "/v1/chat/completions", {**chat, **base, "stream": True}, False
    if roll < 0.48:
        body = {"prompt": _prompt(rng), **base, "n": 2, "stop": ["."], "logprobs": 2}
        return "n2_logprobs", "/v1/completions", body, False
    if roll < 0.54:
        body = {"prompt": _prompt(rng), "max_tokens": 4, "echo": True, "logprobs": 1}
        return "prompt_logprobs", "/v1/completions", body, False
    if roll < 0.59:
        body = {"prompt": _prompt(rng), "max_tokens": 8, "n": 2, "use_beam_search": True}
        return "beam", "/v1/completions", body, False
    if roll < 0.69:
        schema = rng.choice(SCHEMAS)
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        return (
            "json_schema",
            "/v1/chat/completions",
            {**chat, **base, "response_format": fmt},
            False,
        )
    if roll < 0.74:  # a regex seen once: the grammar cache fills to its bound
        body = {"prompt": "Code:", "max_tokens": 6, "structured_outputs": {"regex": f"x{i}[a-z]+"}}
        return "unique_regex", "/v1/completions", body, False
    if roll < 0.92:
        bad = rng.choice(
            [
                {"prompt": "x", "max_tokens": -1},
                {"prompt": "x", "temperature": "hot"},
                {"prompt": "x", "unknown_field": 1},
                {"messages": [{"role": "tool", "content": "x"}]},
            ]
        )
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        return "bad_request", path, bad, False
    body = {"prompt": _prompt(rng), "max_tokens": 64, "ignore_eos": True, "stream": True}
    return "leaves_early", "/v1/completions", body, True


async def _send(client: httpx.AsyncClient, path: str, body: dict, leave: bool) -> int:
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as response:
            num_chunks = 0
            async for _ in response.aiter_lines():
                num_chunks += 1
                if leave and num_chunks >= 3:
                    break  # the client goes away mid-stream
            return response.status_code
    return (await client.post(path, json=body)).status_code


async def _soak(base_url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    process = psutil.Process(pid)
    plan = [_request(rng, i) for i in range(args.num_requests)]
    statuses: dict[str, dict[int, int]] = {}
    samples: list[tuple[int, float]] = [(0, process.memory_info().rss / 2**20)]
    next_index = 0
    num_done = 0
    lock = asyncio.Lock()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, num_done
        while True:
            async with lock:
                if next_index >= len(plan):
                    return
                kind, path, body, leave = plan[next_index]
                next_index += 1
            try:
                status = await _send(client, path, body, leave)
            except httpx.HTTPError:
                status = -1
            by_status = statuses.setdefault(kind, {})
            by_status[status] = by_status.get(status, 0) + 1
            num_done += 1
            if num_done % args.sample_every == 0:
                samples.append((num_done, process.memory_info().rss / 2**20))
                print(f"{num_done} requests: RSS {samples[-1][1]:.0f} MiB", flush=True)

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        elapsed = time.monotonic() - start
    half = min(samples, key=lambda s: abs(s[0] - args.num_requests // 2))
    end = samples[-1]
    growth = (end[1] - half[1]) / half[1]
    return {
        "num_requests": args.num_requests,
        "seconds": round(elapsed, 1),
        "rss_mib": [[n, round(mib, 1)] for n, mib in samples],
        "rss_half_mib": round(half[1], 1),
        "rss_end_mib": round(end[1], 1),
        "second_half_growth": round(growth, 4),
        "is_flat": abs(growth) <= 0.05,
        "statuses": statuses,
        "no_5xx": all(s < 500 for by in statuses.values() for s in by),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = free_port()
    cmd = tokenmill_command("serve", args.model)
    cmd += ["--port", str(port), "--disable-access-log", *args.server_arg]
    base_url = f"http://127.0.0.1:{port}"
    with Server(cmd, base_url, ready_path="/health", ready_timeout_s=300) as server:
        result = asyncio.run(_soak(base_url, server.pid, args))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {**vars(args), "out": str(args.out)}, **result}, indent=2)
        )


if __name__ == "__main__":
    main()
