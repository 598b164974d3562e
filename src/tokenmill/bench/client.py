"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Builds the request body for ``/v1/completions`` or ``/v1/chat/completions``, reads the
server-sent events, and turns them into a ``RequestRecord``: TTFT at the first chunk that
carries a token, ITL between token chunks, E2E at the last chunk with choices (vLLM's
rules), and token counts from the ``usage`` chunk that ``stream_options.include_usage``
asks for. Every failure becomes a record with a short reason instead of an exception,
so one bad request never stops a benchmark; a request past its total deadline fails
with the reason ``timeout``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench import MissingExtraError
from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.tokenization import TokenizerLike, encode_text

try:
    import httpx
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("httpx") from exc

ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
"""Endpoints the serve benchmark knows how to stream from."""
_MAX_REASON_CHARS = 160


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares: where it goes and how it samples."""

    url: str
    """Full URL of the endpoint, e.g. ``http://127.0.0.1:8000/v1/completions``."""
    model: str
    """Model name sent in the body."""
    is_chat: bool = False
    """True for ``/v1/chat/completions`` (text prompts in a user message)."""
    use_token_ids: bool = False
    """Send the prompt as token ids (completions only)."""
    api_key: str | None = None
    """Bearer token for servers that need one."""
    temperature: float = 0.0
    """Sampling temperature; greedy by default so reruns are comparable."""
    ignore_eos: bool = False
    """Ask the server to keep going past EOS (vLLM's extension), for fixed output lengths."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Extra fields merged into every request body."""
    timeout_s: float | None = None
    """Total deadline of one request, send to last chunk; None for none."""

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers of every request to this server (the API key, if any)."""
        return auth_headers(self.api_key)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header for ``api_key``; empty without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    payload: dict[str, Any] = {
        "model": options.model,
        "max_tokens": request.output_len,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.is_chat:
        if request.prompt_text is None:
            raise ValueError(
                "the chat endpoint needs text prompts: pass --tokenizer to decode token ids"
            )
        payload["messages"] = [{"role": "user", "content": request.prompt_text}]
    elif options.use_token_ids:
        if request.prompt_token_ids is None:
            raise ValueError("token-id prompts were asked for but this dataset only has text")
        payload["prompt"] = request.prompt_token_ids
    else:
        if request.prompt_text is None:
            raise ValueError(
                "text prompts were asked for but this dataset only has token ids: pass --tokenizer"
            )
        payload["prompt"] = request.prompt_text
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(options.extra_body)
    return payload


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _error_message(body: bytes | str) -> str:
    """The ``error.message`` of an OpenAI error body, or the raw body."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(err)
    return text


@dataclass
class _StreamState:
    """What has been seen so far in one response stream."""

    first_token_s: float | None = None
    last_token_s: float | None = None
    last_choice_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_token_chunks: int = 0
    text_parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None


def _chunk_content(choice: dict[str, Any], is_chat: bool) -> tuple[str, bool]:
    """The text a choice adds, and whether it is only a role announcement (chat)."""
    if is_chat:
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        is_role_only = not content and "role" in delta
        return content, is_role_only
    return choice.get("text") or "", False


def consume_chunk(state: _StreamState, data: dict[str, Any], now_s: float, is_chat: bool) -> None:
    """Fold one parsed SSE chunk, received ``now_s`` after send, into ``state``.

    A chunk with choices is a token event unless it only announces the role, or it only
    carries a finish reason after tokens were already seen (a trailing empty chunk would
    otherwise add a fake near-zero ITL). An empty-text chunk without a finish reason is
    a token (a special token decodes to nothing), as in vLLM.
    """
    if data.get("usage"):
        state.usage = data["usage"]
    choices = data.get("choices") or []
    if not choices:
        return
    choice = choices[0]
    content, is_role_only = _chunk_content(choice, is_chat)
    state.last_choice_s = now_s
    is_finish_only = not content and choice.get("finish_reason") is not None
    if is_role_only or (is_finish_only and state.first_token_s is not None):
        return
    if state.first_token_s is None or state.last_token_s is None:  # both set at the first token
        state.first_token_s = now_s
    else:
        state.itl_s.append(now_s - state.last_token_s)
    state.last_token_s = now_s
    state.num_token_chunks += 1
    state.text_parts.append(content)


def finish_record(
    record: RequestRecord,
    state: _StreamState,
    request: BenchRequest,
    tokenizer: TokenizerLike | None,
) -> RequestRecord:
    """Fill timings and token counts of a completed stream into ``record``."""
    if state.first_token_s is None:
        record.error = "empty response: no token chunk in the stream"
        return record
    record.success = True
    record.ttft_s = state.first_token_s
    record.itl_s = state.itl_s
    record.e2e_s = max(state.last_choice_s or 0.0, state.last_token_s or 0.0)
    record.generated_text = "".join(state.text_parts)
    usage = state.usage or {}
    record.prompt_tokens = int(usage.get("prompt_tokens") or request.prompt_len)
    if usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        record.output_tokens_source = "usage"
    elif tokenizer is not None:
        record.output_tokens = len(encode_text(tokenizer, record.generated_text))
        record.output_tokens_source = "tokenizer"
    else:
        record.output_tokens = state.num_token_chunks
        record.output_tokens_source = "chunks"
    return record


async def _read_stream(
    client: httpx.AsyncClient,
    payload: dict[str, Any],
    options: RequestOptions,
    state: _StreamState,
    send_s: float,
) -> str:
    """Stream one response into ``state``; the failure reason, or "" when it completed."""
    async with client.stream(
        "POST", options.url, json=payload, headers=options.headers
    ) as response:
        if response.status_code != 200:
            error_body = await response.aread()
            return _short(f"HTTP {response.status_code}: {_error_message(error_body)}")
        async for line in response.aiter_lines():
            now_s = time.perf_counter() - send_s
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments and event names
            body = line[len("data:") :].strip()
            if body == "[DONE]":
                break
            try:
                data = json.loads(body)
            except json.JSONDecodeError:
                return _short(f"bad SSE chunk: {body}")
            if isinstance(data, dict) and data.get("error"):
                return _short(f"stream error: {_error_message(json.dumps(data))}")
            if isinstance(data, dict):
                consume_chunk(state, data, now_s, options.is_chat)
    return ""


async def send_request(
    client: httpx.AsyncClient,
    index: int,
    request: BenchRequest,
    options: RequestOptions,
    benchmark_start_s: float,
    tokenizer: TokenizerLike | None = None,
) -> RequestRecord:
    """Send one streamed request and time it; never raises for server or network errors.

    ``options.timeout_s`` bounds the whole request (connecting, waiting and streaming),
    not each read as httpx's timeout does.
    """
    record = RequestRecord(index=index, prompt_tokens=request.prompt_len)
    try:
        payload = build_payload(request, options)
    except ValueError as exc:
        record.error = str(exc)
        return record
    state = _StreamState()
    send_s = time.perf_counter()
    record.send_time_s = send_s - benchmark_start_s
    try:
        record.error = await asyncio.wait_for(
            _read_stream(client, payload, options, state, send_s), options.timeout_s
        )
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.error = "timeout"
    except httpx.HTTPError as exc:
        record.error = _short(f"{type(exc).__name__}: {exc}")
    if record.error:
        return record
    return finish_record(record, state, request, tokenizer)
