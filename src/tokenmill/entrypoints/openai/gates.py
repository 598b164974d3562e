"""The order of the gates in front of the routes, for every tokenmill HTTP front door.

The single server and the data-parallel front ends (``--backend mp`` and Ray's ingress)
install the same gates in the same order, so an unauthenticated or oversized request costs
nothing and is refused in the API's shape (Anthropic's on ``/v1/messages``). The order lives
here alone; a caller adds what only it has (the single server's admission and routes inside
the API key, its access log and response counts outside everything).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from tokenmill.entrypoints.openai.anthropic import AnthropicErrorMiddleware
from tokenmill.entrypoints.openai.auth import APIKeyAuthMiddleware
from tokenmill.entrypoints.openai.middleware import (
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
    ServerLoadMiddleware,
)
from tokenmill.entrypoints.openai.state import ServerConfig


def add_gates(
    app: Starlette,
    config: ServerConfig,
    inside_auth: Callable[[], None] | None = None,
    track_load: bool = False,
) -> None:
    """Add the gates, innermost first (the last one added runs first).

    The body limit (413 while the body arrives, not once it is buffered), then whatever
    ``inside_auth`` adds, API keys, the head limits, ``--enable-server-load-tracking`` when
    ``track_load``, CORS (vLLM's flags; without origins, no cross-origin calls), and
    Anthropic's error shape outside all of them, so their errors get it too.
    """
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_request_body_bytes)
    if inside_auth is not None:
        inside_auth()
    app.add_middleware(
        APIKeyAuthMiddleware,
        api_keys=config.api_keys,
        open_health_metrics=config.disable_auth_for_health_metrics,
    )
    app.add_middleware(
        HeaderLimitMiddleware,
        max_header_bytes=config.max_header_bytes,
        max_header_count=config.max_header_count,
    )
    if track_load:
        app.add_middleware(ServerLoadMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_credentials=config.allow_credentials,
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )
    app.add_middleware(AnthropicErrorMiddleware)
