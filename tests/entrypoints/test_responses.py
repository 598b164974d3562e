"""``/v1/responses`` (OpenAI's Responses API) with the official ``openai`` SDK and raw HTTP: text and
messages input, instructions, streaming events, function tools across turns, ``text.format``,
``max_output_tokens``, and ``previous_response_id`` over the bounded store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import ServerHandle, assert_error, start_server

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
MAX_STORED = 3


@pytest.fixture(scope="module")
def resp_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        server_log_dir,
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--max-stored-responses",
        str(MAX_STORED),
    )
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


@pytest.fixture
def oai(resp_server: ServerHandle) -> openai.OpenAI:
    return resp_server.openai().with_options(timeout=120)


def test_text_input_with_instructions_is_the_chat_it_means(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model="demo", input="Tell me about the sea.", instructions="Be brief.",
        max_output_tokens=10, **GREEDY,
    )  # fmt: skip
    assert response.object == "response" and response.model == "demo"
    assert response.status in ("completed", "incomplete")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    chat = oai.chat.completions.create(
        model="demo",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ],
        max_tokens=10,
        **GREEDY,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Be brief."


def test_messages_input_and_max_output_tokens(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model="demo",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Tell me more about the sea and its waves."},
        ],
        max_output_tokens=3,
        **GREEDY,
    )
    assert response.usage is not None and response.usage.output_tokens <= 3
    if response.usage.output_tokens == 3:
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:  # the model ended its turn first
        assert response.status == "completed" and response.incomplete_details is None


def test_stream_events_add_up_to_the_response(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="demo", input="Tell me about the sea.", max_output_tokens=12, **GREEDY
    )
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_function_call_then_its_output_next_turn(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="demo",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        **GREEDY,
    )
    first = oai.responses.create(**kwargs)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(oai.responses.create(stream=True, **dict(kwargs, store=False)))
    args = "".join(
        e.delta
        for e in events
        if e.type == "response.function_call_arguments.delta"  # type: ignore[union-attr]
    )
    assert args == calls[0].arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args  # type: ignore[union-attr]
    # The next turn sends the call's output, continuing the stored conversation.
    second = oai.responses.create(
        model="demo",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=6,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None
    # The same turn without the store's conversation, sent whole, is the same prompt.
    replay = oai.responses.create(
        model="demo",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        max_output_tokens=6,
        store=False,
    )  # fmt: skip
    assert replay.usage is not None and replay.usage.input_tokens == second.usage.input_tokens


def test_text_format_json_schema_goes_through_the_grammar(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["size"],
        "additionalProperties": False,
    }
    response = oai.responses.create(
        model="demo",
        input="Describe a file as JSON.",
        text={"format": {"type": "json_schema", "name": "file", "schema": schema, "strict": True}},
        max_output_tokens=60,
        **GREEDY,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_store_retrieve_and_bounded_eviction(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="demo", input="One.", max_output_tokens=2)
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    unstored = oai.responses.create(model="demo", input="Two.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(model="demo", input="x", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for _ in range(MAX_STORED):  # newer ones push the first out of the bounded store
        oai.responses.create(model="demo", input="More.", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_bad_input_is_a_400_naming_the_field(resp_server: ServerHandle) -> None:
    with resp_server.http() as http:
        for body, param in [
            ({"model": "demo"}, "input"),
            ({"input": "x", "background": True}, "background"),
            ({"input": "x", "bogus": 1}, "bogus"),
            ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
            (
                {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                "input.0.content.0",
            ),
            ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.name"),
            ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ]:
            assert_error(http.post("/v1/responses", json=body), 400, param=param)
        assert_error(http.post("/v1/responses", json={"input": "x", "model": "nope"}), 404)
        assert_error(http.get("/v1/responses/resp-nope"), 404, code="response_not_found")
    unauthenticated = httpx.post(f"{resp_server.base_url}/v1/responses", json={"input": "x"})
    assert_error(unauthenticated, 401)


def test_previous_response_continues_without_its_instructions(oai: openai.OpenAI) -> None:
    first = oai.responses.create(
        model="demo", input="One.", instructions="Be brief.", max_output_tokens=3, **GREEDY
    )
    second = oai.responses.create(
        model="demo", previous_response_id=first.id, input="Two.", max_output_tokens=2
    )
    replay = oai.responses.create(
        model="demo",
        input=[
            {"role": "user", "content": "One."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Two."},
        ],
        max_output_tokens=2,
        store=False,
    )
    assert second.usage is not None and replay.usage is not None
    assert second.usage.input_tokens == replay.usage.input_tokens
