"""Bounded logs: repeated identical errors are summarised, and running out of file
descriptors makes accept() back off instead of logging ~10,000 lines a second."""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.entrypoints.conftest import REPO_ROOT, free_port
from tokenmill.entrypoints.log_limits import RepeatedRecordFilter


def _record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("x", level, __file__, 1, msg, None, None)


def test_repeated_records_are_held_back_then_counted() -> None:
    now = [0.0]
    limiter = RepeatedRecordFilter(burst=3, window_s=10.0, clock=lambda: now[0])
    passed = [limiter.filter(_record("boom")) for _ in range(100)]
    assert passed == [True] * 3 + [False] * 97
    assert limiter.filter(_record("other"))  # another message has its own budget
    assert all(limiter.filter(_record("boom", logging.INFO)) for _ in range(10))  # info: never
    now[0] = 10.5
    summary = _record("boom")
    assert limiter.filter(summary)
    assert "97 more like it" in str(summary.msg)


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))


def test_running_out_of_fds_does_not_flood_the_log(tmp_path: Path, demo_cache: str) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "demo"]
    cmd += ["--port", str(port), "--num-threads", "1"]
    env = {**os.environ, "TOKENMILL_CACHE": demo_cache}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_fds
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(3)  # the server is out of fds the whole time
        for s in held:
            s.close()
        time.sleep(1.5)
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        text = log_path.read_text(errors="replace")
        # Before: ~26,000 of these in 5 s (11 MB). Now one per second at most, 5 per 10 s shown.
        assert 1 <= text.count("out of system resource") <= 6, text[-3000:]
        assert len(text) < 50_000
    finally:
        server.terminate()
        server.wait(30)
