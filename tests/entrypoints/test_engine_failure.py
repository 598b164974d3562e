"""A stalled or crashing engine, in-process: timeouts answer, a dead engine fails fast, then exits 1.

The server (``tokenmill serve``'s GracefulServer) runs in-process on a thread so the test can
stall and then break the engine's ``step``; clients still talk to it over loopback HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from tests.entrypoints.conftest import assert_error, free_port
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.openai.server import GracefulServer, build_app
from tokenmill.entrypoints.openai.state import ServerConfig

DEAD_ENGINE_GRACE_S = 3.0


@dataclass
class InProcessServer:
    engine: AsyncLLMEngine
    base_url: str
    stall: threading.Event
    crash: threading.Event
    server: GracefulServer
    thread: threading.Thread


ENGINE_CONFIG = EngineConfig(model="demo", max_model_len=256, max_num_seqs=4, num_threads=1)


def _serve_in_process(engine: AsyncLLMEngine) -> tuple[GracefulServer, threading.Thread, str]:
    """``tokenmill serve``'s server on a thread; returns once it answers HTTP (loaded or not)."""
    port = free_port()
    config = ServerConfig(port=port, request_timeout_s=1.0, max_num_seqs=4, max_queue_len=4)
    app = build_app(engine, config, ENGINE_CONFIG)
    uv_config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = GracefulServer(uv_config, app)
    server.dead_engine_grace_s = DEAD_ENGINE_GRACE_S
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "in-process server never started"
        time.sleep(0.05)
    return server, thread, base_url


def _wait_healthy(base_url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "in-process server never became healthy"
        time.sleep(0.1)


def test_health_and_requests_are_503_while_the_model_loads(demo_cache: str) -> None:
    threads = torch.get_num_threads()
    loaded = threading.Event()

    def gated_engine(config: EngineConfig) -> LLMEngine:
        assert loaded.wait(60), "the test never let the model load"
        return LLMEngine(config)

    server, thread, base_url = _serve_in_process(AsyncLLMEngine(ENGINE_CONFIG, engine_factory=gated_engine))
    try:
        assert_error(httpx.get(f"{base_url}/health", timeout=10), 503, code="unhealthy")
        assert "loading" in httpx.get(f"{base_url}/health", timeout=10).json()["error"]["message"]
        early = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert early.status_code == 503 and early.json()["error"]["message"]
        loaded.set()
        _wait_healthy(base_url)
        ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        loaded.set()
        server.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inproc(demo_cache: str) -> Iterator[InProcessServer]:
    threads = torch.get_num_threads()
    engine = AsyncLLMEngine(ENGINE_CONFIG)
    server, thread, base_url = _serve_in_process(engine)
    handle = InProcessServer(engine, base_url, threading.Event(), threading.Event(), server, thread)
    _wait_healthy(base_url)
    real_step = engine.engine.step

    def step():
        if handle.crash.is_set():
            raise RuntimeError("boom at 0x7f3a2b1c /secret/path/model.py")
        if handle.stall.is_set():
            time.sleep(0.02)
            return []
        return real_step()

    engine.engine.step = step  # type: ignore[method-assign]
    yield handle
    server.should_exit = True
    thread.join(30)
    torch.set_num_threads(threads)


def _chat_stream(base_url: str) -> list:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def test_request_that_never_gets_output_times_out_with_503(inproc: InProcessServer) -> None:
    inproc.stall.set()
    try:
        start = time.monotonic()
        r = httpx.post(f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert_error(r, 503, code="request_timeout")
        assert time.monotonic() - start >= 1.0  # the deadline, whatever the machine's speed
        events = _chat_stream(inproc.base_url)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    finally:
        inproc.stall.clear()
    ok = httpx.post(f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_engine_crash_fails_in_flight_marks_unhealthy_then_exits_1(inproc: InProcessServer) -> None:
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{inproc.base_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
            if len(events) == 1:
                inproc.crash.set()
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "internal_server_error"
    for leak in ("boom", "0x", "/secret", "Traceback"):
        assert leak not in error["message"]
    r = httpx.post(f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=10)
    error = assert_error(r, 500, code="engine_dead")
    assert "boom" not in error["message"]
    assert_error(httpx.get(f"{inproc.base_url}/health", timeout=10), 503)
    inproc.thread.join(30)
    assert not inproc.thread.is_alive(), "the server kept running with a dead engine"
    assert inproc.server.exit_code == 1
