"""Real ``tokenmill serve`` processes on loopback, shared by the server tests.

The main server starts once per session (loading takes seconds); tests that need other
flags or kill their server start their own with ``start_server``. Servers run float32
unless a test passes ``--dtype`` (``auto`` is bf16 on a CPU with bf16 units). Every server uses one
torch thread (two would oversubscribe a small CI machine) and the same ``TOKENMILL_CACHE``
as CI (the demo model itself ships in the package).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MAIN_KEY = "sk-main-test-key"
OTHER_KEY = "sk-other-test-key"
MAIN_MAX_NUM_SEQS = 4
MAIN_MAX_QUEUE_LEN = 4
MAIN_MAX_MODEL_LEN = 256


def _cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE") or str(REPO_ROOT / ".cache" / "tokenmill")


# Ports below the kernel's ephemeral range and above Ray's worker ports (10002-19999).
_QUIET_PORTS = (20000, 32767)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free loopback port that no other process will be handed before the server binds it.

    ``bind(("127.0.0.1", 0))`` returns a port from the kernel's ephemeral range, and it is
    free only until we close the probe socket. A server that starts slowly then races every
    process that connects or binds meanwhile: a Ray Serve start opens dozens of sockets, and
    one of them took the port its proxy was about to bind (CI, "Address already in use").
    The kernel never hands out ports outside the ephemeral range on its own, so one picked
    there and probed stays free unless someone asks for it by number. Falls back to an
    ephemeral port if the quiet range is full or the range is not known.
    """
    ephemeral_low, ephemeral_high = _ephemeral_range()
    candidates = [
        port for port in range(*_QUIET_PORTS) if not ephemeral_low <= port <= ephemeral_high
    ]
    rng = random.Random()
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    """A running server process and how to talk to it."""

    process: subprocess.Popen
    port: int
    api_key: str | None
    log_path: Path
    health_seen: list[int] = field(default_factory=list)
    """Statuses /health answered while the server started (503 while loading)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, key: str | None = "default") -> dict[str, str]:
        key = self.api_key if key == "default" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def http(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=timeout_s)

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=60.0,
            **kwargs,
        )

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples without labels' values: ``name -> value`` (first series)."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers(), timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if match and match.group(1) not in values:
                values[match.group(1)] = float(match.group(3))
        return values

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """Wait until nothing runs or waits and the KV cache is empty; returns the metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (
                m["tokenmill:num_requests_running"] == 0
                and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    log_dir: Path,
    *flags: str,
    api_key: str | None = MAIN_KEY,
    wait: bool = True,
    model: str = "demo",
) -> ServerHandle:
    """Start ``python -m tokenmill.entrypoints.cli serve <model>`` and wait for /health."""
    port = free_port()
    env = {**os.environ, "TOKENMILL_CACHE": _cache_dir(), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TOKENMILL_API_KEY", None)
    log_path = log_dir / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-threads",
        "1",
        *(() if "--dtype" in flags else ("--dtype", "float32")),  # the figures tests expect
        *flags,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    handle = ServerHandle(process, port, api_key, log_path)
    if wait:
        wait_healthy(handle)
    return handle


def wait_healthy(
    handle: ServerHandle,
    timeout_s: float = 600.0,
    path: str = "/health",
    request_timeout_s: float = 2.0,
) -> None:
    """Poll ``path`` until it answers 200; fail (stopping the server) if it exits or the
    time runs out: a ceiling for a busy machine (start-up took over 120 s under stress-ng;
    a healthy start returns in seconds). Statuses seen are kept in ``handle.health_seen``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            pytest.fail(f"server exited with {handle.process.returncode}:\n{handle.log()}")
        try:
            status = httpx.get(
                f"{handle.base_url}{path}", headers=handle.headers(), timeout=request_timeout_s
            ).status_code
            handle.health_seen.append(status)
            if status == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    handle.stop()
    pytest.fail(f"server did not answer 200 on {path}:\n{handle.log()}")


@pytest.fixture(scope="session")
def demo_cache() -> str:
    """Check the shipped demo model is there before any server starts; returns the cache folder."""
    os.environ["TOKENMILL_CACHE"] = _cache_dir()
    from tokenmill.model.demo import demo_model_path

    demo_model_path()
    return _cache_dir()


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    """The shared server: small batch and queue, priority scheduling, two API keys."""
    handle = start_server(
        server_log_dir,
        "--max-num-seqs",
        str(MAIN_MAX_NUM_SEQS),
        "--max-queue-len",
        str(MAIN_MAX_QUEUE_LEN),
        "--max-model-len",
        str(MAIN_MAX_MODEL_LEN),
        "--scheduling-policy",
        "priority",
        "--max-request-body-bytes",
        "1MiB",
        "--api-key",
        OTHER_KEY,
    )
    yield handle
    handle.stop()
    assert handle.process.returncode == 0, handle.log()
    # Bad input, disconnects and overload are all expected: none may reach a traceback.
    assert "Traceback" not in handle.log(), handle.log()


@pytest.fixture
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return server.openai()


def sse_events(response: httpx.Response) -> list[dict | str]:
    """Parsed ``data:`` events of a streamed response; ``[DONE]`` stays a string."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(
    response: httpx.Response, status: int, param: str | None = "any", code: str | None = "any"
) -> dict:
    """The response is OpenAI's error shape with this status (and param/code when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    for leak in ("Traceback", 'File "', "/root", "/home", "site-packages", " at 0x"):
        assert leak not in error["message"], error
    return error
