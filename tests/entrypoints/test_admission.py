"""Admission control: the controller's counts, then the shared server's 429s, 400s and priorities.

The shared server runs ``--max-num-seqs 4 --max-queue-len 4 --scheduling-policy priority``,
so it admits 8 sequences (prompts times n) at once.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from tests.entrypoints.conftest import (
    MAIN_MAX_NUM_SEQS,
    MAIN_MAX_QUEUE_LEN,
    ServerHandle,
    assert_error,
)
from tokenmill.entrypoints.openai.admission import AdmissionController
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.errors import InvalidRequestError

CAPACITY = MAIN_MAX_NUM_SEQS + MAIN_MAX_QUEUE_LEN


def test_controller_counts_sequences_and_requests_per_key() -> None:
    controller = AdmissionController(max_seqs_in_flight=8, per_key_max=2)
    first = controller.acquire(key_id=1)
    controller.grow(first, num_prompts=2, n=3)
    assert (controller.num_requests_in_flight, controller.num_seqs_in_flight) == (1, 6)
    second = controller.acquire(key_id=1)
    with pytest.raises(APIError) as refused:
        controller.grow(second, num_prompts=1, n=3)  # 6 + 3 > 8: not now
    assert refused.value.status_code == 429 and refused.value.headers["Retry-After"]
    assert second.num_seqs == 1 and controller.num_seqs_in_flight == 7
    with pytest.raises(APIError, match="API key"):
        controller.acquire(key_id=1)
    third = controller.acquire(key_id=2)
    with pytest.raises(APIError, match="capacity"):
        controller.acquire(key_id=3)
    for ticket in (first, second, third):
        controller.release(ticket)
    assert (controller.num_requests_in_flight, controller.num_seqs_in_flight) == (0, 0)


@pytest.mark.parametrize(
    ("num_prompts", "n", "param"), [(3, 3, "prompt"), (9, 1, "prompt"), (1, 9, "n")]
)
def test_controller_rejects_a_request_that_could_never_fit(
    num_prompts: int, n: int, param: str
) -> None:
    controller = AdmissionController(max_seqs_in_flight=8, per_key_max=None)
    ticket = controller.acquire(key_id=None)
    with pytest.raises(InvalidRequestError) as info:
        controller.grow(ticket, num_prompts, n)
    assert info.value.param == param and "--max-num-seqs + --max-queue-len" in info.value.message
    controller.release(ticket)
    assert controller.num_seqs_in_flight == 0


def test_request_larger_than_capacity_is_400_naming_prompt_or_n(http: httpx.Client) -> None:
    too_many_prompts = {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    error = assert_error(http.post("/v1/completions", json=too_many_prompts), 400, param="prompt")
    assert "9 sequences" in error["message"] and str(CAPACITY) in error["message"]
    assert_error(
        http.post("/v1/completions", json={"prompt": "a", "n": CAPACITY + 1, "max_tokens": 1}),
        400,
        param="n",
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": CAPACITY + 1, "max_tokens": 1}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, param="n")
    exact = {"prompt": ["a", "b"], "n": CAPACITY // 2, "max_tokens": 2, "ignore_eos": True}
    r = http.post("/v1/completions", json=exact)
    assert r.status_code == 200 and len(r.json()["choices"]) == CAPACITY, r.text


def test_request_that_does_not_fit_now_is_429(server: ServerHandle, http: httpx.Client) -> None:
    # A request whose body is still arriving holds its one admitted sequence, however fast the engine is.
    head_body, tail_body = b'{"prompt": "held", ', b'"max_tokens": 1}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(head_body + tail_body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    full = {"prompt": ["a", "b"], "n": CAPACITY // 2, "max_tokens": 1}
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as held:
        held.sendall(head + head_body)
        deadline = time.monotonic() + 10
        while (
            r := http.post("/v1/completions", json=full)
        ).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the server has read the held request's head
        assert_error(r, 429, code="rate_limit_exceeded")
        assert r.headers["Retry-After"]
        assert http.post("/v1/completions", json={**full, "n": 1}).status_code == 200
        held.sendall(tail_body)
        response = b""
        while chunk := held.recv(65536):
            response += chunk
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    assert http.post("/v1/completions", json=full).status_code == 200


async def _overload(
    server: ServerHandle, num_requests: int
) -> tuple[list[httpx.Response], list[float], list[int]]:
    limits = httpx.Limits(max_connections=num_requests + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.headers(), timeout=120, limits=limits
    ) as client:
        health: list[int] = []
        done = asyncio.Event()

        async def poll_health() -> None:
            while not done.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

        async def one(i: int) -> tuple[httpx.Response, float]:
            body = {
                "prompt": f"request number {i}",
                "max_tokens": 48,
                "ignore_eos": True,
                "temperature": 0,
            }
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
        assert (
            body["usage"]["completion_tokens"] == 48
            and body["choices"][0]["finish_reason"] == "length"
        )
    for r, _ in rejected:
        assert_error(r, 429, code="rate_limit_exceeded")
        assert int(r.headers["Retry-After"]) >= 1
    assert health and set(health) == {200}
    m = server.wait_idle()
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0


async def _priority_order(server: ServerHandle) -> list[str]:
    finished: list[str] = []
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.headers(), timeout=120
    ) as client:

        async def one(name: str, max_tokens: int, priority: int) -> None:
            body = {
                "prompt": f"{name} prompt",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "priority": priority,
            }
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
        tasks += [
            asyncio.ensure_future(one(f"low{i}", 4, 5)) for i in range(MAIN_MAX_QUEUE_LEN - 1)
        ]
        await wait_for("tokenmill:num_requests_waiting", MAIN_MAX_QUEUE_LEN - 1)
        tasks.append(asyncio.ensure_future(one("high", 4, -5)))
        assert "blocker0" not in finished, "the precondition (every slot busy) did not hold"
        await asyncio.gather(*tasks)
    return finished


def test_priority_runs_before_earlier_lower_priority_requests(server: ServerHandle) -> None:
    order = asyncio.run(_priority_order(server))
    assert order.index("high") < min(
        order.index(f"low{i}") for i in range(MAIN_MAX_QUEUE_LEN - 1)
    ), order
