"""Anthropic's Messages API on the chat pipeline: its request shape, the mapping onto chat
completions, and its error shape.

Owns what a valid ``/v1/messages`` body is (strict, unknown fields a 400 naming them, as
everywhere) and turning it into the chat request it means: ``system`` becomes the system
turn, ``tool_use`` blocks an assistant turn's ``tool_calls`` and ``tool_result`` blocks tool
turns, ``tools``/``tool_choice`` OpenAI's (``any`` is ``required``), ``stop_sequences``
``stop``. ``AnthropicErrorMiddleware`` rewrites every error these routes answer, from auth,
admission, body limits or the route itself, into ``{"type": "error", "error": {type,
message}}`` with Anthropic's error types, so its SDK raises the right exception.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.protocol import StrictModel, validate_model
from tokenmill.errors import InvalidRequestError

MESSAGES_PATH_PREFIX = "/v1/messages"

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    return {
        "type": "error",
        "error": {"type": ANTHROPIC_ERROR_TYPES.get(status_code, "api_error"), "message": message},
    }


# ---- request ---------------------------------------------------------------------------------
class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Accepted: the prefix cache is automatic here."""
    citations: list[Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class UnsupportedBlock(StrictModel):
    """Images, documents, thinking: declared (whatever they hold) so the refusal names them."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image", "document", "thinking", "redacted_thinking", "search_result"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")
]
"""Told apart by ``type``, so a bad block's error names its own fields."""


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(StrictModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: what a message request would put in the prompt."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    """Accepted for compatibility; this server has one tier."""


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _turns(i: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    """The chat messages one Anthropic message becomes."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, UnsupportedBlock):
            raise InvalidRequestError(
                f"{block.type} content blocks are not supported by this server", param=where
            )
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequestError("tool_use blocks belong to assistant turns", param=where)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input)},
                }
            )
        else:
            if message.role != "user":
                raise InvalidRequestError("tool_result blocks belong to user turns", param=where)
            content = _text(block.content)
            if block.is_error:
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    turns = list(results)
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    elif text or not results:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages, the system prompt first."""
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise InvalidRequestError("extended thinking is not supported", param="thinking")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for i, message in enumerate(body.messages):
        messages.extend(_turns(i, message))
    return messages


def chat_tools(body: CountTokensRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat's shape."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type not in ("none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return {}
    fields: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    }
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError(
                    "tool_choice of type tool needs a name", param="tool_choice.name"
                )
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def to_chat_body(data: dict[str, Any]) -> dict[str, Any]:
    """A Messages body (decoded JSON) as the chat completion request it means."""
    body = validate_model(MessagesRequest, data)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "max_tokens": body.max_tokens,
        "stream": body.stream,
        **chat_tools(body),
    }
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    return chat


# ---- errors ----------------------------------------------------------------------------------
class AnthropicErrorMiddleware:
    """On ``/v1/messages*``: every JSON error body in OpenAI's shape becomes Anthropic's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = _rewritten(start["status"], b"".join(chunks))
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _rewritten(status_code: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return body  # not OpenAI's error shape (e.g. an empty 499): left as it is
    return json.dumps(anthropic_error(status_code, message)).encode()
