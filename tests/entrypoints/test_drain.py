"""SIGTERM drains: new requests get 503 while in-flight ones finish, and at --shutdown-timeout
the rest are cut off with OpenAI-shaped 503s and aborted, then the server exits 0.

The engine is gated (``StepGate``), so "in flight at SIGTERM" and "still running at the
timeout" are facts the test arranges, not races it hopes to win.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import (
    WAIT_S,
    InProcessServer,
    StepGate,
    serve_in_process,
    wait_healthy,
)
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.state import ServerConfig

ENGINE_CONFIG = EngineConfig(model="demo", max_model_len=256, max_num_seqs=8, num_threads=1)


def _start(gate: StepGate, shutdown_timeout_s: float) -> InProcessServer:
    config = ServerConfig(
        max_num_seqs=ENGINE_CONFIG.max_num_seqs, shutdown_timeout_s=shutdown_timeout_s
    )
    server = serve_in_process(gate.async_engine(ENGINE_CONFIG), config, ENGINE_CONFIG)
    gate.open()
    wait_healthy(server.base_url)
    gate.close()
    return server


def _stream(base_url: str, body: dict) -> list[Any]:
    events: list[Any] = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def _plain(base_url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=WAIT_S)


def _sigterm_with_requests_in_flight(
    server: InProcessServer, gate: StepGate, pool: ThreadPoolExecutor, body: dict, num_each: int
) -> tuple[list, list]:
    streams = [pool.submit(_stream, server.base_url, body) for _ in range(num_each)]
    plains = [pool.submit(_plain, server.base_url, body) for _ in range(num_each)]
    gate.wait_until(
        lambda: server.engine.num_streams == 2 * num_each, "the requests never reached the engine"
    )
    server.server.handle_exit(signal.SIGTERM, None)
    gate.wait_until(lambda: server.server.state.is_draining, "SIGTERM did not start the drain")
    return streams, plains


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish() -> None:
    gate = StepGate()
    server = _start(gate, shutdown_timeout_s=WAIT_S)
    body = {"prompt": "drain me", "max_tokens": 12, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        streams, plains = _sigterm_with_requests_in_flight(server, gate, pool, body, num_each=2)
        # The engine is held: the in-flight requests cannot have finished yet.
        assert_error(_plain(server.base_url, {"prompt": "too late", "max_tokens": 2}), 503)
        assert_error(httpx.get(f"{server.base_url}/health", timeout=WAIT_S), 503)
        gate.open()
        for events in (f.result() for f in streams):
            assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 12  # ran to the end, not cut off
        for response in (f.result() for f in plains):
            assert (
                response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12
            )
    server.thread.join(WAIT_S)
    assert not server.thread.is_alive() and server.server.exit_code == 0


def test_shutdown_timeout_cuts_off_the_rest_with_503_and_aborts_them() -> None:
    gate = StepGate()
    server = _start(gate, shutdown_timeout_s=0.2)
    body = {"prompt": "never finishes", "max_tokens": 200, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        streams, plains = _sigterm_with_requests_in_flight(server, gate, pool, body, num_each=3)
        # The engine stays held, so nothing can finish: the timeout must cut every request off.
        for response in (f.result() for f in plains):
            error = assert_error(response, 503)
            assert "shutting down" in error["message"]
        for events in (f.result() for f in streams):
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "service_unavailable_error", events[-2]
        # Cut off means aborted: the engine let go of them while it was still held.
        gate.wait_until(lambda: server.engine.num_streams == 0, "cut-off requests were not aborted")
        steps_at_cut_off = gate.num_steps
        gate.open()
    server.thread.join(WAIT_S)
    assert not server.thread.is_alive() and server.server.exit_code == 0
    assert all(s.step <= steps_at_cut_off for runs in gate.scheduled.values() for s in runs)
