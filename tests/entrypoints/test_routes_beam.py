"""A route with ``queue: beam`` sends its requests to the beam-search queue."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.inprocess import WAIT_S, InProcessServer, serve_in_process, wait_healthy
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.state import ServerConfig

ENGINE_CONFIG = EngineConfig(model="demo", max_model_len=128, max_num_seqs=8, num_threads=1)
ROUTES_YAML = """\
routes:
  - name: quality
    match: {headers: [quality]}
    queue: beam
"""


@pytest.fixture(scope="module")
def server(demo_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    from tokenmill.engine.async_engine import AsyncLLMEngine

    path = tmp_path_factory.mktemp("routes") / "routes.yaml"
    path.write_text(ROUTES_YAML)
    running = serve_in_process(
        AsyncLLMEngine(ENGINE_CONFIG),
        ServerConfig(max_num_seqs=8, routes_config=str(path)),
        ENGINE_CONFIG,
    )
    wait_healthy(running.base_url)
    yield running
    running.stop()


def _complete(url: str, body: dict, **headers: str) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_beam_route_runs_its_requests_as_beam_searches(server: InProcessServer) -> None:
    body = {"prompt": "The little dog ran to the", "max_tokens": 8, "best_of": 3}
    routed = _complete(server.base_url, body, **{"X-Tokenmill-Route": "quality"})
    explicit = _complete(server.base_url, {**body, "use_beam_search": True})
    assert routed["choices"][0]["text"] == explicit["choices"][0]["text"]
    # Beam search refuses logprobs: the route's request is refused, the same one elsewhere is not.
    probe = {"prompt": body["prompt"], "max_tokens": 2, "logprobs": 1}
    refused = httpx.post(
        f"{server.base_url}/v1/completions",
        json=probe,
        headers={"X-Tokenmill-Route": "quality"},
        timeout=WAIT_S,
    )
    assert refused.status_code == 400, refused.text
    assert "use_beam_search" in refused.json()["error"]["message"]
    assert _complete(server.base_url, probe)["choices"][0]["logprobs"] is not None
    # a request on the route that says use_beam_search: false keeps its own choice
    own = _complete(
        server.base_url, {**probe, "use_beam_search": False}, **{"X-Tokenmill-Route": "quality"}
    )
    assert own["choices"][0]["logprobs"] is not None
