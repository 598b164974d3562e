"""Beam search requests have their own HTTP admission bound: a beam flood never makes a
standard request get 429, nor wait for a beam search's place in the batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import WAIT_S, InProcessServer, serve_in_process, wait_healthy
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.admission import AdmissionController
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.state import ServerConfig

ENGINE_CONFIG = EngineConfig(
    model="demo", max_model_len=512, max_num_seqs=2, num_threads=1, max_beam_search_requests=1
)
SERVER_CONFIG = ServerConfig(
    max_num_seqs=2, max_queue_len=0, max_beam_search_requests=1, max_beam_search_queue_len=2
)
BEAM = {
    "prompt": "The",
    "max_tokens": 300,
    "best_of": 2,
    "use_beam_search": True,
    "ignore_eos": True,
}


def test_beam_requests_hold_beam_places_not_standard_ones() -> None:
    controller = AdmissionController(2, None, max_beam_requests_in_flight=3)
    beams = []
    for _ in range(3):
        ticket = controller.acquire(None)
        controller.grow(ticket, 1, 2, is_beam=True)
        beams.append(ticket)
    assert (controller.num_seqs_in_flight, controller.num_beam_requests_in_flight) == (0, 3)
    fourth = controller.acquire(None)
    with pytest.raises(APIError, match="beam search queue is full") as refused:
        controller.grow(fourth, 1, 2, is_beam=True)
    assert refused.value.status_code == 429
    controller.release(fourth)
    standard = [controller.acquire(None) for _ in range(2)]  # both standard places are free
    for ticket in standard:
        controller.grow(ticket, 1, 1)
    for ticket in [*beams, *standard]:
        controller.release(ticket)
    assert (controller.num_seqs_in_flight, controller.num_beam_requests_in_flight) == (0, 0)


@pytest.fixture(scope="module")
def server(demo_cache: str) -> Iterator[InProcessServer]:
    from tokenmill.engine.async_engine import AsyncLLMEngine

    running = serve_in_process(AsyncLLMEngine(ENGINE_CONFIG), SERVER_CONFIG, ENGINE_CONFIG)
    wait_healthy(running.base_url)
    yield running
    running.stop()


def test_a_beam_flood_never_refuses_or_delays_standard_requests(server: InProcessServer) -> None:
    url = f"{server.base_url}/v1/completions"
    engine = server.engine
    beam_results: list[httpx.Response] = []

    def beam() -> None:
        beam_results.append(httpx.post(url, json=BEAM, timeout=WAIT_S * 4))

    beams = [threading.Thread(target=beam) for _ in range(3)]  # 1 running + 2 queued: full
    for t in beams:
        t.start()
    deadline = threading.Event()
    while engine.num_streams < 3 or engine.stats.num_running < 2:  # the beam bound is full
        assert not deadline.wait(0.02) and all(t.is_alive() for t in beams), beam_results
    over = httpx.post(url, json=BEAM, timeout=WAIT_S)
    error = assert_error(over, 429, code="rate_limit_exceeded")
    assert "beam search queue" in error["message"]
    # The standard places (2 running, no queue) are all free, and their batch places too.
    results: list[httpx.Response] = []

    def standard() -> None:
        body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        results.append(httpx.post(url, json=body, timeout=WAIT_S))

    standards = [threading.Thread(target=standard) for _ in range(2)]
    for t in standards:
        t.start()
    for t in standards:
        t.join(WAIT_S)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    assert any(t.is_alive() for t in beams)  # served while the beam searches still ran
    for r in results:
        assert r.json()["usage"]["completion_tokens"] == 4
    for t in beams:
        t.join(WAIT_S * 4)
    assert [r.status_code for r in beam_results] == [200, 200, 200]
