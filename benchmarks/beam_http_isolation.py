"""Beam isolation over HTTP: standard requests' 429s and TTFT with and without a beam flood.

Workload: a real ``tokenmill serve`` with ``--max-num-seqs 16 --max-queue-len
16``; phase ``idle`` sends 16 concurrent streamed standard requests alone; phase ``flood``
first puts 30 beam search requests in flight (n=4, best_of=8, 400 tokens), waits until
they are admitted, then sends the same 16 standard requests. Before the fix, 13 of the 16
got 429 and the served ones waited 2.1 s for their first token (0.035 s idle).

    .venv/bin/python benchmarks/beam_http_isolation.py --out results/beam_http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, free_port, tokenmill_command


async def _standard(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, float | None]:
    """(status, seconds to the first streamed token)."""
    body = {"prompt": "The", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        ttft = None
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                ttft = time.monotonic() - start
        return 200, ttft


async def _phase(base_url: str, args: argparse.Namespace, with_beams: bool) -> dict:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        beams: list[asyncio.Task] = []
        if with_beams:
            body = {
                "prompt": "The license",
                "max_tokens": args.beam_max_tokens,
                "n": 4,
                "best_of": 8,
                "use_beam_search": True,
                "ignore_eos": True,
            }
            beams = [
                asyncio.create_task(client.post("/v1/completions", json=body))
                for _ in range(args.num_beams)
            ]
            await asyncio.sleep(args.beam_settle_s)  # admitted, the first searches running
        results = await asyncio.gather(
            *(_standard(client, args.std_max_tokens) for _ in range(args.num_standard))
        )
        beam_statuses = []
        for task in beams:
            if task.done():
                beam_statuses.append(task.result().status_code)
            task.cancel()
        await asyncio.gather(*beams, return_exceptions=True)
    ttfts = sorted(t for status, t in results if status == 200 and t is not None)
    return {
        "phase": "flood" if with_beams else "idle",
        "num_standard": len(results),
        "num_429": sum(1 for status, _ in results if status == 429),
        "num_other_errors": sum(1 for status, _ in results if status not in (200, 429)),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "num_beams_finished_during_phase": len(beam_statuses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-beams", type=int, default=30)
    parser.add_argument("--beam-max-tokens", type=int, default=400)
    parser.add_argument("--num-standard", type=int, default=16)
    parser.add_argument("--std-max-tokens", type=int, default=32)
    parser.add_argument("--beam-settle-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = free_port()
    cmd = tokenmill_command(
        "serve",
        args.model,
        "--port",
        str(port),
        "--max-num-seqs",
        "16",
        "--max-queue-len",
        "16",
        "--disable-access-log",
    )
    base_url = f"http://127.0.0.1:{port}"
    with Server(cmd, base_url, ready_path="/health", ready_timeout_s=300):
        results = [asyncio.run(_phase(base_url, args, with_beams)) for with_beams in (False, True)]
    for r in results:
        print(json.dumps(r))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
