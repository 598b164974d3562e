"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) with the
official ``anthropic`` SDK and raw HTTP: shapes, streaming events, system, tools, stop
sequences, and every error in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MAIN_KEY, ServerHandle, start_server

GREEDY = {"temperature": 0}
"""The SDK has no ``temperature`` argument any more; the API still takes the field."""
SYSTEM = "Be brief."
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def msg_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        server_log_dir,
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--max-request-body-bytes",
        "64KiB",
    )
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


@pytest.fixture
def claude(msg_server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=msg_server.base_url, api_key=MAIN_KEY, max_retries=0, timeout=120
    )


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def test_message_shape_system_and_usage(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="demo", max_tokens=8, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "demo"
    assert message.content and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 8
    counted = claude.messages.count_tokens(model="demo", system=SYSTEM, messages=MESSAGES)
    assert message.usage.input_tokens == counted.input_tokens
    # The system prompt is in the prompt: without it there are fewer tokens.
    bare = claude.messages.count_tokens(model="demo", messages=MESSAGES)
    assert bare.input_tokens < counted.input_tokens


def test_stream_events_add_up_to_the_message(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(
        model="demo", max_tokens=12, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY
    )
    whole = claude.messages.create(**kwargs)
    events = list(claude.messages.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and "content_block_stop" in types
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == whole.content[0].text  # type: ignore[union-attr]
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason  # type: ignore[union-attr]
    assert delta.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens  # type: ignore[union-attr]


def test_stop_sequences(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="demo", max_tokens=16, messages=MESSAGES, extra_body=GREEDY)
    text = claude.messages.create(**kwargs).content[0].text  # type: ignore[union-attr]
    stop = text[3:6]
    assert len(stop) == 3 and stop.strip()
    message = claude.messages.create(stop_sequences=[stop], **kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_tool_use_then_tool_result(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(
        model="demo",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # Streamed: a tool_use block whose input_json_delta pieces parse to the same input.
    events = list(claude.messages.create(stream=True, **kwargs))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]  # type: ignore[union-attr]
    partial = "".join(
        e.delta.partial_json  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == uses[0].input
    assert events[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
    # The next turn answers it with a tool_result.
    turns: dict[str, Any] = dict(
        model="demo",
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            kwargs["messages"][0],
            {"role": "assistant", "content": message.content},  # as agents send it back
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}],
            },
        ],
    )
    follow = claude.messages.create(max_tokens=6, **turns)
    assert follow.content and follow.content[0].type == "text"
    assert follow.usage.input_tokens == claude.messages.count_tokens(**turns).input_tokens
    first_turn_only = dict(turns, messages=turns["messages"][:1])
    assert follow.usage.input_tokens > claude.messages.count_tokens(**first_turn_only).input_tokens


def test_tool_choice_any_is_required(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="demo",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]


def test_errors_are_anthropic_shaped(claude: anthropic.Anthropic, msg_server: ServerHandle) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        claude.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=msg_server.base_url, api_key="wrong", max_retries=0
        ).messages.create(model="demo", max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model="demo",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],  # type: ignore[list-item]
        )
    assert "image" in str(bad.value)
    url = f"{msg_server.base_url}/v1/messages"
    headers = {"x-api-key": MAIN_KEY}
    cases = [
        ({"model": "demo", "messages": MESSAGES}, "max_tokens"),  # Anthropic requires it
        ({"model": "demo", "max_tokens": 4, "messages": MESSAGES, "bogus": 1}, "bogus"),
        ({"model": "demo", "max_tokens": 4, "messages": []}, "messages"),
        (
            {
                "model": "demo",
                "max_tokens": 4,
                "messages": MESSAGES,
                "thinking": {"type": "enabled"},
            },
            "thinking",
        ),
    ]
    for body, named in cases:
        message = assert_anthropic_error(
            httpx.post(url, json=body, headers=headers), 400, "invalid_request_error"
        )
        assert named in message, (body, message)
    malformed = httpx.post(
        url, content=b"{", headers={**headers, "content-type": "application/json"}
    )
    assert_anthropic_error(malformed, 400, "invalid_request_error")
    unauthenticated = httpx.post(url, json=cases[0][0])
    assert_anthropic_error(unauthenticated, 401, "authentication_error")
    # Refused by the body limit before the route runs: still Anthropic's shape.
    huge = {
        "model": "demo",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x" * 70_000}],
    }
    assert_anthropic_error(httpx.post(url, json=huge, headers=headers), 413, "request_too_large")
    # Counted by path and status, as chat completions are.
    scrape = httpx.get(f"{msg_server.base_url}/metrics", headers=headers).text
    assert (
        'path="/v1/messages",status="400"' in scrape
        and 'path="/v1/messages",status="401"' in scrape
    )
    # The OpenAI routes keep OpenAI's shape.
    other = httpx.post(f"{msg_server.base_url}/v1/chat/completions", json={}, headers=headers)
    assert set(other.json()) == {"error"}


def test_bearer_and_x_api_key_both_authenticate(msg_server: ServerHandle) -> None:
    body = {"model": "demo", "max_tokens": 2, "messages": MESSAGES}
    url = f"{msg_server.base_url}/v1/messages"
    assert (
        httpx.post(url, json=body, headers={"x-api-key": MAIN_KEY}, timeout=60).status_code == 200
    )
    bearer = {"Authorization": f"Bearer {MAIN_KEY}"}
    assert httpx.post(url, json=body, headers=bearer, timeout=60).status_code == 200
    both = {**bearer, "x-api-key": MAIN_KEY}  # the same key twice (some gateways do)
    assert httpx.post(url, json=body, headers=both, timeout=60).status_code == 200
    different = {**bearer, "x-api-key": "sk-other"}  # which one would it be? refused
    assert_anthropic_error(
        httpx.post(url, json=body, headers=different), 401, "authentication_error"
    )
