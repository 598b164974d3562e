"""An existing gateway in front of plain ``tokenmill serve`` replicas: SGLang's model gateway
(``smg`` on PyPI, a Rust router with cache-aware routing), two demo replicas on loopback.

What is checked: the official client through the gateway (plain and streaming), tokenmill's
own error JSON passed through, requests sharing a prefix kept on one replica by its
``cache_aware`` policy (counted from each replica's ``/metrics``), and a replica killed under
the gateway: the requests sent afterwards are served by the other one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import ServerHandle, free_port, start_server

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
pytestmark = pytest.mark.skipif(SMG is None, reason="smg (pip install smg) is not installed")

SHARED = (
    "The little dog ran into the garden every morning to look for the red ball that the girl "
    "had thrown over the fence, and every morning the cat watched him from the wall. "
)


def _served(replica: ServerHandle) -> float:
    """Requests the replica finished, from its own /metrics."""
    text = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[ServerHandle]]]:
    logs = tmp_path_factory.mktemp("smg")
    replicas = [start_server(logs, api_key=None) for _ in range(2)]
    port = free_port()
    log = open(logs / "smg.log", "wb")  # noqa: SIM115  (closed below)
    cmd = [
        str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(free_port()), "--policy", "cache_aware",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--worker-urls", *(r.base_url for r in replicas),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a ceiling: smg starts in seconds on an idle machine
        while True:
            assert proc.poll() is None, (logs / "smg.log").read_text()
            try:
                if httpx.get(f"{base_url}/v1/models", timeout=5).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (logs / "smg.log").read_text()
            time.sleep(0.3)
        yield base_url, replicas
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        for replica in replicas:
            replica.stop()


def test_clients_errors_and_prefix_affinity_through_smg(
    gateway: tuple[str, list[ServerHandle]],
) -> None:
    base_url, replicas = gateway
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.BadRequestError) as bad:  # tokenmill's own 400, passed through
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            logit_bias={"7": 1000.0},
        )
    assert bad.value.body == {  # the replica's error JSON, as tokenmill wrote it
        "message": "logit_bias values must be numbers in [-100, 100], got 1000.0",
        "type": "invalid_request_error",
        "param": "logit_bias",
        "code": None,
    }, bad.value.body

    before = [_served(r) for r in replicas]
    for i in range(10):
        client.completions.create(model="demo", prompt=f"{SHARED}{i}", max_tokens=2)
    gained = [_served(r) - b for r, b in zip(replicas, before, strict=True)]
    # cache_aware kept the shared prefix on one replica (random choice: 1 in 512)
    assert sorted(gained) == [0, 10], gained


def test_a_killed_replica_is_routed_around(gateway: tuple[str, list[ServerHandle]]) -> None:
    base_url, replicas = gateway
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    home = max(replicas, key=_served)  # the one holding the shared prefix
    other = next(r for r in replicas if r is not home)
    before = _served(other)
    home.process.kill()
    home.process.wait(timeout=30)
    for i in range(4):
        out = client.completions.create(model="demo", prompt=f"{SHARED}{i}", max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens == 2
    assert _served(other) - before == 4
