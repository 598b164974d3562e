"""The periodic stats line (vLLM's), and --enable-server-load-tracking's in-flight count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tokenmill.core.stats import EngineStats
from tokenmill.entrypoints.openai.middleware import ServerLoadMiddleware
from tokenmill.entrypoints.openai.stats_log import stats_line


def test_stats_line_reports_the_interval_and_idle_is_quiet() -> None:
    before = EngineStats(num_prompt_tokens=100, num_generation_tokens=10)
    after = EngineStats(
        num_prompt_tokens=300,
        num_generation_tokens=60,
        num_running=2,
        num_waiting=1,
        kv_usage=0.25,
        num_prefix_query_tokens=100,
        num_prefix_hit_tokens=40,
    )
    line, is_busy = stats_line(before, after, 10.0)
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    assert is_busy
    assert (
        stats_line(after, EngineStats(num_prompt_tokens=300, num_generation_tokens=60), 10.0)[1]
        is False
    )


def test_server_load_counts_generation_requests_until_their_stream_ends() -> None:
    seen: list[int] = []

    async def stream(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            seen.append(request.app.state.server_load_metrics)
            yield b"data: 1\n\n"
            await asyncio.sleep(0)
            seen.append(request.app.state.server_load_metrics)

        return StreamingResponse(body())

    app = Starlette(
        routes=[Route("/v1/completions", stream, methods=["POST"]), Route("/x", stream)]
    )
    app.state.server_load_metrics = 0
    app.add_middleware(ServerLoadMiddleware)  # as build_app adds it

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await client.post("/v1/completions")
            await client.get("/x")  # not a generation route: not counted

    asyncio.run(run())
    assert seen == [1, 1, 0, 0]
    assert app.state.server_load_metrics == 0
