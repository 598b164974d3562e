"""Tool calling on ``/v1/chat/completions``: what ``tool_choice`` constrains, and reading
tool calls back out of the model's text, whole or as streamed deltas.

``required`` and a named function are enforced by the grammar engine, as vLLM does: the
output is a JSON array of ``{"name", "parameters"}`` objects (required) or the function's
arguments object (named), so arguments always parse and validate. ``auto`` lets the model
write what it likes and a ``--tool-call-parser`` reads calls from it: ``hermes``
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) or ``llama3_json`` (a bare
``{"name": ..., "parameters": ...}`` object, several separated by ``;``).

Arguments are always the raw text the model wrote for them, so the streamed deltas
concatenate to exactly the non-streamed arguments. A call is only ever returned whole: its
arguments parse as JSON. One cut off by ``max_tokens`` (``finish_reason: "length"``) is
left out of the message, and a stream sends each call once it is complete, so a client never
holds a call whose arguments do not parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.errors import InvalidRequestError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolMode:
    """How this request's output carries tool calls."""

    kind: str
    """'none' (plain text), 'named', 'required' or 'auto'."""
    function_name: str | None = None
    """The named function (kind 'named')."""
    parser: str | None = None
    """The --tool-call-parser (kind 'auto')."""


def check_function_name(name: str, param: str) -> None:
    if not _FUNCTION_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"function name {name!r} must be 1-64 letters, digits, '_' or '-'", param=param
        )


def resolve_tool_mode(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
) -> ToolMode:
    """The request's tool mode, or a 400 naming the field that makes it impossible."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice other than 'none' needs tools", param="tool_choice"
            )
        return ToolMode("none")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolMode("none")
    if choice == "required":
        return ToolMode("required")
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser; use tool_choice 'required', a named function or 'none'",
                param="tool_choice",
            )
        return ToolMode("auto", parser=tool_call_parser)
    assert isinstance(choice, dict)
    name = choice["function"]["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not in tools",
            param="tool_choice",
        )
    return ToolMode("named", function_name=name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def tool_constraint(
    mode: ToolMode, tools: list[dict[str, Any]], parallel_tool_calls: bool | None
) -> StructuredOutputsParams | None:
    """The output constraint that enforces ``required`` or a named function."""
    if mode.kind == "named":
        tool = next(t for t in tools if t["function"]["name"] == mode.function_name)
        return StructuredOutputsParams(json=_parameters(tool))
    if mode.kind != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


# ---- reading calls out of text ------------------------------------------------------------
@dataclass
class ParsedCall:
    """One tool call found in the text: its name once complete, its arguments' raw text."""

    name: str | None
    arguments: str
    is_complete: bool


@dataclass
class ParsedOutput:
    """Text split into content and tool calls (calls without a complete name are left out)."""

    content: str
    calls: list[ParsedCall]
    is_tool_output: bool
    """The text is (or so far looks like) tool calls, not plain content."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``, None if unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``, None if the text stops inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def _object_fields(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Fields of the (possibly unfinished) object at ``text[i] == '{'``: key -> value span."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return fields, None
        key_end = _string_end(text, i)
        if key_end is None:
            return fields, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return fields, None
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        start = _skip_ws(text, i + 1)
        if start >= len(text):
            return fields, None
        end = _value_end(text, start)
        fields[key] = (start, end)
        if end is None:
            return fields, None
        i = _skip_ws(text, end)
    return fields, None


def _call_at(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall | None, int | None]:
    """The call object at ``i`` and where it ends (None while unfinished)."""
    fields, end = _object_fields(text, i)
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, stop = fields["name"]
        try:
            value = json.loads(text[start:stop])
            name = value if isinstance(value, str) else None
        except ValueError:
            name = None
    args_span = next((fields[k] for k in args_keys if k in fields), None)
    if args_span is None:
        arguments = ""
    else:
        arguments = text[args_span[0] : args_span[1]]
    complete = end is not None and args_span is not None and args_span[1] is not None
    return ParsedCall(name, arguments, complete), end


def parse_tool_output(text: str, mode: ToolMode) -> ParsedOutput:
    """Split ``text`` (whole, or so far while streaming) into content and tool calls."""
    if mode.kind == "none":
        return ParsedOutput(text, [], False)
    if mode.kind == "named":
        return ParsedOutput("", [ParsedCall(mode.function_name, text, True)], True)
    if mode.kind == "required":
        return ParsedOutput("", _call_list(text, _skip_ws(text, 0), ("parameters",), "["), True)
    if mode.parser == "hermes":
        return _parse_hermes(text)
    return _parse_llama3_json(text)


def _call_list(
    text: str, i: int, args_keys: tuple[str, ...], opener: str | None
) -> list[ParsedCall]:
    """Calls in a JSON array (``opener='['``) or separated by ``;`` (``opener=None``)."""
    calls: list[ParsedCall] = []
    if opener is not None:
        if i >= len(text) or text[i] != opener:
            return calls
        i = _skip_ws(text, i + 1)
    while i < len(text) and text[i] == "{":
        call, end = _call_at(text, i, args_keys)
        if call is not None and call.name is not None:
            calls.append(call)
        if end is None:
            break
        i = _skip_ws(text, end)
        if i < len(text) and text[i] in ",;":
            i = _skip_ws(text, i + 1)
    return calls


def _parse_hermes(text: str) -> ParsedOutput:
    first = text.find(_HERMES_OPEN)
    if first < 0:
        # Hold back a tail that may be the start of "<tool_call>".
        held = next(
            (
                k
                for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1)
                if _HERMES_OPEN.startswith(text[-k:])
            ),
            0,
        )
        return ParsedOutput(text[: len(text) - held], [], False)
    calls = []
    position = first
    while position >= 0:
        start = _skip_ws(text, position + len(_HERMES_OPEN))
        if start < len(text) and text[start] == "{":
            call, _ = _call_at(text, start, ("arguments", "parameters"))
            if call is not None and call.name is not None:
                calls.append(call)
        position = text.find(_HERMES_OPEN, position + len(_HERMES_OPEN))
    return ParsedOutput(text[:first].rstrip(), calls, True)


def _parse_llama3_json(text: str) -> ParsedOutput:
    i = _skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = _skip_ws(text, i + len(_PYTHON_TAG))
    if i >= len(text):
        return ParsedOutput("", [], True)  # nothing but whitespace yet: undecided
    if text[i] != "{":
        return ParsedOutput(text, [], False)
    return ParsedOutput("", _call_list(text, i, ("parameters", "arguments"), None), True)


def is_whole_call(call: ParsedCall) -> bool:
    """Whether the call can be returned: complete, and its arguments parse as JSON."""
    if not call.is_complete:
        return False
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return True


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_message(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """The finished message's content and OpenAI ``tool_calls`` (plain content if none parse)."""
    parsed = parse_tool_output(text, mode)
    if not parsed.calls:
        return text, []
    whole = []
    for call in parsed.calls:
        if not is_whole_call(call):
            break  # cut off: it and anything after it are not returned
        whole.append(call)
    if not whole:
        return parsed.content or None, []
    calls = [
        {
            "id": new_tool_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in whole
    ]
    return parsed.content or None, calls


@dataclass
class ToolCallStreamer:
    """One choice's streamed ``delta.content`` and ``delta.tool_calls`` from its growing text."""

    mode: ToolMode
    text: str = ""
    num_content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    num_args_sent: list[int] = field(default_factory=list)

    def feed(self, text_delta: str, is_finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """What to send for this delta: content text, and tool-call deltas by index."""
        self.text += text_delta
        parsed = parse_tool_output(self.text, self.mode)
        content = parsed.content
        if is_finished and not parsed.calls:
            content = self.text  # it never became a tool call: it was content all along
        content_delta = ""
        if len(content) > self.num_content_sent and content.startswith(
            self.text[: self.num_content_sent]
        ):
            content_delta = content[self.num_content_sent :]
            self.num_content_sent = len(content)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index >= len(self.ids) and not is_whole_call(call):
                break  # sent once whole, so a cut-off call never reaches the client
            if index == len(self.ids):
                self.ids.append(new_tool_call_id())
                self.num_args_sent.append(0)
                deltas.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new_args = call.arguments[self.num_args_sent[index] :]
            if new_args:
                self.num_args_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new_args}})
        return content_delta, deltas

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.ids)
