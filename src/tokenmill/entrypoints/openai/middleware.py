"""Pure-ASGI middleware that runs before any route: access log and request-body limit.

Owns the checks that must not depend on a route being reached: one access-log line per
HTTP request (with the request id, token counts and timings the route left in
``scope["state"]``), the request-head limits (bytes and number of headers), and the
body-size limit, enforced on
``Content-Length`` at once and on the bytes actually received for chunked bodies, so an
oversized body is never buffered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import error_body_bytes

access_logger = logging.getLogger("tokenmill.access")

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    """Answer with an OpenAI-shaped error from middleware, before the app runs."""
    body = error_body_bytes(status, message, code=code)
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header_value(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of one request header (names are lower-case in ASGI)."""
    return [v for k, v in scope.get("headers", []) if k == name]


class AccessLogMiddleware:
    """One log line per request: method, path, status, duration, id, tokens, TTFT (and the LoRA adapter, if any)."""

    def __init__(self, app: ASGIApp, skip_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.skip_paths = skip_paths
        """``--disable-access-log-for-endpoints``: paths logged by no line."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = [0]

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            state = scope.get("state", {})
            gen = state.get("generation") or {}
            ttft = gen.get("ttft_s")
            client = scope.get("client") or ("-", 0)
            access_logger.info(
                '%s "%s %s" %d %.1fms id=%s prompt_tokens=%s completion_tokens=%s ttft_ms=%s%s',
                client[0],
                scope["method"],
                scope["path"],
                status[0] or 499,
                (time.monotonic() - start) * 1e3,
                state.get("request_id", "-"),
                gen.get("prompt_tokens", "-"),
                gen.get("completion_tokens", "-"),
                f"{ttft * 1e3:.1f}" if ttft is not None else "-",
                f" lora={gen['lora']}" if gen.get("lora") else "",
            )


class HeaderLimitMiddleware:
    """431 for request heads over the byte limit or with too many headers.

    The HTTP parser's own limit only applies while a head is still incomplete, so a large
    head that arrives in one read would pass it; this check does not depend on timing. The
    parser has no limit on the number of headers, which every header lookup walks.
    """

    def __init__(self, app: ASGIApp, max_header_bytes: int, max_header_count: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", [])
            if len(headers) > self.max_header_count:
                await send_error(
                    send,
                    431,
                    f"the request has {len(headers)} headers; at most "
                    f"{self.max_header_count} are allowed",
                    code="headers_too_large",
                )
                return
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in headers)
            if size > self.max_header_bytes:
                await send_error(
                    send,
                    431,
                    f"the request line and headers exceed {self.max_header_bytes} bytes",
                    code="headers_too_large",
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, before the app reads them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        lengths = header_value(scope, b"content-length")
        if lengths:
            text = lengths[0].decode("latin-1").strip()
            if len(lengths) > 1 or not text.isdigit():
                await send_error(send, 400, "invalid Content-Length header")
                return
            if int(text) > limit:
                await send_error(
                    send, 413, f"the request body exceeds {limit} bytes", code="request_too_large"
                )
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(
                    send, 413, f"the request body exceeds {limit} bytes", code="request_too_large"
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


SERVER_LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Paths whose requests ``--enable-server-load-tracking`` counts (vLLM's generation routes)."""


class ServerLoadMiddleware:
    """``--enable-server-load-tracking``: generation requests in flight, in
    ``app.state.server_load_metrics`` (what vLLM's ``/load`` answers), until their response
    (a whole stream) has been sent or the client left."""

    def __init__(self, app: ASGIApp, paths: frozenset[str] = SERVER_LOAD_PATHS) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load_metrics -= 1
