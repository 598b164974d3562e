"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A message request is the chat request it means (``anthropic.py``), run by the chat
pipeline, so it gets the same template, tools, grammar, admission, timeout and metrics.
The answer is Anthropic's message: ``text`` and ``tool_use`` content blocks, ``stop_reason``
``end_turn``/``max_tokens``/``stop_sequence``/``tool_use`` and ``usage`` in input and output
tokens. A stream sends Anthropic's named events: ``message_start``, then per block
``content_block_start``/``content_block_delta`` (``text_delta`` or ``input_json_delta``)/
``content_block_stop``, ``message_delta`` with the stop reason and ``message_stop``; an error
after the start is an ``error`` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.anthropic import (
    CountTokensRequest,
    anthropic_error,
    chat_messages,
    chat_tools,
    to_chat_body,
)
from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.generation import GenerationRun
from tokenmill.entrypoints.openai.generation_request import ParsedRequest, parse_request
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    decode_json_object,
    validate_model,
)
from tokenmill.entrypoints.openai.routers.chat import (
    ChatRun,
    chat_prompt_ids,
    start_chat_run,
)
from tokenmill.entrypoints.openai.state import get_state
from tokenmill.entrypoints.openai.streaming import (
    SSEResponse,
    named_event,
)
from tokenmill.entrypoints.openai.tools import ToolCallStreamer, tool_calls_message
from tokenmill.outputs import CompletionOutput

logger = logging.getLogger(__name__)

router = APIRouter()


def stop_reason(finish_reason: str | None, stop: int | str | None, has_tool_calls: bool) -> str:
    """Anthropic's stop_reason for a finished choice."""
    if has_tool_calls and finish_reason == "stop":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    req = await parse_request(request, ChatCompletionRequest, "msg", translate=to_chat_body)
    started = await start_chat_run(req)
    if req.body.stream:
        events = _guarded(_stream(req, started), req, started.run)
        return SSEResponse(events, headers=req.headers)
    outputs = await started.run.collect_for(request)
    output = outputs[0]
    choice = output.outputs[0] if output is not None and output.outputs else None
    return JSONResponse(_message(req, started, choice), headers=req.headers)


def _message(
    req: ParsedRequest[ChatCompletionRequest], started: ChatRun, choice: CompletionOutput | None
) -> dict[str, Any]:
    text = choice.text if choice is not None else ""
    content: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    if started.mode.kind != "none":
        text_part, calls = tool_calls_message(text, started.mode)
        text = text_part or ""
    if text:
        content.append({"type": "text", "text": text})
    num_calls = 0
    for call in calls:
        arguments = _tool_input(call["function"]["arguments"])
        if arguments is None:  # not a JSON object: it stays text
            content.append({"type": "text", "text": call["function"]["arguments"]})
            continue
        num_calls += 1
        content.append(
            {
                "type": "tool_use",
                "id": call["id"].replace("call_", "toolu_", 1),
                "name": call["function"]["name"],
                "input": arguments,
            }
        )
    finish = (choice.finish_reason if choice is not None else None) or "length"
    stop = choice.stop_reason if choice is not None else None
    run = started.run
    return {
        "id": req.request_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason(finish, stop, num_calls > 0),
        "stop_sequence": stop if isinstance(stop, str) else None,
        "usage": {
            "input_tokens": run.num_prompt_tokens,
            "output_tokens": run.num_completion_tokens,
        },
    }


async def _stream(
    req: ParsedRequest[ChatCompletionRequest], started: ChatRun
) -> AsyncIterator[bytes]:
    run: GenerationRun = started.run
    mode = started.mode
    streamer = ToolCallStreamer(mode) if mode.kind != "none" else None
    yield named_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": req.request_id,
                "type": "message",
                "role": "assistant",
                "model": req.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": run.num_prompt_tokens, "output_tokens": 0},
            },
        },
    )
    blocks = _BlockWriter()
    finish: tuple[str | None, int | str | None] = ("length", None)
    async for batch in run.deltas():
        for d in batch:
            is_last = d.finish_reason is not None
            text, calls = streamer.feed(d.text, is_last) if streamer else (d.text, [])
            for event in blocks.text(text):
                yield event
            for call in calls:
                for event in blocks.tool_call(call):
                    yield event
            if is_last:
                finish = (d.finish_reason, d.stop_reason)
    for event in blocks.close():
        yield event
    reason, stop = finish
    yield named_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(reason, stop, blocks.num_tool_blocks > 0),
                "stop_sequence": stop if isinstance(stop, str) else None,
            },
            "usage": {"output_tokens": run.num_completion_tokens},
        },
    )
    yield named_event("message_stop", {"type": "message_stop"})


class _BlockWriter:
    """Numbers content blocks and opens and closes them as text and tool calls arrive."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.num_tool_blocks = 0
        self._open: str | None = None
        self._tool_block_of: dict[int, int] = {}

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self._open = kind
        events.append(
            named_event(
                "content_block_start",
                {"type": "content_block_start", "index": self.num_blocks, "content_block": block},
            )
        )
        self.num_blocks += 1
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta},
        )

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = self._start("text", {"type": "text", "text": ""}) if self._open != "text" else []
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def tool_call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if "id" in call:  # a new call: its own block
            events = self._start(
                "tool_use",
                {
                    "type": "tool_use",
                    "id": call["id"].replace("call_", "toolu_", 1),
                    "name": call["function"]["name"],
                    "input": {},
                },
            )
            self._tool_block_of[call["index"]] = self.num_blocks - 1
            self.num_tool_blocks += 1
        arguments = call["function"].get("arguments")
        if arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [
            named_event(
                "content_block_stop",
                {"type": "content_block_stop", "index": self.num_blocks - 1},
            )
        ]


async def _guarded(
    events: AsyncIterator[bytes], req: ParsedRequest[Any], run: GenerationRun
) -> AsyncIterator[bytes]:
    """An error once the stream began is Anthropic's ``error`` event."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = to_api_error(exc, req.request_id)
        if error.status_code >= 500 and not isinstance(exc, APIError):
            logger.error("stream %s failed: %s", req.request_id, error.message, exc_info=exc)
        yield named_event("error", anthropic_error(error.status_code, error.message))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        run.record_for_access_log(req.http)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state = get_state(request)
    data = decode_json_object(await request.body(), request.headers.get("content-type"))
    body = validate_model(CountTokensRequest, data)
    state.resolve_model(body.model)
    state.ready_engine()
    chat = validate_model(
        ChatCompletionRequest,
        {"messages": chat_messages(body), **chat_tools(body)},
    )
    chat.check()
    # As create renders them: tools are in the prompt unless tool_choice is none.
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []] or None
    if chat.tool_choice == "none":
        tools = None
    messages: list[ChatMessage] = chat.messages
    ids = await chat_prompt_ids(state, messages, chat, tools=tools)
    return JSONResponse({"input_tokens": len(ids)})
