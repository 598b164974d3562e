"""Client disconnects, streaming or not, queued or running, abort the request at once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from tests.entrypoints.conftest import ServerHandle


async def _cancel_many(server: ServerHandle, num_streams: int, num_plain: int) -> dict[str, int]:
    counts = {"cancelled": 0, "rejected": 0}
    gate = asyncio.Semaphore(6)
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=60) as client:

        async def stream_then_close(i: int) -> None:
            body = {"prompt": f"story {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            if i % 2:
                body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
            num_events = rng.randint(0, 3)
            async with gate:
                while True:
                    async with client.stream("POST", path, json=body) as response:
                        if response.status_code == 429:  # a slot not yet released by a previous close
                            counts["rejected"] += 1
                            await asyncio.sleep(0.05)
                            continue
                        assert response.status_code == 200
                        seen = 0
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                seen += 1
                                if seen > num_events:
                                    break
                    counts["cancelled"] += 1
                    return

        async def post_then_give_up(i: int) -> None:
            body = {"prompt": f"essay {i}", "max_tokens": 200, "ignore_eos": True}
            async with gate:
                while True:
                    try:
                        response = await client.post("/v1/completions", json=body, timeout=0.05 + 0.02 * i)
                    except httpx.TimeoutException:
                        counts["cancelled"] += 1
                        return
                    # a slot not yet released by a previous close; anything else is a failure
                    assert response.status_code == 429, response.text
                    counts["rejected"] += 1
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(stream_then_close(i) for i in range(num_streams)),
                             *(post_then_give_up(i) for i in range(num_plain)))
    return counts


def test_hundred_cancelled_streams_free_everything(server: ServerHandle) -> None:
    before = server.metrics()
    counts = asyncio.run(_cancel_many(server, num_streams=100, num_plain=8))
    assert counts["cancelled"] == 108, counts
    start = time.monotonic()
    r = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers(), timeout=30,
                   json={"prompt": "fresh", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert time.monotonic() - start < 10
    after = server.wait_idle()
    assert after["tokenmill:num_requests_running"] == 0
    assert after["tokenmill:num_requests_waiting"] == 0
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    # each cancelled request produced far fewer than its 200 tokens
    generated = after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
    assert generated < 108 * 200 / 4, generated


def test_disconnect_aborts_within_a_step(server: ServerHandle) -> None:
    server.wait_idle()
    before = server.metrics()["tokenmill:generation_tokens_total"]
    body = {"prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers()) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    m = server.wait_idle(timeout_s=5)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0
    assert m["tokenmill:generation_tokens_total"] - before < 50


def test_non_streaming_client_that_gives_up_aborts_the_request(server: ServerHandle) -> None:
    server.wait_idle()
    before = server.metrics()["tokenmill:generation_tokens_total"]
    body = {"prompt": "a long one", "max_tokens": 240, "ignore_eos": True}
    try:
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers(), timeout=0.2)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("240 tokens came back within 0.2 s; the test needs a longer request")
    m = server.wait_idle(timeout_s=5)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0
    assert m["tokenmill:generation_tokens_total"] - before < 150  # stopped well before its 240 tokens
