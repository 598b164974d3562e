"""Tool-call modes, the constraints behind required/named, and reading calls from text."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.tools import (
    ToolCallStreamer,
    ToolMode,
    parse_tool_output,
    resolve_tool_mode,
    tool_calls_message,
    tool_constraint,
)
from tokenmill.errors import InvalidRequestError

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add"}},
]


def test_tool_choice_modes() -> None:
    assert resolve_tool_mode(TOOLS, "none", False, None).kind == "none"
    assert resolve_tool_mode(TOOLS, "required", False, None).kind == "required"
    named = resolve_tool_mode(TOOLS, {"type": "function", "function": {"name": "add"}}, False, None)
    assert named == ToolMode("named", function_name="add")
    assert resolve_tool_mode(TOOLS, None, True, "hermes") == ToolMode("auto", parser="hermes")
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        resolve_tool_mode(TOOLS, "auto", False, None)
    with pytest.raises(InvalidRequestError, match="not in tools"):
        resolve_tool_mode(TOOLS, {"type": "function", "function": {"name": "x"}}, True, "hermes")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        resolve_tool_mode(None, "required", True, "hermes")


def test_required_constraint_is_an_array_of_named_calls() -> None:
    constraint = tool_constraint(ToolMode("required"), TOOLS, parallel_tool_calls=False)
    assert constraint is not None and isinstance(constraint.json, dict)
    assert constraint.json["maxItems"] == 1 and constraint.json["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in constraint.json["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    named = tool_constraint(ToolMode("named", function_name="get_weather"), TOOLS, None)
    assert named is not None and named.json == {"type": "object"}


@pytest.mark.parametrize(
    ("mode", "text", "content", "calls"),
    [
        (
            ToolMode("required"),
            '[{"name":"add","parameters":{"a":1}},{"name":"get_weather","parameters":{"city":"P"}}]',
            None,
            [("add", '{"a":1}'), ("get_weather", '{"city":"P"}')],
        ),
        (
            ToolMode("named", function_name="add"),
            '{"a": [1, "}"]}',
            None,
            [("add", '{"a": [1, "}"]}')],
        ),
        (
            ToolMode("auto", parser="hermes"),
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"b"}}\n</tool_call>',
            "Let me check.",
            [("get_weather", '{"city": "a\\"b"}')],
        ),
        (
            ToolMode("auto", parser="llama3_json"),
            '{"name": "add", "parameters": {"a": 2}}; {"name": "add", "parameters": {"a": 3}}',
            None,
            [("add", '{"a": 2}'), ("add", '{"a": 3}')],
        ),
        (ToolMode("auto", parser="hermes"), "Just text.", "Just text.", []),
        (ToolMode("auto", parser="llama3_json"), "Just text {}.", "Just text {}.", []),
    ],
)
def test_tool_calls_are_read_from_text(
    mode: ToolMode, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = tool_calls_message(text, mode)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c["function"]["arguments"])


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        (
            ToolMode("required"),
            '[{"name":"add","parameters":{"a":[1,2],"b":"x}y"}},{"name":"get_weather","parameters":{}}]',
        ),
        (
            ToolMode("auto", parser="hermes"),
            'Sure <tool_call>\n{"name": "add", "arguments": {"a": 12}}\n</tool_call>',
        ),
        (ToolMode("named", function_name="add"), '{"a": 12.5, "b": null}'),
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_concatenate_to_the_whole_message(
    mode: ToolMode, text: str, step: int
) -> None:
    streamer = ToolCallStreamer(mode)
    content = ""
    calls: dict[int, dict[str, str]] = {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta, tool_deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += delta
        for d in tool_deltas:
            entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            if "name" in d["function"]:
                assert entry["name"] == "" and d["function"]["name"]  # the name comes once, whole
                entry["name"] = d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    whole_content, whole_calls = tool_calls_message(text, mode)
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in whole_calls]
    assert content.strip() == (whole_content or "")


def test_partial_text_never_reports_a_partial_name() -> None:
    parsed = parse_tool_output('[{"name":"get_wea', ToolMode("required"))
    assert parsed.calls == []
    parsed = parse_tool_output("Hello <tool_", ToolMode("auto", parser="hermes"))
    assert parsed.content == "Hello " and not parsed.calls


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        (ToolMode("required"), '[{"name":"add","parameters":{"a":1'),
        (ToolMode("required"), '[{"name":"add","parameters":'),
        (ToolMode("named", function_name="add"), '{"a": [1, 2'),
        (ToolMode("auto", parser="hermes"), 'Sure. <tool_call>{"name": "add", "arguments": {"a"'),
    ],
)
def test_a_cut_off_call_is_left_out_whole_and_streamed(mode: ToolMode, text: str) -> None:
    _, calls = tool_calls_message(text, mode)
    assert calls == []
    streamer = ToolCallStreamer(mode)
    sent = []
    for i in range(len(text)):
        _, deltas = streamer.feed(text[i], i == len(text) - 1)
        sent += deltas
    assert sent == []


def test_the_whole_calls_before_a_cut_off_one_are_kept() -> None:
    text = '[{"name":"add","parameters":{"a":1}},{"name":"get_weather","parameters":{"ci'
    _, calls = tool_calls_message(text, ToolMode("required"))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", '{"a":1}')
    ]
