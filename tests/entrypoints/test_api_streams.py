"""Failures after a Messages or Responses stream began are that API's own error event, and
``/load`` counts requests in flight.

The engine is gated (``StepGate``), so a request reliably outlives ``--request-timeout``
before its first token (plain requests answer 503 in the API's error shape, streams that
already sent their first event end with an ``error`` event), and stays in flight until the
test lets it finish.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.entrypoints.inprocess import (
    WAIT_S,
    InProcessServer,
    StepGate,
    serve_in_process,
    wait_healthy,
)
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.state import ServerConfig

ENGINE_CONFIG = EngineConfig(model="demo", max_model_len=256, max_num_seqs=4, num_threads=1)
MESSAGES_BODY = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES_BODY = {"model": "demo", "input": "Hi", "max_output_tokens": 4}


@pytest.fixture(scope="module")
def stalled(demo_cache: str) -> Iterator[InProcessServer]:
    gate = StepGate()
    engine = gate.async_engine(ENGINE_CONFIG)
    config = ServerConfig(max_num_seqs=ENGINE_CONFIG.max_num_seqs, request_timeout_s=0.5)
    server = serve_in_process(engine, config, ENGINE_CONFIG)
    wait_healthy(server.base_url)
    yield server
    gate.open()
    server.stop()


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def test_messages_timeout_is_anthropic_shaped(stalled: InProcessServer) -> None:
    url = f"{stalled.base_url}/v1/messages"
    plain = httpx.post(url, json=MESSAGES_BODY, timeout=30)
    assert plain.status_code == 503
    assert plain.json()["type"] == "error"
    assert plain.json()["error"]["type"] == "overloaded_error"
    with httpx.stream("POST", url, json={**MESSAGES_BODY, "stream": True}, timeout=30) as stream:
        assert stream.status_code == 200
        events = _events(stream)
    assert [name for name, _ in events] == ["message_start", "error"]
    assert events[-1][1]["type"] == "error"
    assert events[-1][1]["error"]["type"] == "overloaded_error"
    assert "timed out" in events[-1][1]["error"]["message"]


def test_responses_timeout_is_openai_shaped(stalled: InProcessServer) -> None:
    url = f"{stalled.base_url}/v1/responses"
    plain = httpx.post(url, json=RESPONSES_BODY, timeout=30)
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", url, json={**RESPONSES_BODY, "stream": True}, timeout=30) as stream:
        assert stream.status_code == 200
        events = _events(stream)
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "error"]
    error = events[-1][1]
    assert error["code"] == "request_timeout" and error["sequence_number"] == 2


def _wait_for_load(base_url: str, is_expected: Callable[[int], bool]) -> int:
    deadline = time.monotonic() + WAIT_S
    while True:
        load = httpx.get(f"{base_url}/load", timeout=10).json()["server_load"]
        if is_expected(load) or time.monotonic() > deadline:
            return load
        time.sleep(0.02)


def test_load_counts_the_requests_in_flight(demo_cache: str) -> None:
    gate = StepGate()
    engine = gate.async_engine(ENGINE_CONFIG)
    server = serve_in_process(engine, ServerConfig(max_num_seqs=4), ENGINE_CONFIG)
    try:
        wait_healthy(server.base_url)
        assert httpx.get(f"{server.base_url}/load").json() == {"server_load": 0}
        answers: list[int] = []
        clients = [
            threading.Thread(
                target=lambda path=path, body=body: answers.append(
                    httpx.post(f"{server.base_url}{path}", json=body, timeout=WAIT_S).status_code
                )
            )
            for path, body in (("/v1/messages", MESSAGES_BODY), ("/v1/responses", RESPONSES_BODY))
        ]
        for client in clients:
            client.start()
        # Nothing can finish while the engine takes no step: both stay in flight.
        assert _wait_for_load(server.base_url, lambda n: n == 2) == 2
        gate.open()
        for client in clients:
            client.join(WAIT_S)
        assert answers == [200, 200]
        assert _wait_for_load(server.base_url, lambda n: n == 0) == 0
    finally:
        gate.open()
        server.stop()
