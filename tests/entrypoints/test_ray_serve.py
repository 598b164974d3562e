"""``tokenmill serve --backend ray -dp 2``: the Ray Serve application on a local Ray instance.

Skipped without ``ray[serve]`` (``pip install 'tokenmill[ray]'``; the ``dev`` extra installs it,
so CI runs this). The server starts its own local Ray (no ``RAY_ADDRESS``), which ends with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import MAIN_KEY, ServerHandle, start_server, wait_healthy

pytest.importorskip("ray.serve")

SHARED = (
    "The little dog ran into the garden every morning to look for the red ball that the girl "
    "had thrown over the fence, and every morning the cat watched him from the wall. "
) * 2


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(
        tmp_path_factory.mktemp("ray"),
        "--backend",
        "ray",
        "-dp",
        "2",
        "--max-request-body-bytes",
        "65536",
        wait=False,
    )
    try:
        # The Ray application is up once its ingress answers /v1/models.
        wait_healthy(handle, path="/v1/models", request_timeout_s=10)
        yield handle
    finally:
        handle.stop()


def test_prefix_affinity_clients_auth_and_metrics_on_ray(ray_server: ServerHandle) -> None:
    client = ray_server.openai()
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens == 3
    homes = set()
    with ray_server.http() as http:
        for i in range(10):
            response = http.post(
                "/v1/completions",
                json={"model": "demo", "prompt": f"{SHARED} {i}", "max_tokens": 2},
            )
            assert response.status_code == 200, response.text
            homes.add(response.headers["x-tokenmill-replica"])
        # The mp front end's gates (shared): auth with WWW-Authenticate, the body limit from
        # Content-Length, Anthropic's shape on /v1/messages.
        wrong = http.get("/v1/models", headers={"Authorization": "bearer wrong"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers={"Authorization": "bearer " + MAIN_KEY}).is_success
        big = http.post("/v1/completions", json={"model": "demo", "prompt": "x" * 70_000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        body = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        anth = http.post("/v1/messages", headers={"Authorization": "Bearer nope"}, json=body)
        assert anth.status_code == 401 and anth.json()["error"]["type"] == "authentication_error"
    # Ray's prefix-aware router kept the shared prefix on one replica (random choice: 1 in 512)
    assert len(homes) == 1
    deadline = time.monotonic() + 300  # replicas push their metrics every 2 s (a ceiling)
    while True:
        text = httpx.get(
            f"{ray_server.base_url}/metrics", headers=ray_server.headers(), timeout=10
        ).text
        hits = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total{") and "replica=" in line
        ]
        if (len(hits) == 2 and max(hits) > 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(hits) == 2 and max(hits) > 0, text


def _engine_processes(server: ServerHandle) -> list[psutil.Process]:
    """The replicas' tokenmill engine processes: spawned children of Ray's replica actors."""
    found = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            parent = proc.parent()
            is_engine = "spawn_main" in " ".join(proc.cmdline())
            if is_engine and parent and "TokenmillEngine" in " ".join(parent.cmdline()):
                found.append(proc)
    return found


def test_a_killed_replica_loses_no_request_and_is_replaced(ray_server: ServerHandle) -> None:
    engines = _engine_processes(ray_server)
    assert len(engines) == 2, [p.cmdline() for p in engines]
    engines[0].kill()  # SIGKILL: the replica's engine is gone, Ray's actor lives on
    with ray_server.http() as http:
        # Prompts with nothing in common: the router spreads them, so some reach the dead
        # replica (all 8 missing it: 1 in 256). None had started anywhere: each is answered.
        for i in range(8):
            response = http.post(
                "/v1/completions",
                json={"model": "demo", "prompt": f"{i} {SHARED}", "max_tokens": 2},
            )
            assert response.status_code == 200, response.text
    deadline = time.monotonic() + 600  # Ray's health check replaces the replica
    while len(_engine_processes(ray_server)) < 2 or engines[0].is_running():
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)


def test_serve_controller_gets_the_proxy_timeout(ray_server: ServerHandle) -> None:
    """``--ray-proxy-timeout`` (60 s by default) reaches Serve's controller, which reads Ray's
    proxy check timeouts from its environment: at Ray's 5 s a starved proxy was killed."""
    from tokenmill.entrypoints.data_parallel.ray_app import PROXY_TIMEOUT_VARS

    controllers = []
    for proc in psutil.Process(ray_server.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ServeController" in " ".join(proc.cmdline()):
                controllers.append(proc.environ())
    assert controllers, "no Serve controller among the server's processes"
    for env in controllers:
        assert all(env.get(name) == "60.0" for name in PROXY_TIMEOUT_VARS), env


def test_proxy_timeouts_leave_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.entrypoints.data_parallel.ray_app import _proxy_timeouts

    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    assert _proxy_timeouts(30.0) == {
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30.0",
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "7",
    }
