"""``POST /v1/chat/completions``: conversations through the model's chat template.

Owns the chat wire format: the prompt is the model's template (run in the tokenizer's
jinja2 sandbox) applied to ``messages``; a request may bring its own template only when
the operator passed ``--trust-request-chat-template``. Streams send a role delta first,
then content deltas, a finish chunk per choice, the optional usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.generation import (
    GenerationRun,
    PromptInput,
    choice_logprob_entries,
    guard_stream,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    decode_json_object,
    validate_model,
)
from tokenmill.entrypoints.openai.state import ServerState, get_state, new_request_id
from tokenmill.entrypoints.openai.streaming import (
    ClientDisconnected,
    SSEResponse,
    run_until_disconnected,
    sse_event,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import PositionLogprobs

router = APIRouter()

_RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "chat_template"})


def render_chat_prompt(
    state: ServerState, messages: list[ChatMessage], fields: ChatTemplateFields
) -> str:
    """The conversation rendered by the chat template (call off the event loop)."""
    tokenizer = state.engine.tokenizer
    if fields.chat_template is not None and not state.config.trust_request_chat_template:
        raise InvalidRequestError(
            "request chat templates are disabled; the operator can allow them with --trust-request-chat-template",
            param="chat_template",
        )
    if fields.chat_template is None and not tokenizer.has_chat_template:
        raise InvalidRequestError("this model has no chat template; use the completions endpoint", param="messages")
    kwargs = {k: v for k, v in (fields.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KEYS}
    return tokenizer.apply_chat_template(
        [m.model_dump(exclude_none=True) for m in messages],
        add_generation_prompt=fields.add_generation_prompt,
        chat_template=fields.chat_template,
        **kwargs,
    )


async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], fields: ChatTemplateFields,
                          add_special_tokens: bool = False) -> list[int]:
    """Token ids of the rendered conversation (templates write their own BOS)."""

    def work() -> list[int]:
        text = render_chat_prompt(state, messages, fields)
        return state.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    return await asyncio.to_thread(work)


def chat_logprobs(
    token_ids: list[int], entries: list[PositionLogprobs | None] | None, tokenizer: Any, num_top: int
) -> dict[str, Any]:
    """OpenAI's chat logprobs object: one entry per token with its top alternatives."""
    content = []
    for _, text, logprob, top in choice_logprob_entries(token_ids, entries, tokenizer):
        content.append({
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top[:num_top]
            ],
        })
    return {"content": content}


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival_time = time.monotonic()
    state = get_state(request)
    request_id = new_request_id("chatcmpl")
    request.scope.setdefault("state", {})["request_id"] = request_id
    body = validate_model(
        ChatCompletionRequest, decode_json_object(await request.body(), request.headers.get("content-type"))
    )
    body.check()
    model = state.resolve_model(body.model)
    engine = state.ready_engine()
    num_top = body.top_logprobs or 0
    try:
        params = body.sampling_params(body.max_new_tokens(), num_top if body.logprobs else None)
        engine.validate_params(params)
    except InvalidRequestError as exc:
        if exc.param == "logprobs":
            exc.param = "top_logprobs"
        if exc.param == "max_tokens" and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
    if body.priority != 0 and state.engine_config.scheduling_policy != "priority":
        raise InvalidRequestError("priority requires the server to run with --scheduling-policy priority",
                                  param="priority")
    ids = await chat_prompt_ids(state, body.messages, body)
    engine.validate_prompt(ids)
    run = GenerationRun(state, request_id, [PromptInput(ids)], params, body.priority, arrival_time)
    created = int(time.time())
    headers = {"X-Request-Id": request_id}
    if body.stream:
        events = guard_stream(_stream(run, body, model, created, num_top), request_id,
                              on_close=lambda: run.record_for_access_log(request))
        return SSEResponse(events, headers=headers)
    try:
        outputs = await run_until_disconnected(request, run.collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        run.record_for_access_log(request)
    tokenizer = engine.tokenizer
    output = outputs[0]
    by_index = {c.index: c for c in output.outputs} if output is not None else {}
    choices = []
    for i in range(params.n):
        c = by_index.get(i)
        choices.append({
            "index": i,
            "message": {"role": "assistant", "content": c.text if c is not None else ""},
            "logprobs": chat_logprobs(c.token_ids if c else [], c.logprobs if c else None, tokenizer, num_top)
            if body.logprobs else None,
            "finish_reason": (c.finish_reason if c is not None else None) or "length",
            "stop_reason": c.stop_reason if c is not None else None,
        })
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": run.usage(), "system_fingerprint": None,
    }, headers=headers)


async def _stream(
    run: GenerationRun, body: ChatCompletionRequest, model: str, created: int, num_top: int
) -> AsyncIterator[bytes]:
    tokenizer = run.state.engine.tokenizer

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload = {"id": run.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
        if usage is not None or body.continuous_usage:
            payload["usage"] = usage if usage is not None else run.usage()
        return sse_event(payload)

    yield chunk([
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(run.num_choices)
    ])
    async for batch in run.deltas():
        content = []
        finishes = []
        for d in batch:
            if d.text or d.token_ids:
                logprobs = chat_logprobs(d.token_ids, d.logprobs, tokenizer, num_top) if body.logprobs else None
                content.append({"index": d.index, "delta": {"content": d.text}, "logprobs": logprobs,
                                "finish_reason": None})
            if d.finish_reason is not None:
                finishes.append({"index": d.index, "delta": {}, "logprobs": None,
                                 "finish_reason": d.finish_reason, "stop_reason": d.stop_reason})
        if content:
            yield chunk(content)
        if finishes:
            yield chunk(finishes)
    if body.include_usage:
        yield chunk([], usage=run.usage())
