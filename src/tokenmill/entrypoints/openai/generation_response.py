"""Answering a generation request: one JSON body, or a stream of SSE chunks.

``respond`` picks between them, ``ChunkWriter`` builds the chunk envelope, ``guard_stream``
turns a failure mid-stream into an error event, and the logprob helpers shape per-token
entries the way completions and chat both report them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.generation import GenerationRun
from tokenmill.entrypoints.openai.generation_request import ParsedRequest
from tokenmill.entrypoints.openai.streaming import (
    SSE_DONE,
    SSEResponse,
    sse_event,
)
from tokenmill.outputs import PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0
"""Stands in for -inf so the JSON stays valid (vLLM does the same)."""


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


# ---- responding: one JSON body, or a stream of chunks ------------------------------------------
class ChunkWriter:
    """The SSE chunks of one stream: the shared envelope, and the usage a chunk may carry."""

    def __init__(self, req: ParsedRequest[Any], run: GenerationRun, object_name: str) -> None:
        self.req = req
        self.run = run
        self.object_name = object_name

    def __call__(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        """A chunk of these choices (with the running usage if ``continuous_usage_stats``),
        plus ``extra`` top-level fields (vLLM's ``prompt_token_ids``, ``prompt_logprobs``)."""
        usage = self.run.usage() if self.req.body.continuous_usage else None
        return self._event(choices, usage, extra)

    def usage(self) -> bytes:
        """The final chunk ``include_usage`` asks for: no choices, the request's usage."""
        return self._event([], self.run.usage())

    def _event(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        req = self.req
        payload: dict[str, Any] = {
            "id": req.request_id,
            "object": self.object_name,
            "created": req.created,
            "model": req.model,
            "choices": choices,
            **(extra or {}),
        }
        if usage is not None:
            payload["usage"] = usage
        return sse_event(payload)


async def respond(
    req: ParsedRequest[Any],
    run: GenerationRun,
    object_name: str,
    stream: Callable[[], AsyncIterator[bytes]],
    build_choices: Callable[[list[RequestOutput | None]], list[dict[str, Any]]],
    build_extra: Callable[[list[RequestOutput | None]], dict[str, Any]] | None = None,
) -> Response:
    """Stream ``stream()``'s chunks, or run to the end and answer the choices in one body.

    A client that disconnects before a plain body is ready gets 499 (nginx's code), which
    only the access log sees.
    """
    request = req.http
    if req.body.stream:
        events = guard_stream(
            stream(), req.request_id, on_close=lambda: run.record_for_access_log(request)
        )
        return SSEResponse(events, headers=req.headers)
    outputs = await run.collect_for(request)
    return JSONResponse(
        {
            "id": req.request_id,
            "object": object_name,
            "created": req.created,
            "model": req.model,
            "choices": build_choices(outputs),
            "usage": run.usage(),
            "system_fingerprint": None,
            **(build_extra(outputs) if build_extra is not None else {}),
        },
        headers=req.headers,
    )


async def guard_stream(
    events: AsyncIterator[bytes], request_id: str, on_close: Callable[[], None] | None = None
) -> AsyncIterator[bytes]:
    """Pass SSE events through; any error becomes an error event, and ``[DONE]`` always ends it."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = to_api_error(exc, request_id)
        if error.status_code >= 500 and not isinstance(exc, APIError):
            logger.error("stream %s failed: %s", request_id, error.message, exc_info=exc)
        yield sse_event(error.body())
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
        if on_close is not None:
            on_close()
    yield SSE_DONE


def token_label(token_id: int, text: str, as_token_ids: bool) -> str:
    """How a logprob entry names its token: its text, or vLLM's ``token_id:N`` when the
    request set ``return_tokens_as_token_ids`` (exact ids, whatever the detokenizer does)."""
    return f"token_id:{token_id}" if as_token_ids else text


def choice_logprob_entries(
    token_ids: list[int], entries: Sequence[PositionLogprobs | None] | None, tokenizer: Any
) -> list[tuple[int, str, float | None, list[tuple[int, str, float]]]]:
    """(token id, token text, logprob, top (id, text, logprob) by rank) for each position."""
    rows: list[tuple[int, str, float | None, list[tuple[int, str, float]]]] = []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            rows.append((token_id, tokenizer.id_to_token_text(token_id), None, []))
            continue
        chosen = entry.get(token_id)
        text = (
            chosen.decoded_token
            if chosen and chosen.decoded_token is not None
            else tokenizer.id_to_token_text(token_id)
        )
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        top_rows = [
            (
                t,
                lp.decoded_token if lp.decoded_token is not None else tokenizer.id_to_token_text(t),
                finite_logprob(lp.logprob),
            )
            for t, lp in top
        ]
        rows.append((token_id, text, finite_logprob(chosen.logprob) if chosen else None, top_rows))
    return rows
