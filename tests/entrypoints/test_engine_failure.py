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

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import InProcessServer, serve_in_process, wait_healthy
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.openai.state import ServerConfig

DEAD_ENGINE_GRACE_S = 3.0


@dataclass
class FailingServer:
    """The in-process server plus the switches that stall or crash its engine's step."""

    served: InProcessServer
    stall: threading.Event
    crash: threading.Event

    @property
    def base_url(self) -> str:
        return self.served.base_url


ENGINE_CONFIG = EngineConfig(model="demo", max_model_len=256, max_num_seqs=4, num_threads=1)
SERVER_CONFIG = ServerConfig(request_timeout_s=1.0, max_num_seqs=4, max_queue_len=4)


def _serve(engine: AsyncLLMEngine) -> InProcessServer:
    served = serve_in_process(engine, SERVER_CONFIG, ENGINE_CONFIG)
    served.server.dead_engine_grace_s = DEAD_ENGINE_GRACE_S
    return served


def test_health_and_requests_are_503_while_the_model_loads(demo_cache: str) -> None:
    threads = torch.get_num_threads()
    loaded = threading.Event()

    def gated_engine(config: EngineConfig) -> LLMEngine:
        assert loaded.wait(60), "the test never let the model load"
        return LLMEngine(config)

    served = _serve(AsyncLLMEngine(ENGINE_CONFIG, engine_factory=gated_engine))
    base_url = served.base_url
    try:
        assert_error(httpx.get(f"{base_url}/health", timeout=10), 503, code="unhealthy")
        assert "loading" in httpx.get(f"{base_url}/health", timeout=10).json()["error"]["message"]
        early = httpx.post(
            f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10
        )
        assert early.status_code == 503 and early.json()["error"]["message"]
        loaded.set()
        wait_healthy(base_url)
        ok = httpx.post(
            f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert ok.status_code == 200, ok.text
    finally:
        loaded.set()
        served.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inproc(demo_cache: str) -> Iterator[FailingServer]:
    threads = torch.get_num_threads()
    engine = AsyncLLMEngine(ENGINE_CONFIG)
    served = _serve(engine)
    handle = FailingServer(served, threading.Event(), threading.Event())
    wait_healthy(served.base_url)
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
    served.stop()
    torch.set_num_threads(threads)


def _chat_stream(base_url: str) -> list:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def test_a_request_whose_sampling_raises_gets_500_and_its_batch_goes_on(
    inproc: FailingServer,
) -> None:
    """The engine's error boundary over HTTP: one request of a batch fails in the sampler;
    it gets a 500 in OpenAI's shape, the others their full output, and /health stays 200."""
    from tokenmill.sampling.sampler import Sampler

    class FlakySampler(Sampler):
        def __call__(self, logits, requests, token_bitmask=None):  # type: ignore[no-untyped-def]
            if any(r.sampling_params.seed == 666 for r in requests):
                raise RuntimeError("injected failure at 0x7f00dead /secret/sampler.py")
            return super().__call__(logits, requests, token_bitmask)

    sampler = inproc.served.engine.engine.runner.sampler
    sampler.__class__ = FlakySampler
    url = f"{inproc.base_url}/v1/completions"
    body = {"prompt": "The", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    results: dict[str, httpx.Response] = {}

    def post(name: str, extra: dict) -> None:
        results[name] = httpx.post(url, json={**body, **extra}, timeout=60)

    try:
        threads = [
            threading.Thread(target=post, args=(name, extra))
            for name, extra in (("ok1", {}), ("bad", {"seed": 666}), ("ok2", {"n": 2}))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sampler.__class__ = Sampler
    error = assert_error(results["bad"], 500, code="request_failed")
    assert "injected" not in error["message"]
    for name in ("ok1", "ok2"):
        assert results[name].status_code == 200, results[name].text
        for choice in results[name].json()["choices"]:
            assert choice["finish_reason"] == "length"
    assert httpx.get(f"{inproc.base_url}/health", timeout=10).status_code == 200
    again = httpx.post(url, json={**body, "seed": 666}, timeout=60)
    assert again.status_code == 200, again.text


def test_request_that_never_gets_output_times_out_with_503(inproc: FailingServer) -> None:
    inproc.stall.set()
    try:
        start = time.monotonic()
        r = httpx.post(
            f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30
        )
        assert_error(r, 503, code="request_timeout")
        assert time.monotonic() - start >= 1.0  # the deadline, whatever the machine's speed
        events = _chat_stream(inproc.base_url)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    finally:
        inproc.stall.clear()
    ok = httpx.post(
        f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert ok.status_code == 200, ok.text


def test_engine_crash_fails_in_flight_marks_unhealthy_then_exits_1(inproc: FailingServer) -> None:
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
    r = httpx.post(
        f"{inproc.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=10
    )
    error = assert_error(r, 500, code="engine_dead")
    assert "boom" not in error["message"]
    assert_error(httpx.get(f"{inproc.base_url}/health", timeout=10), 503)
    inproc.served.thread.join(30)
    assert not inproc.served.thread.is_alive(), "the server kept running with a dead engine"
    assert inproc.served.server.exit_code == 1
