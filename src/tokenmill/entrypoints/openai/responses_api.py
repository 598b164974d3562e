"""OpenAI's Responses API on the chat pipeline: its request shape, the mapping onto chat
completions, and the bounded store behind ``previous_response_id``.

Owns what a valid ``/v1/responses`` body is (strict: unknown fields and features this server
lacks, such as ``background`` or hosted tools, are a 400 naming them) and the chat request it
means: ``instructions`` is the system turn (never carried into the next response, as OpenAI
does), input items become user/assistant turns, ``function_call`` items an assistant turn's
``tool_calls`` and ``function_call_output`` items tool turns; ``text.format`` is chat's
``response_format`` and ``max_output_tokens`` its ``max_tokens``. ``ResponseStore`` keeps the
last ``--max-stored-responses`` stored responses of each API key (least recently used evicted) with their
conversation, in memory: a restart forgets them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import CacheSalt, StrictModel
from tokenmill.errors import InvalidRequestError


# ---- request -------------------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class UnsupportedPart(StrictModel):
    """Declared so the refusal names them."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]


class MessageItem(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | UnsupportedPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """vLLM extension."""
    seed: int | None = None
    """vLLM extension."""
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    """Only ``disabled``: a conversation too long for the context is a 400, never cut."""
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    """Accepted for compatibility; this server has one tier."""
    prompt_cache_key: str | None = None
    """Accepted: the prefix cache is automatic here."""
    cache_salt: CacheSalt = None
    """vLLM extension: prefix-cache blocks are reused only between requests with the same salt."""
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        """Refuse what this server cannot honour, naming the field."""
        if self.background:
            raise InvalidRequestError("background responses are not supported", param="background")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError("reasoning options are not supported", param="reasoning")
        if self.include:
            raise InvalidRequestError(f"include {self.include} is not supported", param="include")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported here", param="top_logprobs")
        if self.max_tool_calls is not None:
            raise InvalidRequestError("max_tool_calls is not supported", param="max_tool_calls")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequestError("input must not be empty", param="input")


# ---- mapping onto chat -----------------------------------------------------------------------
def _text(content: str | list[TextPart], param: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, UnsupportedPart):
            raise InvalidRequestError(
                f"{part.type} content is not supported by this server", param=f"{param}.{j}"
            )
    return "".join(p.text for p in content if isinstance(p, TextPart))


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own turns as chat messages (no instructions, no earlier conversation)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            content = _text(item.content, f"input.{i}.content")  # type: ignore[arg-type]
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = _text(item.output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def chat_fields(body: ResponsesRequest) -> dict[str, Any]:
    """Everything of the chat request but its messages."""
    chat: dict[str, Any] = {"model": body.model, "stream": body.stream}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "user",
        "parallel_tool_calls",
        "cache_salt",
    ):
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if not fmt.name:
            raise InvalidRequestError(
                "text.format of type json_schema needs a name", param="text.format.name"
            )
        schema = {"name": fmt.name, "schema": fmt.json_schema or {}}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


# ---- the store -------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    """A response as the client got it, and the conversation up to and including it."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    """Chat messages, without the request's instructions."""


class ResponseStore:
    """Stored responses, each visible only to the API key that stored it.

    Entries live in one namespace per key (``owner``: the index of the key that
    authenticated the request, or None when the server has no keys), so another key can
    neither read, continue, delete nor overwrite them: to it they do not exist. Each key
    keeps its last ``max_entries`` responses, least recently used evicted first, so one
    key's traffic cannot evict another key's conversations.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._owners: dict[int | None, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._owners.values())

    def put(self, owner: int | None, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            entries = self._owners.setdefault(owner, OrderedDict())
            entries[response_id] = entry
            entries.move_to_end(response_id)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)

    def get(self, owner: int | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            entries = self._owners.get(owner)
            entry = entries.get(response_id) if entries is not None else None
            if entry is not None and entries is not None:
                entries.move_to_end(response_id)
            return entry

    def contains(self, owner: int | None, response_id: str) -> bool:
        """Whether ``owner`` has a response stored under this id (does not touch its recency)."""
        with self._lock:
            return response_id in self._owners.get(owner, {})

    def delete(self, owner: int | None, response_id: str) -> bool:
        with self._lock:
            entries = self._owners.get(owner)
            return entries is not None and entries.pop(response_id, None) is not None
