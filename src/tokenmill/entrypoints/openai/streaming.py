"""Client-disconnect handling and the Server-Sent-Events response.

Owns noticing that a client went away, streaming or not, queued or running, so its
engine request is aborted at once (cancelling the task that consumes the engine's output
iterator closes it, and closing it aborts the request before the next engine step). The
SSE response watches the connection itself instead of relying on a failed write, because
a request still waiting in the queue writes nothing to fail on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event; the JSON is written whole, never half."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """An event with its ``event:`` name, as Anthropic's and OpenAI Responses' streams send."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work_task
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch_task
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(Response):
    """``text/event-stream`` of the given chunks; stops (and closes them) on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        # Like StreamingResponse: no body attribute, hence no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.headers["Cache-Control"] = "no-cache"
        self.headers["X-Accel-Buffering"] = "no"
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self._stream(send))
        watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, watch_task):
                if not task.done():
                    task.cancel()
            for task in (stream_task, watch_task):
                with contextlib.suppress(asyncio.CancelledError, OSError, ClientDisconnected):
                    await task

    async def _stream(self, send: Send) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            raise ClientDisconnected() from None
        finally:
            if aclose is not None:
                await aclose()
