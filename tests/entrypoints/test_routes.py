"""Routes (``--routes-config``): two routes under concurrent load keep their own limits.

The engine is gated (``StepGate``): requests pile up while no step runs, so what is
checked is which requests were admitted, refused and scheduled first, never how long
anything took. Quota windows run on the server's clock; Retry-After is only checked to be
within the one-minute window.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import (
    WAIT_S,
    InProcessServer,
    StepGate,
    serve_in_process,
    wait_healthy,
)
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.routes import RouteTable, SlidingWindow
from tokenmill.entrypoints.openai.routes_config import parse_routes
from tokenmill.entrypoints.openai.state import ServerConfig

KEY_LONG, KEY_CHAT, KEY_CHAT2 = "sk-long-route-key", "sk-chat-route-key", "sk-chat-route-key2"
KEY_FREE = "sk-no-route-key"
"""Bound to no route: its requests are routed by model."""
ENGINE_CONFIG = EngineConfig(
    model="demo", max_model_len=256, max_num_seqs=4, num_threads=1, scheduling_policy="priority"
)
ROUTES_YAML = f"""\
routes:
  - name: long
    match: {{api_keys: [{KEY_LONG}]}}
    max_model_len: 256
    priority: 10
    max_in_flight: 3
    quotas: {{max_concurrent_requests: 3, output_tokens_per_minute: 100}}
  - name: chat
    match:
      api_keys: [{KEY_CHAT}, {KEY_CHAT2}]
      headers: [chat]
    max_model_len: 48
    max_tokens: 32
    priority: 0
    max_in_flight: 4
    defaults: {{temperature: 0.0}}
    features: {{logprobs: false, max_n: 1}}
    quotas:
      max_concurrent_requests: 2
      input_tokens_per_minute: 400
  - name: batch
    match: {{models: [demo]}}
    max_in_flight: 1
    defaults: {{max_tokens: 3}}
"""
"""Their bounds add up to 8 sequences, the server's 8 (4 running + 4 queued)."""
PROMPT_30 = list(range(100, 130))


@pytest.fixture(scope="module")
def routed(
    demo_cache: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[InProcessServer, StepGate]]:
    path = tmp_path_factory.mktemp("routes") / "routes.yaml"
    path.write_text(ROUTES_YAML)
    gate = StepGate()
    engine = gate.async_engine(ENGINE_CONFIG)
    config = ServerConfig(
        max_num_seqs=4,
        max_queue_len=4,
        api_keys=(KEY_LONG, KEY_CHAT, KEY_CHAT2, KEY_FREE),
        routes_config=str(path),
        disable_auth_for_health_metrics=True,
    )
    server = serve_in_process(engine, config, ENGINE_CONFIG)
    wait_healthy(server.base_url)
    yield server, gate
    gate.open()
    server.stop()


def _post(
    base_url: str, key: str, body: dict, request_id: str | None = None, **headers: str
) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}", **headers}
    if request_id:
        sent["X-Request-Id"] = request_id
    return httpx.post(f"{base_url}/v1/completions", json=body, headers=sent, timeout=WAIT_S)


def _refused(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    return error


def test_a_flooded_route_never_refuses_the_other(routed: tuple[InProcessServer, StepGate]) -> None:
    server, gate = routed
    url, engine = server.base_url, server.engine
    long_body = {"prompt": "a long report", "max_tokens": 8, "ignore_eos": True}
    chat_body = {"prompt": PROMPT_30, "max_tokens": None, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        # The long route's key floods: its own bound admits 3, the rest get 429 at once.
        flood = [pool.submit(_post, url, KEY_LONG, long_body, f"long-{i}") for i in range(8)]
        gate.wait_until(lambda: sum(f.done() for f in flood) == 5, "5 of 8 long refused")
        for future in [f for f in flood if f.done()]:
            error = _refused(future.result(), 429, "rate_limit_exceeded")
            assert "route 'long'" in error["message"]
            assert future.result().headers["Retry-After"] == "1"
        # The chat route is untouched by it: both its keys get in, up to 2 requests each.
        chat: list[Future[httpx.Response]] = [
            pool.submit(_post, url, KEY_CHAT, chat_body, "chat-a"),
            pool.submit(_post, url, KEY_CHAT, chat_body, "chat-b"),
            pool.submit(_post, url, KEY_CHAT2, chat_body, "chat-c"),
        ]
        gate.wait_until(lambda: engine.num_streams == 6, "3 long and 3 chat requests queued")
        third = _post(url, KEY_CHAT, chat_body)
        error = _refused(third, 429, "rate_limit_exceeded")
        assert "already has 2 requests in flight" in error["message"]
        assert not any(f.done() for f in chat)
        # Route priority: the first step schedules every chat request before the long ones.
        gate.step_and_wait()
        for rid in ("chat-a", "chat-b", "chat-c"):
            assert gate.scheduled[f"cmpl-{rid}-0"][0].step == 1, rid
        gate.open()
        long_done = [f.result() for f in flood if f.result().status_code != 429]
        chat_done = [f.result() for f in chat]
    assert len(long_done) == 3
    for response in long_done:
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    for response in chat_done:
        usage = response.json()["usage"]
        # No max_tokens: the route's cap (32) within the 48-token context the prompt leaves.
        assert usage == {"prompt_tokens": 30, "completion_tokens": 18, "total_tokens": 48}
    gate.close()


def test_several_route_headers_are_a_400(routed: tuple[InProcessServer, StepGate]) -> None:
    """A gateway that appends its own header must not be overridden by the client's first one."""
    server, gate = routed
    gate.open()
    try:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers=[
                ("Authorization", f"Bearer {KEY_FREE}"),
                ("X-Tokenmill-Route", "chat"),
                ("X-Tokenmill-Route", "chat"),
            ],
            timeout=WAIT_S,
        )
        error = assert_error(response, 400)
        assert "x-tokenmill-route" in error["message"].lower() and "2 times" in error["message"]
    finally:
        gate.close()


def test_route_limits_and_features(routed: tuple[InProcessServer, StepGate]) -> None:
    server, gate = routed
    url = server.base_url
    gate.open()
    try:
        too_long = {"prompt": list(range(100, 160)), "max_tokens": 4}
        error = _refused(_post(url, KEY_CHAT, too_long), 400, "context_length_exceeded")
        assert "route 'chat' has a context of 48 tokens" in error["message"]
        assert _post(url, KEY_LONG, too_long).status_code == 200  # the long route's 256 tokens
        over_cap = _refused(_post(url, KEY_CHAT, {"prompt": "hi", "max_tokens": 40}), 400, None)
        assert over_cap["param"] == "max_tokens" and "at most 32" in over_cap["message"]
        capped = _post(url, KEY_CHAT, {"prompt": "hi", "ignore_eos": True})  # default: 16, kept
        assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 16
        for body, param in (({"logprobs": 1}, "logprobs"), ({"n": 2}, "n")):
            refused = _post(url, KEY_CHAT, {"prompt": "hi", "max_tokens": 2, **body})
            assert _refused(refused, 403, "feature_not_allowed")["param"] == param
        assert (
            _post(url, KEY_LONG, {"prompt": "hi", "max_tokens": 2, "logprobs": 1}).status_code
            == 200
        )
        # The header selects a route, but never moves a key off its own.
        header = _post(
            url, KEY_LONG, {"prompt": "hi", "max_tokens": 2}, **{"X-Tokenmill-Route": "chat"}
        )
        _refused(header, 403, "route_not_allowed")
        unknown = _post(
            url, KEY_CHAT, {"prompt": "hi", "max_tokens": 2}, **{"X-Tokenmill-Route": "x"}
        )
        _refused(unknown, 400, None)
    finally:
        gate.close()


def test_input_tokens_per_minute_quota(routed: tuple[InProcessServer, StepGate]) -> None:
    """KEY_CHAT2 may send 400 prompt tokens a minute: 30 went in already, 2 x 160 more fit."""
    server, gate = routed
    gate.open()
    try:
        body = {"prompt": [list(range(200, 240))] * 4, "max_tokens": 1}  # 4 x 40 = 160 tokens
        assert _post(server.base_url, KEY_CHAT2, body).status_code == 200
        assert _post(server.base_url, KEY_CHAT2, body).status_code == 200
        over = _post(server.base_url, KEY_CHAT2, body)
        error = _refused(over, 429, "rate_limit_exceeded")
        assert "400 input tokens per minute" in error["message"]
        assert 1 <= int(over.headers["Retry-After"]) <= 60
        # Another key of the same route has its own quota.
        assert (
            _post(server.base_url, KEY_CHAT, {"prompt": "hi", "max_tokens": 1}).status_code == 200
        )
        metrics = httpx.get(
            f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEY_CHAT}"}
        ).text
        assert (
            'tokenmill:route_rejections_total{model_name="demo",reason="input_tokens",route="chat"} 1.0'
            in metrics
        )
    finally:
        gate.close()


def test_output_tokens_per_minute_counts_what_a_stream_generated(
    routed: tuple[InProcessServer, StepGate],
) -> None:
    """The long route's key has 100 output tokens a minute; 30 were generated above."""
    server, gate = routed
    gate.open()
    try:
        body = {"prompt": "go on", "max_tokens": 80, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_LONG}"},
            timeout=WAIT_S,
        ) as response:
            assert response.status_code == 200
            assert response.read().rstrip().endswith(b"data: [DONE]")
        over = _post(server.base_url, KEY_LONG, {"prompt": "more", "max_tokens": 1})
        error = _refused(over, 429, "rate_limit_exceeded")
        assert "100 output tokens per minute" in error["message"]
        assert 1 <= int(over.headers["Retry-After"]) <= 60
    finally:
        gate.close()


def test_a_route_selected_by_model_gets_its_defaults_and_bound(
    routed: tuple[InProcessServer, StepGate],
) -> None:
    server, gate = routed
    url, engine = server.base_url, server.engine
    body = {"model": "demo", "prompt": "by model", "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, url, KEY_FREE, body)
        gate.wait_until(lambda: engine.num_streams == 1, "the first request queued")
        error = _refused(_post(url, KEY_FREE, body), 429, "rate_limit_exceeded")
        assert "route 'batch'" in error["message"]
        gate.open()
        assert first.result().json()["usage"]["completion_tokens"] == 3  # the route's default
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY_FREE}"},
        timeout=WAIT_S,
    )
    assert chat.json()["usage"]["completion_tokens"] == 3  # released, and the default again
    gate.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "routes:\n  - name: a\n    match: {models: [demo]}\n    max_tokenz: 3\n",
            "4: routes[0].max_tokenz: unknown field",
        ),
        (
            "routes:\n  - name: a\n    match: {models: [demo]}\n    quotas:\n      max_concurrent_requests: -1\n",
            "5: routes[0].quotas.max_concurrent_requests: Input should be greater than or equal to 1",
        ),
        (
            "routes:\n  - name: a\n    name: b\n    match: {models: [demo]}\n",
            "3: duplicate key 'name'",
        ),
        (
            "routes:\n  - name: a\n    match: {headers: [x]}\n  - name: b\n    match: {headers: [y, x]}\n",
            "5: routes[1].match.headers[1]: 'x' is already selected by route 'a' (line 3)",
        ),
        (
            "routes:\n  - name: a\n    match: {models: [nope]}\n",
            "yaml:3: routes[0].match.models[0]: 'nope' is not a served model name",
        ),
        (
            "routes:\n  - name: a\n    match: {models: [demo]}\n    priority: 5\n",
            "yaml:4: routes[0].priority: needs --scheduling-policy priority",
        ),
        (  # no --max-model-len: the model's own context (the demo's 2048) bounds it
            "routes:\n  - name: a\n    match: {models: [demo]}\n    max_model_len: 100000\n",
            "yaml:4: routes[0].max_model_len: 100000 is more than the served context (2048",
        ),
    ],
)
def test_bad_routes_files_fail_at_start_up_with_one_message(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    assert main(["serve", "demo", "--port", "0", "--routes-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: error: "), err
    assert expected in err[0]


def test_routes_docs_name_every_field() -> None:
    from tokenmill.entrypoints.openai.routes_config import Route, RouteQuotas

    docs = (Path(__file__).resolve().parents[2] / "docs" / "routes.md").read_text()
    for name in [*Route.model_fields, *RouteQuotas.model_fields]:
        assert f"`{name}`" in docs, name
    example = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert [r.name for r in parse_routes(example).routes] == ["chat", "long-context"]


# ---- the route table alone, on a fake clock ---------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table(text: str, clock: FakeClock) -> RouteTable:
    return RouteTable(
        parse_routes(text), ("k0", "k1"), ("demo", "other"), "priority", 256, clock=clock
    )


def test_selection_by_key_header_and_model() -> None:
    table = _table(
        "routes:\n"
        "  - {name: keyed, match: {api_keys: [k0]}}\n"
        "  - {name: headed, match: {headers: [batch]}}\n"
        "  - {name: modelled, match: {models: [other]}}\n",
        FakeClock(),
    )
    assert table.select_early(0, None).route.name == "keyed"
    assert table.select_early(1, None) is None
    assert table.select_early(1, "batch").route.name == "headed"
    assert table.select_by_model("other").route.name == "modelled"
    assert table.select_by_model(None) is None  # the default model, demo, has no route
    with pytest.raises(APIError) as refused:
        table.select_early(0, "batch")
    assert refused.value.status_code == 403


def test_output_quota_refuses_until_the_window_frees_it() -> None:
    clock = FakeClock()
    table = _table(
        "routes:\n  - name: r\n    match: {api_keys: [k0]}\n"
        "    quotas: {output_tokens_per_minute: 100}\n",
        clock,
    )
    state = table.select_early(0, None)
    table.release(table.acquire(state, 0), 60)
    clock.now += 20
    table.release(table.acquire(state, 0), 50)  # 110 in the window now
    clock.now += 10
    with pytest.raises(APIError) as refused:
        table.acquire(state, 0)
    # The first 60 tokens leave the window 60 s after they were counted: 30 s from now.
    assert refused.value.status_code == 429 and refused.value.headers["Retry-After"] == "30"
    assert table.acquire(state, None) is not None  # another key (here: none) is not limited
    clock.now += 30
    assert table.acquire(state, 0) is not None


def test_sliding_window_retry_after() -> None:
    window = SlidingWindow(60.0)
    window.add(0.0, 100)
    window.add(30.0, 100)
    assert window.used(40.0) == 200
    assert window.retry_after_s(40.0, 100) == 20  # the first 100 expire at 60 s
    assert window.retry_after_s(40.0, 0) == 50
    assert window.retry_after_s(40.0, 500) == 1
    assert window.used(90.0) == 0
