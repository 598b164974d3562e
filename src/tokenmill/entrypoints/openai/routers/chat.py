"""``POST /v1/chat/completions``: conversations through the model's chat template.

Owns the chat wire format: the prompt is the model's template (run in the tokenizer's
jinja2 sandbox) applied to ``messages``; a request may bring its own template only when
the operator passed ``--trust-request-chat-template``, and its ``chat_template_kwargs`` may
add template variables but never replace one the server sets (special tokens, ``messages``,
``tools``...), so they cannot forge special tokens or slip tools past the checks on
``tools``. Tool calls (``tools.py``) become ``message.tool_calls`` or streamed
``delta.tool_calls``. Streams send a role delta first, then content deltas, a finish chunk
per choice, the optional usage chunk and ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2.defaults
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.entrypoints.openai.chat_options import format_content
from tokenmill.entrypoints.openai.generation import GenerationRun
from tokenmill.entrypoints.openai.generation_request import (
    ParsedRequest,
    check_params,
    compile_grammar,
    parse_request,
    process_prompts,
)
from tokenmill.entrypoints.openai.generation_response import (
    ChunkWriter,
    choice_logprob_entries,
    respond,
    token_label,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
)
from tokenmill.entrypoints.openai.reasoning import (
    ReasoningStreamer,
    is_thinking,
    reasoning_fields,
    split_reasoning,
)
from tokenmill.entrypoints.openai.routers.completions import vllm_prompt_logprobs
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.tools import (
    ToolCallStreamer,
    ToolMode,
    resolve_tool_mode,
    tool_calls_message,
    tool_constraint,
)
from tokenmill.errors import FeatureNotAllowedError, InvalidRequestError
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.tokenizer.tokenizer import NAMED_SPECIAL_TOKENS

router = APIRouter()

_RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "chat_template",
        "tools",
        "documents",
        "raise_exception",
        "strftime_now",
        *NAMED_SPECIAL_TOKENS,
        *jinja2.defaults.DEFAULT_NAMESPACE,
    }
)
"""Template variables the server sets (besides the model's own ``*_token`` ones)."""


def check_chat_template_kwargs(
    kwargs: Mapping[str, Any], special_tokens: Mapping[str, str]
) -> None:
    """400 naming the first key that would replace a variable the server sets."""
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KEYS or key in special_tokens:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {key!r}: the server sets that template variable",
                param="chat_template_kwargs",
            )


def render_chat_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    fields: ChatTemplateFields,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation rendered by the chat template (call off the event loop)."""
    tokenizer = state.engine.tokenizer
    options = state.chat
    if fields.chat_template is not None and not state.config.trust_request_chat_template:
        raise InvalidRequestError(
            "request chat templates are disabled; the operator can allow them with --trust-request-chat-template",
            param="chat_template",
        )
    template = fields.chat_template or options.template
    if template is None and not tokenizer.has_chat_template:
        raise InvalidRequestError(
            "this model has no chat template; use the completions endpoint", param="messages"
        )
    kwargs = fields.chat_template_kwargs or {}
    check_chat_template_kwargs(kwargs, tokenizer.special_tokens)
    kwargs = {**(options.default_kwargs or {}), **kwargs}
    if tools:
        kwargs = {**kwargs, "tools": tools}
    tokenization = state.tokenization
    content_format = options.content_format_for(
        tokenizer.chat_templates.get(template, template)
        if template is not None
        else tokenizer.chat_template
    )
    return tokenizer.apply_chat_template(
        [format_content(m.model_dump(exclude_none=True), content_format) for m in messages],
        add_generation_prompt=fields.add_generation_prompt,
        chat_template=template,
        max_chars=tokenization.max_render_chars,
        time_budget_s=tokenization.chat_template_timeout_s
        if fields.chat_template is not None
        else None,
        **kwargs,
    )


def encode_chat_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    fields: ChatTemplateFields,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation (templates write their own BOS; call off the event loop)."""
    text = render_chat_prompt(state, messages, fields, tools)
    return state.tokenization.encode(text, add_special_tokens, param="messages")


async def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    fields: ChatTemplateFields,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """``encode_chat_prompt`` on the tokenizing pool."""
    return await state.tokenization.run(
        encode_chat_prompt, state, messages, fields, add_special_tokens, tools
    )


def chat_logprobs(
    token_ids: list[int],
    entries: Sequence[PositionLogprobs | None] | None,
    tokenizer: Any,
    num_top: int,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's chat logprobs object: one entry per token with its top alternatives.

    ``bytes`` are the token's text even when it is labelled ``token_id:N``."""
    content = []
    for token_id, text, logprob, top in choice_logprob_entries(token_ids, entries, tokenizer):
        content.append(
            {
                "token": token_label(token_id, text, as_token_ids),
                "logprob": logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": token_label(t, t_text, as_token_ids),
                        "logprob": lp,
                        "bytes": list(t_text.encode("utf-8")),
                    }
                    for t, t_text, lp in top[:num_top]
                ],
            }
        )
    return {"content": content}


@dataclass
class ChatRun:
    """A chat request that was admitted and tokenized: its engine run and tool mode."""

    run: GenerationRun
    mode: ToolMode
    num_top: int
    """Top logprobs per token asked for."""


async def start_chat_run(req: ParsedRequest[ChatCompletionRequest]) -> ChatRun:
    """Check, admit and tokenize a chat request; what chat, Messages and Responses share."""
    body, state = req.body, req.state
    num_top = body.top_logprobs or 0
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    mode = resolve_tool_mode(
        tools,
        body.tool_choice.model_dump()
        if isinstance(body.tool_choice, BaseModel)
        else body.tool_choice,
        state.config.enable_auto_tool_choice,
        state.config.tool_call_parser,
    )
    try:
        params = body.sampling_params(
            body.max_new_tokens(), num_top if body.logprobs else None, body.prompt_logprobs
        )
        field = body.structured_outputs_params()[1]
        constraint = tool_constraint(mode, tools, body.parallel_tool_calls)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(
                    f"tool_choice {mode.kind!r} cannot be combined with {field}",
                    param="tool_choice",
                )
            params, field = params.clone(structured_outputs=constraint), "tools"
        grammar = await compile_grammar(state, params, field)
        checked = check_params(req, params, body.priority, grammar)
    except InvalidRequestError as exc:
        if exc.param == "logprobs" and not isinstance(exc, FeatureNotAllowedError):
            exc.param = "top_logprobs"  # the count chat asks for
        if exc.param == "max_tokens" and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
    req.admit(1, params.n, params.use_beam_search)
    prompt_tools = tools if mode.kind != "none" else None
    ids = await chat_prompt_ids(state, body.messages, body, tools=prompt_tools)
    prompts = await process_prompts(req, [ids], checked)
    return ChatRun(GenerationRun(state, req.request_id, prompts), mode, num_top)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    req = await parse_request(request, ChatCompletionRequest, "chatcmpl")
    started = await start_chat_run(req)
    run, mode, num_top, body, state = (
        started.run,
        started.mode,
        started.num_top,
        req.body,
        req.state,
    )
    style = _ResponseStyle(
        role=state.chat.response_role if body.add_generation_prompt else body.messages[-1].role,
        is_thinking=is_thinking(
            state.config.reasoning_parser,
            {**(state.chat.default_kwargs or {}), **(body.chat_template_kwargs or {})},
        ),
    )
    return await respond(
        req,
        run,
        "chat.completion",
        stream=lambda: _stream(req, run, num_top, mode, style),
        build_choices=lambda outputs: _choices(run, body, outputs[0], num_top, mode, style),
        build_extra=lambda outputs: _response_extra(run, body, outputs[0]),
    )


@dataclass(frozen=True)
class _ResponseStyle:
    """What a response's messages look like beyond the model's text."""

    role: str
    """``--response-role``, or the last message's role without the generation prompt."""
    is_thinking: bool
    """Whether the output starts as reasoning (``--reasoning-parser``)."""


def _response_extra(
    run: GenerationRun, body: ChatCompletionRequest, output: RequestOutput | None
) -> dict[str, Any]:
    """vLLM's top-level extras: ``prompt_logprobs`` and ``prompt_token_ids`` when asked for."""
    extra: dict[str, Any] = {}
    if body.prompt_logprobs is not None:
        extra["prompt_logprobs"] = vllm_prompt_logprobs(output)
    if body.return_token_ids:
        extra["prompt_token_ids"] = run.prompts[0].prompt_token_ids
    return extra


def _choices(
    run: GenerationRun,
    body: ChatCompletionRequest,
    output: RequestOutput | None,
    num_top: int,
    mode: ToolMode,
    style: _ResponseStyle,
) -> list[dict[str, Any]]:
    tokenizer = run.state.engine.tokenizer
    by_index = {c.index: c for c in output.outputs} if output is not None else {}
    choices = []
    for i in range(run.params.n):
        c = by_index.get(i)
        finish_reason = (c.finish_reason if c is not None else None) or "length"
        text: str | None = c.text if c is not None else ""
        reasoning = None
        if style.is_thinking:
            reasoning, text = split_reasoning(text or "")
        message: dict[str, Any] = {"role": style.role, "content": text}
        if mode.kind != "none" and text is not None:
            content, tool_calls = tool_calls_message(text, mode)
            if tool_calls:
                message = {"role": style.role, "content": content, "tool_calls": tool_calls}
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        message.update(reasoning_fields(reasoning))
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(
                c.token_ids if c else [],
                c.logprobs if c else None,
                tokenizer,
                num_top,
                body.return_tokens_as_token_ids,
            )
            if body.logprobs
            else None,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason if c is not None else None,
        }
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids) if c is not None else []
        choices.append(choice)
    return choices


async def _stream(
    req: ParsedRequest[ChatCompletionRequest],
    run: GenerationRun,
    num_top: int,
    mode: ToolMode,
    style: _ResponseStyle,
) -> AsyncIterator[bytes]:
    body = req.body
    tokenizer = run.state.engine.tokenizer
    chunk = ChunkWriter(req, run, "chat.completion.chunk")
    streamers = (
        [ToolCallStreamer(mode) for _ in range(run.num_choices)] if mode.kind != "none" else None
    )
    thinkers = [ReasoningStreamer() for _ in range(run.num_choices)] if style.is_thinking else None
    yield chunk(
        [
            {
                "index": i,
                "delta": {"role": style.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(run.num_choices)
        ],
        {"prompt_token_ids": run.prompts[0].prompt_token_ids} if body.return_token_ids else None,
    )
    is_prompt_logprobs_sent = body.prompt_logprobs is None
    async for batch in run.deltas():
        content = []
        finishes = []
        for d in batch:
            is_last = d.finish_reason is not None
            if d.text or d.token_ids or (thinkers is not None and is_last):
                logprobs = (
                    chat_logprobs(
                        d.token_ids, d.logprobs, tokenizer, num_top, body.return_tokens_as_token_ids
                    )
                    if body.logprobs
                    else None
                )
                text, reasoning = d.text, ""
                if thinkers is not None:
                    reasoning, text = thinkers[d.index].feed(d.text, is_last)
                delta: dict[str, Any] = {"content": text}
                if streamers is not None:
                    text, calls = streamers[d.index].feed(text, is_last)
                    delta = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = calls
                if thinkers is not None:
                    if not text:
                        delta.pop("content", None)
                    delta.update(reasoning_fields(reasoning or None))
                if not (d.text or d.token_ids or delta):
                    continue
                entry: dict[str, Any] = {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                if body.return_token_ids:
                    entry["token_ids"] = d.token_ids
                content.append(entry)
            elif streamers is not None and d.finish_reason is not None:
                text, calls = streamers[d.index].feed("", True)
                if text or calls:
                    late: dict[str, Any] = {"content": text} if text else {}
                    if calls:
                        late["tool_calls"] = calls
                    content.append(
                        {"index": d.index, "delta": late, "logprobs": None, "finish_reason": None}
                    )
            if d.finish_reason is not None:
                reason = d.finish_reason
                if reason == "stop" and streamers is not None and streamers[d.index].has_tool_calls:
                    reason = "tool_calls"
                finishes.append(
                    {
                        "index": d.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": d.stop_reason,
                    }
                )
        if content:
            extra = None
            if not is_prompt_logprobs_sent:  # vLLM sends them once, with the first output
                is_prompt_logprobs_sent = True
                extra = {"prompt_logprobs": vllm_prompt_logprobs(run.latest[0])}
            yield chunk(content, extra)
        if finishes:
            yield chunk(finishes)
    if body.include_usage:
        yield chunk.usage()
