"""A server of its own: open health/metrics, per-key quota, request timeout, exit on SIGTERM.

Runs ``--max-num-seqs 2 --per-key-max-concurrency 2 --request-timeout 2`` with two keys,
``--disable-auth-for-health-metrics`` and ``--trust-request-chat-template``. The drain itself
(in-flight requests, the shutdown timeout) is tested against a gated engine in test_drain.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import REPO_ROOT, ServerHandle, assert_error, start_server

KEY_A, KEY_B = "sk-lifecycle-a", "sk-lifecycle-b"
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def lifecycle(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        server_log_dir,
        "--max-num-seqs",
        "2",
        "--max-queue-len",
        "4",
        "--per-key-max-concurrency",
        "2",
        "--request-timeout",
        str(TIMEOUT_S),
        "--disable-auth-for-health-metrics",
        "--api-key",
        KEY_B,
        "--shutdown-timeout",
        "20",
        "--trust-request-chat-template",
        api_key=KEY_A,
    )
    yield handle
    handle.stop()  # SIGTERM with nothing in flight: a clean exit
    assert handle.process.returncode == 0, handle.log()


def _post(
    handle: ServerHandle, key: str, body: dict, path: str = "/v1/completions"
) -> httpx.Response:
    return httpx.post(
        handle.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def _stream_events(
    handle: ServerHandle, key: str, body: dict, first_event: threading.Event | None = None
) -> list:
    events = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST",
        handle.base_url + "/v1/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if first_event is not None:
                    first_event.set()
    return events


def test_health_during_start_up_is_503_then_200(lifecycle: ServerHandle) -> None:
    # Whether a poll lands inside the (sub-second) load is a race; test_engine_failure gates
    # the load to see the 503 for certain. Here: nothing but 503 before the first 200.
    assert lifecycle.health_seen[-1] == 200 and set(lifecycle.health_seen[:-1]) <= {503}


def test_health_and_metrics_open_by_flag_and_nothing_else(lifecycle: ServerHandle) -> None:
    base = lifecycle.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    assert "tokenmill:num_requests_running" in httpx.get(f"{base}/metrics").text
    for method, path in [
        ("GET", "/health/"),
        ("GET", "//health"),
        ("POST", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/version"),
        ("OPTIONS", "/metrics"),
        ("POST", "/tokenize"),
    ]:
        assert_error(httpx.request(method, base + path, json={"prompt": "x"}), 401)


def test_trusted_request_chat_template_is_used_and_still_sandboxed(lifecycle: ServerHandle) -> None:
    messages = [{"role": "user", "content": "hello"}]
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    custom = _post(
        lifecycle, KEY_A, {"messages": messages, "chat_template": template}, "/tokenize"
    ).json()
    plain = _post(
        lifecycle, KEY_A, {"prompt": "<<hello>>", "add_special_tokens": False}, "/tokenize"
    ).json()
    assert custom["tokens"] == plain["tokens"]
    r = _post(
        lifecycle,
        KEY_A,
        {"messages": messages, "chat_template": template, "max_tokens": 2},
        "/v1/chat/completions",
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain["count"]
    for escape in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception(cycler) }}",
        "{% for x in range(10**9) %}{% endfor %}",
        "{{ 'a' * 100000000 }}",
        "{{ '{:>999999999}'.format(1) }}",
    ):
        r = _post(
            lifecycle,
            KEY_A,
            {"messages": messages, "chat_template": escape, "max_tokens": 2},
            "/v1/chat/completions",
        )
        error = assert_error(r, 400, param="messages")
        assert "0x" not in error["message"] or "0x…" in error["message"]
    # A template that loops is stopped by --chat-template-timeout (2 s by default).
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    r = _post(
        lifecycle,
        KEY_A,
        {"messages": messages, "chat_template": loop, "max_tokens": 2},
        "/v1/chat/completions",
    )
    assert "longer than" in assert_error(r, 400, param="chat_template")["message"]


def test_per_key_quota_leaves_room_for_other_keys(lifecycle: ServerHandle) -> None:
    body = {"prompt": "quota", "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        heavy = [pool.submit(_post, lifecycle, KEY_A, body) for _ in range(3)]
        time.sleep(0.2)
        light = pool.submit(_post, lifecycle, KEY_B, {**body, "max_tokens": 4})
        statuses = sorted(f.result().status_code for f in heavy)
        assert light.result().status_code == 200
    assert statuses == [200, 200, 429]
    refused = next(f.result() for f in heavy if f.result().status_code == 429)
    error = assert_error(refused, 429, code="rate_limit_exceeded")
    assert "API key" in error["message"] and refused.headers["Retry-After"]


def test_request_timeout_returns_partial_output_as_length(lifecycle: ServerHandle) -> None:
    # max_tokens null: the whole context the prompt leaves (~2,040 tokens, several seconds of
    # served decoding), which the 2 s timeout must cut short.
    long = {"prompt": "never ending", "max_tokens": None, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_events, lifecycle, KEY_A, long)
        plain = pool.submit(_post, lifecycle, KEY_B, long)
        events, response = streamed.result(), plain.result()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] > 0
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] < 2048
    assert "timed out after" in lifecycle.log()
    m = lifecycle.wait_idle()
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0


def test_model_that_fails_to_load_exits_nonzero(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        str(tmp_path / "missing-model"),
        "--port",
        "0",
        "--num-threads",
        "1",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
