"""Admission control on the shared server: 429 beyond batch + queue, priorities, /health.

The shared server runs ``--max-num-seqs 4 --max-queue-len 4 --scheduling-policy priority``.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.entrypoints.conftest import (
    MAIN_MAX_NUM_SEQS,
    MAIN_MAX_QUEUE_LEN,
    ServerHandle,
    assert_error,
)

CAPACITY = MAIN_MAX_NUM_SEQS + MAIN_MAX_QUEUE_LEN


async def _overload(server: ServerHandle, num_requests: int) -> tuple[list[httpx.Response], list[float], list[int]]:
    limits = httpx.Limits(max_connections=num_requests + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120,
                                 limits=limits) as client:
        health: list[int] = []
        done = asyncio.Event()

        async def poll_health() -> None:
            while not done.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

        async def one(i: int) -> tuple[httpx.Response, float]:
            body = {"prompt": f"request number {i}", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            start = time.monotonic()
            response = await client.post("/v1/completions", json=body)
            return response, time.monotonic() - start

        poller = asyncio.ensure_future(poll_health())
        results = await asyncio.gather(*(one(i) for i in range(num_requests)))
        done.set()
        await poller
    return [r for r, _ in results], [t for _, t in results], health


def test_overload_gets_429_admitted_complete_health_answers(server: ServerHandle) -> None:
    responses, latencies, health = asyncio.run(_overload(server, 4 * CAPACITY))
    ok = [r for r, t in zip(responses, latencies, strict=True) if r.status_code == 200]
    rejected = [(r, t) for r, t in zip(responses, latencies, strict=True) if r.status_code == 429]
    assert len(ok) + len(rejected) == len(responses), [r.status_code for r in responses]
    assert len(ok) >= CAPACITY and rejected
    for r in ok:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 48 and body["choices"][0]["finish_reason"] == "length"
    for r, latency in rejected:
        assert_error(r, 429, code="rate_limit_exceeded")
        assert int(r.headers["Retry-After"]) >= 1
        assert latency < 5.0
    assert health and set(health) == {200}
    m = server.wait_idle()
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0


async def _priority_order(server: ServerHandle) -> list[str]:
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120) as client:

        async def one(name: str, max_tokens: int, priority: int) -> None:
            body = {"prompt": f"{name} prompt", "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            finished.append(name)

        async def wait_for(name: str, value: int) -> None:
            for _ in range(400):
                if (await asyncio.to_thread(server.metrics))[name] >= value:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{name} never reached {value}")

        # blocker0 frees the first slot; the others hold theirs until long after.
        lengths = [80] + [200] * (MAIN_MAX_NUM_SEQS - 1)
        tasks = [asyncio.ensure_future(one(f"blocker{i}", n, 0)) for i, n in enumerate(lengths)]
        await wait_for("tokenmill:num_requests_running", MAIN_MAX_NUM_SEQS)
        tasks += [asyncio.ensure_future(one(f"low{i}", 4, 5)) for i in range(MAIN_MAX_QUEUE_LEN - 1)]
        await wait_for("tokenmill:num_requests_waiting", MAIN_MAX_QUEUE_LEN - 1)
        tasks.append(asyncio.ensure_future(one("high", 4, -5)))
        assert "blocker0" not in finished, "the precondition (every slot busy) did not hold"
        await asyncio.gather(*tasks)
    return finished


def test_priority_runs_before_earlier_lower_priority_requests(server: ServerHandle) -> None:
    order = asyncio.run(_priority_order(server))
    assert order.index("high") < min(order.index(f"low{i}") for i in range(MAIN_MAX_QUEUE_LEN - 1)), order
