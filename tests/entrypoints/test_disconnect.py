"""Client disconnects, streaming or not, queued, prefilling or decoding, abort the request at once.

The engine is gated (``StepGate``): the test hands out steps one at a time, closes clients
between steps, waits until the server has let go of them, and then checks from the
engine's own record that no abandoned request was scheduled after the step following
its client's departure. What is checked is steps, not seconds, so it holds on any machine.
"""

from __future__ import annotations

import json
import logging
import random
import socket
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import ServerHandle
from tests.entrypoints.inprocess import (
    WAIT_S,
    InProcessServer,
    StepGate,
    serve_in_process,
    wait_healthy,
)
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.state import ServerConfig

ENGINE_CONFIG = EngineConfig(
    model="demo", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=24, num_threads=1
)
"""Four running at once (the rest queue) and a 24-token step budget, so long prompts prefill in chunks."""
NUM_ROUNDS, PER_ROUND, MAX_STEPS_BEFORE_LEAVING = 25, 8, 8


class RawClient:
    """One HTTP request on its own socket, which the test closes whenever it likes."""

    def __init__(self, base_url: str, path: str, body: dict, request_id: str) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)
        self.sock.setblocking(False)
        self.received = b""

    def read_until(self, marker: bytes) -> bytes:
        """Block until ``marker`` has arrived (or the server closes); returns all received."""
        self.sock.setblocking(True)
        self.sock.settimeout(WAIT_S)
        while marker not in self.received and (chunk := self.sock.recv(65536)):
            self.received += chunk
        self.sock.setblocking(False)
        return self.received

    def close(self) -> None:
        """Read what has arrived (a stream's chunks so far), then hang up."""
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except BlockingIOError:
            pass
        self.sock.close()


@pytest.fixture(scope="module")
def gated(demo_cache: str) -> Iterator[tuple[InProcessServer, StepGate]]:
    gate = StepGate()
    engine = gate.async_engine(ENGINE_CONFIG)
    config = ServerConfig(max_num_seqs=ENGINE_CONFIG.max_num_seqs, max_queue_len=64)
    server = serve_in_process(engine, config, ENGINE_CONFIG)
    wait_healthy(server.base_url)
    yield server, gate
    gate.open()
    server.stop()


def _phase(gate: StepGate, engine_request_id: str, is_stream: bool) -> str:
    """Where the request is now: never scheduled, mid-prompt, or generating."""
    seen = gate.scheduled.get(engine_request_id)
    if not seen:
        return "queued"
    if not seen[-1].is_prefill_done:
        return "prefilling"
    return "streaming" if is_stream else "decoding"


def test_every_abandoned_request_is_aborted_by_the_step_after_its_client_left(
    gated: tuple[InProcessServer, StepGate],
) -> None:
    server, gate = gated
    admission = server.server.admission
    rng = random.Random(0)
    left_at: dict[str, int] = {}
    """Engine request id -> steps completed when its client hung up."""
    phases: Counter[str] = Counter()
    for round_index in range(NUM_ROUNDS):
        clients, ids, streams = [], [], []
        for i in range(PER_ROUND):
            number = round_index * PER_ROUND + i
            text = f"abandoned {number} " + "word " * rng.choice([0, 0, 30, 60])
            is_stream, is_chat = rng.random() < 0.5, rng.random() < 0.3
            body: dict = {"max_tokens": 200, "ignore_eos": True, "stream": is_stream}
            if is_chat:
                path, prefix = "/v1/chat/completions", "chatcmpl"
                body["messages"] = [{"role": "user", "content": text}]
            else:
                path, prefix = "/v1/completions", "cmpl"
                body["prompt"] = text
            clients.append(RawClient(server.base_url, path, body, f"gone-{number}"))
            ids.append(f"{prefix}-gone-{number}-0")  # the engine request of prompt 0
            streams.append(is_stream)
        gate.wait_until(
            lambda: server.engine.num_streams == PER_ROUND, "not every request reached the engine"
        )
        leave_after = [rng.randint(0, MAX_STEPS_BEFORE_LEAVING) for _ in clients]
        still_there = set(range(PER_ROUND))
        steps_taken = 0
        while still_there:
            # A step runs while clients hang up, so outputs and disconnects cross on the server.
            target = gate.num_steps + 1
            gate.allow()
            for c in [c for c in still_there if leave_after[c] == steps_taken]:
                phases[_phase(gate, ids[c], streams[c])] += 1
                left_at[ids[c]] = gate.num_steps
                clients[c].close()
                still_there.remove(c)
            gate.wait_until(
                lambda t=target: gate.num_steps >= t, "the engine never took the allowed step"
            )
            steps_taken += 1
            # Then the engine is held: the server must let go of every abandoned request (its
            # engine stream and its admission slot) before the next step may run.
            num_left = len(still_there)
            gate.wait_until(
                lambda n=num_left: server.engine.num_streams == n,
                "an abandoned request was not aborted",
            )
            gate.wait_until(
                lambda n=num_left: admission.num_requests_in_flight == n,
                "a handler kept its admission slot after its client left",
            )

    late = {
        rid: [s.step for s in gate.scheduled[rid] if s.step > step + 1]
        for rid, step in left_at.items()
    }
    assert not {rid: steps for rid, steps in late.items() if steps}, (
        "scheduled after the step after the client left"
    )
    assert len(left_at) == NUM_ROUNDS * PER_ROUND
    assert min(phases[p] for p in ("queued", "prefilling", "decoding", "streaming")) > 0, phases
    gate.open()
    gate.wait_until(
        lambda: server.engine.stats.num_running == 0 and server.engine.stats.num_waiting == 0,
        "requests left in the engine",
    )
    stats = server.engine.stats
    assert stats.kv_usage == 0, "KV blocks leaked"
    gate.close()


def test_a_stream_closed_after_its_first_event_frees_everything(server: ServerHandle) -> None:
    """The same over a real ``tokenmill serve`` process: abandoned streams leave nothing behind."""
    body = {"prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    for _ in range(8):
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers()
        ) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
    m = server.wait_idle(timeout_s=60)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
    assert m["tokenmill:kv_cache_usage_perc"] == 0


def test_a_request_id_in_use_is_refused_and_the_first_request_goes_on(
    gated: tuple[InProcessServer, StepGate],
) -> None:
    server, gate = gated
    body = {"prompt": "first", "max_tokens": 4, "ignore_eos": True}
    first = RawClient(server.base_url, "/v1/completions", body, "same-id")
    gate.wait_until(
        lambda: server.engine.num_streams == 1, "the first request never reached the engine"
    )
    second = httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"X-Request-Id": "same-id"},
        timeout=60,
    )
    assert second.status_code == 400 and second.json()["error"]["param"] == "request_id", (
        second.text
    )
    gate.open()  # the engine is held between tests: let the first run to its end
    received = first.read_until(b'"total_tokens"')
    gate.close()
    first.close()
    assert b'"completion_tokens":4' in received and b'"id":"cmpl-same-id"' in received


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "engine_id"),
    [
        (
            "/v1/completions",
            {"prompt": "left early", "max_tokens": 50, "ignore_eos": True},
            "cmpl-left-{}-0",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            "chatcmpl-left-{}-0",
        ),
        ("/v1/messages", {"messages": HI, "max_tokens": 50}, "msg-left-{}-0"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 50}, "resp-left-{}-0"),
    ],
)
def test_a_plain_request_whose_client_left_is_aborted_and_logged_as_499(
    gated: tuple[InProcessServer, StepGate], path: str, body: dict, engine_id: str
) -> None:
    """Every non-streamed route (one shared collect) aborts on hang-up; the access log says 499."""
    server, gate = gated
    rid = f"left-{path.rsplit('/', 1)[-1]}"
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    access = logging.getLogger("tokenmill.access")
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    client = RawClient(server.base_url, path, {**body, "model": "demo"}, rid)
    gate.wait_until(lambda: server.engine.num_streams == 1, "the request never reached the engine")
    gate.step_and_wait()
    assert gate.scheduled.get(engine_id.format(rid.removeprefix("left-"))), gate.scheduled.keys()
    client.close()
    gate.allow()  # the step on which the server notices
    gate.wait_until(lambda: server.engine.num_streams == 0, "the abandoned request was not aborted")
    gate.wait_until(
        lambda: server.server.admission.num_requests_in_flight == 0,
        "the handler kept its admission slot after its client left",
    )
    gate.wait_until(
        lambda: any(f'"POST {path}" 499' in line for line in lines), f"no 499 line: {lines}"
    )
    access.removeHandler(handler)
    access.setLevel(level)
    assert any(f"-{rid} prompt_tokens=" in line for line in lines if " 499 " in line), lines
