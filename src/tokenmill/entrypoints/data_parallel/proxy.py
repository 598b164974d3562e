"""What the two data-parallel front ends share (``--backend mp``'s and Ray's ingress).

One place for the gates in front of the replicas (the single server's own middlewares, in
its order: an unauthenticated or oversized request costs nothing and is refused in the
API's shape, Anthropic's on ``/v1/messages``), for the errors the front end itself answers,
for the headers it forwards and returns, for the error event that ends a stream its
replica lost, and for releasing an admission ticket whatever happens to the response.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenmill.entrypoints.openai.auth import KEY_ID_HEADER
from tokenmill.entrypoints.openai.errors import APIError, error_body_bytes
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.entrypoints.openai.streaming import SSE_DONE, named_event

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
        "authorization",  # checked by the front end; replicas have no keys
        "x-api-key",
        KEY_ID_HEADER,  # only the front end may say which key a request came with
    }
)
REPLICA_HEADER = "x-tokenmill-replica"
"""Response header naming the replica that answered (for logs and debugging)."""
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""Runtime LoRA routes: every replica must see them, not one."""


def error_response(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    """The API's error JSON (AnthropicErrorMiddleware reshapes it on ``/v1/messages``)."""
    return Response(
        error_body_bytes(status, message, code=code),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def refusal_response(refusal: APIError) -> Response:
    """An admission refusal (429) with its headers (``Retry-After``)."""
    return error_response(
        refusal.status_code, refusal.message, code=refusal.code, headers=refusal.headers
    )


def forwarded_headers(
    headers: Iterable[tuple[str, str]], api_key_id: int | None = None
) -> list[tuple[str, str]]:
    """A request's headers as the replica gets them: no hop-by-hop ones and no key, but
    which key authenticated it (``api_key_id``), so per-key state such as stored
    responses stays the key's own on the replica too."""
    out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
    if api_key_id is not None:
        out.append((KEY_ID_HEADER, str(api_key_id)))
    return out


def response_headers(headers: Iterable[tuple[str, str]], replica: str) -> dict[str, str]:
    """A replica's response headers as the client gets them, naming the replica."""
    out = {
        k: v for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding"
    }
    out[REPLICA_HEADER] = replica
    return out


def stream_error(path: str, status: int, message: str, code: str) -> bytes:
    """The events that end a stream cut off mid-way, as the single server ends one:
    Anthropic's ``error`` event on ``/v1/messages``, else the error JSON and ``[DONE]``."""
    if path.startswith("/v1/messages"):
        from tokenmill.entrypoints.openai.anthropic import anthropic_error

        return named_event("error", anthropic_error(status, message))
    return b"data: " + error_body_bytes(status, message, code=code) + b"\n\n" + SSE_DONE


class ReleasingResponse(Response):
    """Sends ``inner``, then calls ``release`` however sending ended (done, client gone,
    cancelled, an error): an admission ticket is released exactly once. A stream's body
    iterator is closed too, so its upstream connection closes and the replica aborts."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:
        self.inner = inner
        self.release = release
        self.status_code = inner.status_code
        self.background = None  # the inner response runs its own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            try:
                aclose = getattr(getattr(self.inner, "body_iterator", None), "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.release()


def add_front_middlewares(app: Starlette, config: ServerConfig) -> None:
    """The single server's gates, in its order (``openai/gates.add_gates``), for a front end.

    The body limit, API keys, the head limits, CORS (at the front: the replicas are reached
    by it alone) and Anthropic's error shape; admission is the front end's own."""
    from tokenmill.entrypoints.openai.gates import add_gates

    add_gates(app, config)
