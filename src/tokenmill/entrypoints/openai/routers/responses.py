"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A response request is the chat request it means (``responses_api.py``), run by the chat
pipeline: same template, tools, grammar (``text.format``), admission, timeout and metrics.
Its output is a list of items: a ``message`` with ``output_text`` and, per tool call, a
``function_call`` whose ``call_id`` the next turn answers with a ``function_call_output``.
A stream sends the Responses events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``/``.done``, ``response.function_call_arguments.delta``/``.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``,
or ``response.incomplete`` when ``max_output_tokens`` ran out), each with its
``sequence_number``. With ``store`` (the default) the response and its conversation are kept
for ``previous_response_id`` and ``GET``, within ``--max-stored-responses``.

A stored response belongs to the API key that created it: reads, continuations and deletes
by another key get the same 404 as an id that was never stored, and a client-chosen id
(``X-Request-Id``) names a response in its own key's space only. Reusing the id of one of
the key's own stored responses is refused (409) rather than overwriting it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.generation_request import ParsedRequest, parse_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, validate_model
from tokenmill.entrypoints.openai.responses_api import (
    FunctionToolChoice,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    chat_fields,
    input_messages,
)
from tokenmill.entrypoints.openai.routers.chat import ChatRun, start_chat_run
from tokenmill.entrypoints.openai.state import get_state
from tokenmill.entrypoints.openai.streaming import (
    SSEResponse,
    named_event,
)
from tokenmill.entrypoints.openai.tools import ToolCallStreamer, ToolMode

logger = logging.getLogger(__name__)

router = APIRouter()


def _owner(request: Request) -> int | None:
    """The API key (its index in ``--api-key``) the request authenticated with; None without keys."""
    owner: int | None = request.scope.get("state", {}).get("api_key_id")
    return owner


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found"
    )


class _Translation:
    """Maps the body onto chat's, keeping the parsed body and the conversation so far."""

    def __init__(self, store: ResponseStore, owner: int | None) -> None:
        self.store = store
        self.owner = owner
        self.body: ResponsesRequest | None = None
        self.conversation: list[dict[str, Any]] = []

    def __call__(self, data: dict[str, Any]) -> dict[str, Any]:
        body = validate_model(ResponsesRequest, data)
        body.check()
        previous: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            entry = self.store.get(self.owner, body.previous_response_id)
            if entry is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            previous = [dict(m) for m in entry.conversation]
        self.body = body
        self.conversation = previous + input_messages(body)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        return {**chat_fields(body), "messages": system + self.conversation}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The response's output items, built from the choice's text as it grows; the stream events too."""

    def __init__(self, mode: ToolMode) -> None:
        self.streamer = ToolCallStreamer(mode) if mode.kind != "none" else None
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_items: dict[int, dict[str, Any]] = {}
        self.sequence_number = 0

    def event(self, event_type: str, /, **payload: Any) -> bytes:
        data = {"type": event_type, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return named_event(event_type, data)

    def feed(self, text: str, is_finished: bool) -> list[bytes]:
        content, calls = self.streamer.feed(text, is_finished) if self.streamer else (text, [])
        events = self._text(content) if content else []
        for call in calls:
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self.close()
            item = {
                "type": "message",
                "id": _new_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._open = item
            self.items.append(item)
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=self._index,
                    item=dict(item, content=[]),
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    part=dict(part),
                )
            )
        item["content"][0]["text"] += text
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if "id" in call:  # a new call: its own item
            events += self.close()
            item = {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self._open = item
            self._call_items[call["index"]] = item
            self.items.append(item)
            events.append(
                self.event("response.output_item.added", output_index=self._index, item=dict(item))
            )
        item = self._call_items[call["index"]]
        delta = call["function"].get("arguments")
        if delta:
            item["arguments"] += delta
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=delta,
                )
            )
        return events

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def close(self) -> list[bytes]:
        """Finish the open item: its ``.done`` events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def conversation_turn(self) -> dict[str, Any]:
        """The output as the assistant chat message the next turn continues from."""
        text = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        if calls:
            turn["tool_calls"] = calls
        elif not text:
            turn["content"] = ""
        return turn


def _response(
    req: ParsedRequest[ChatCompletionRequest],
    body: ResponsesRequest,
    started: ChatRun,
    output: _Output | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    """The response object: in progress (``output`` None) or finished."""
    run = started.run
    status, incomplete = "in_progress", None
    usage = None
    if output is not None:
        status = "incomplete" if finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        latest = run.latest[0]
        usage = {
            "input_tokens": run.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": latest.num_cached_tokens if latest else 0},
            "output_tokens": run.num_completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": run.num_prompt_tokens + run.num_completion_tokens,
        }
    choice = body.tool_choice
    return {
        "id": req.request_id,
        "object": "response",
        "created_at": req.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": req.model,
        "output": output.items if output is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "service_tier": "default",
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": body.text.model_dump(exclude_none=True, by_alias=True)
        if body.text is not None and body.text.format is not None
        else {"format": {"type": "text"}},
        "tool_choice": choice.model_dump()
        if isinstance(choice, FunctionToolChoice)
        else (choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
    }


def _store(
    store: ResponseStore, translation: _Translation, response: dict[str, Any], output: _Output
) -> None:
    body = translation.body
    assert body is not None
    if body.store:
        conversation = [*translation.conversation, output.conversation_turn()]
        store.put(translation.owner, response["id"], StoredResponse(response, conversation))


def _check_new_id(store: ResponseStore, owner: int | None, request_id: str) -> None:
    """Refuse a client-chosen id that already names one of this key's stored responses."""
    if store.contains(owner, request_id):
        raise APIError(
            409,
            f"A stored response with id '{request_id}' already exists; send another "
            "X-Request-Id, or delete that response first.",
            param="X-Request-Id",
            code="response_id_in_use",
        )


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = get_state(request)
    translation = _Translation(state.response_store, _owner(request))
    req = await parse_request(request, ChatCompletionRequest, "resp", translate=translation)
    body = translation.body
    assert body is not None
    if body.store:
        _check_new_id(state.response_store, translation.owner, req.request_id)
    started = await start_chat_run(req)
    if body.stream:
        events = _stream(req, body, started, translation, state.response_store)
        return SSEResponse(events, headers=req.headers)
    run = started.run
    outputs = await run.collect_for(request)
    latest = outputs[0]
    choice = latest.outputs[0] if latest is not None and latest.outputs else None
    output = _Output(started.mode)
    output.feed(choice.text if choice is not None else "", True)
    output.close()
    finish = (choice.finish_reason if choice is not None else None) or "length"
    response = _response(req, body, started, output, finish)
    _store(state.response_store, translation, response, output)
    return JSONResponse(response, headers=req.headers)


async def _stream(
    req: ParsedRequest[ChatCompletionRequest],
    body: ResponsesRequest,
    started: ChatRun,
    translation: _Translation,
    store: ResponseStore,
) -> AsyncIterator[bytes]:
    output = _Output(started.mode)
    run = started.run
    try:
        yield output.event("response.created", response=_response(req, body, started, None, None))
        yield output.event(
            "response.in_progress", response=_response(req, body, started, None, None)
        )
        finish: str | None = "length"
        async for batch in run.deltas():
            for d in batch:
                for event in output.feed(d.text, d.finish_reason is not None):
                    yield event
                if d.finish_reason is not None:
                    finish = d.finish_reason
        for event in output.close():
            yield event
        response = _response(req, body, started, output, finish)
        _store(store, translation, response, output)
        name = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield output.event(name, response=response)
    except Exception as exc:
        error = to_api_error(exc, req.request_id)
        if error.status_code >= 500 and not isinstance(exc, APIError):
            logger.error("stream %s failed: %s", req.request_id, error.message, exc_info=exc)
        yield output.event("error", code=error.code, message=error.message, param=error.param)
    finally:
        run.record_for_access_log(req.http)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
    entry = get_state(request).response_store.get(_owner(request), response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    if not get_state(request).response_store.delete(_owner(request), response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
