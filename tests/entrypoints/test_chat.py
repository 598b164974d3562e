"""``POST /v1/chat/completions`` through the official client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.conftest import ServerHandle, assert_error, sse_events

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about the sea."},
]
EOS_OFF = {"ignore_eos": True}


def test_chat_uses_template_and_counts_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=6, temperature=0, extra_body=EOS_OFF
    )
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    choice = result.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert result.usage.prompt_tokens == rendered["count"]
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == rendered["count"] + 6


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=9, max_completion_tokens=3, extra_body=EOS_OFF
    )
    assert result.usage.completion_tokens == 3


def test_stream_order_role_content_finish_usage_done(server: ServerHandle) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": True,
        "seed": 3,
        "n": 2,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers()
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first = chunks[0]["choices"]
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    finishes = [c for chunk in chunks[1:-1] for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == [0, 1]
    assert all(c["delta"] == {} for c in finishes)
    # nothing for a choice comes after its finish chunk
    for index in (0, 1):
        positions = [
            i for i, chunk in enumerate(chunks) for c in chunk["choices"] if c["index"] == index
        ]
        finish_at = next(
            i
            for i, chunk in enumerate(chunks)
            for c in chunk["choices"]
            if c["index"] == index and c["finish_reason"]
        )
        assert positions[-1] == finish_at


def test_streamed_equals_non_streamed_for_same_seed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo", messages=MESSAGES, max_tokens=10, seed=42, temperature=0.9, extra_body=EOS_OFF
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body=EOS_OFF,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body=EOS_OFF,
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 4


def test_return_tokens_as_token_ids_in_chat(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={**EOS_OFF, "return_tokens_as_token_ids": True},
    )
    choice = result.choices[0]
    ids = [int(e.token.removeprefix("token_id:")) for e in choice.logprobs.content]
    assert all(e.token.startswith("token_id:") for e in choice.logprobs.content)
    assert all(
        t.token.startswith("token_id:") for e in choice.logprobs.content for t in e.top_logprobs
    )
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == choice.message.content
    # bytes stay the token's own text, so clients can still rebuild the reply from them.
    assert (
        b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode() == choice.message.content
    )


def test_response_format_text_is_accepted(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=2, response_format={"type": "text"}
    )
    assert result.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tool_choice",  # 'auto' by default, and this server has no --enable-auto-tool-choice
        ),
        ({"tools": []}, "tools"),
        ({"functions": []}, "functions"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),  # outside the vocabulary
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"audio": {"voice": "x"}}, "audio"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.0.content",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        (  # a result must answer a call an earlier assistant message made
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_nowhere", "content": "x"},
                ]
            },
            "messages.1.tool_call_id",
        ),
        (  # duplicate function names make calls and named tool_choice ambiguous
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {}}},
                    {"type": "function", "function": {"name": "f", "parameters": {}}},
                ]
            },
            "tools.1.function.name",
        ),
    ],
)
def test_unsupported_features_are_clear_400s(http: httpx.Client, extra: dict, param: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"].startswith(param), error


def test_a_tool_result_answering_an_earlier_call_is_accepted(http: httpx.Client) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
        "max_tokens": 2,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def test_request_chat_template_needs_operator_trust(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": "{{ 'x' }}"})
    error = assert_error(r, 400, param="chat_template")
    assert "--trust-request-chat-template" in error["message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"tools": [TOOL]}, "tools"),
        ({"bos_token": "PWNED"}, "bos_token"),
        ({"eos_token": "</s>"}, "eos_token"),
        (
            {"enable_thinking": False, "messages": [{"role": "user", "content": "other"}]},
            "messages",
        ),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"documents": [{"text": "x"}]}, "documents"),
        ({"raise_exception": None}, "raise_exception"),
        ({"namespace": 1}, "namespace"),
    ],
)
def test_chat_template_kwargs_cannot_replace_server_variables(
    http: httpx.Client, kwargs: dict, key: str
) -> None:
    for path, body in [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
        ("/tokenize", {"messages": MESSAGES}),
    ]:
        r = http.post(path, json={**body, "chat_template_kwargs": kwargs})
        error = assert_error(r, 400, param="chat_template_kwargs")
        assert repr(key) in error["message"], error


def test_chat_template_kwargs_may_add_variables(http: httpx.Client) -> None:
    plain = http.post("/tokenize", json={"messages": MESSAGES}).json()
    extra = http.post(
        "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert extra.status_code == 200, extra.text
    assert extra.json()["tokens"] == plain["tokens"]  # the demo template does not read it
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    assert r.status_code == 200, r.text
