"""API-key authentication, as pure-ASGI middleware in front of every route.

Owns the rule that nothing runs without a valid key when keys are configured: the check
is deny-by-default on the decoded path the router itself matches, so trailing slashes,
double slashes, percent-encoding, unknown routes and OPTIONS all need the key too. Only
``/health`` and ``/metrics`` (exact paths, GET and HEAD) can be opened, by an operator flag.
Keys are compared in constant time, against every configured key without stopping early.

The key that matched is recorded as ``api_key_id`` (its index) for what is kept per key:
stored responses, quotas. A server with no keys of its own (a data-parallel replica, whose
front end authenticated the request on a private socket) takes that index from the front
end's ``X-Tokenmill-Api-Key-Id`` header instead; the front end drops any such header a
client sent, and a keyed server never reads it.

With it goes ``api_key_salt``, the key's prefix-cache namespace (``generation_request``
salts each request by it unless the operator shares the cache across keys): a SHA-256 of the
key, never the key, or on a replica one of the index the front end sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.openai.middleware import header_value, send_error

OPEN_PATHS = frozenset({"/health", "/metrics"})
KEY_ID_HEADER = "x-tokenmill-api-key-id"
"""The authenticated key's index, as a data-parallel front end tells its replicas."""


def _digest(value: bytes) -> bytes:
    # Hashing first makes the comparison independent of the lengths involved.
    return hashlib.sha256(value).digest()


def key_cache_salt(key: bytes) -> str:
    """The prefix-cache namespace of an API key (domain-separated from the comparison digest)."""
    return hashlib.sha256(b"tokenmill api key cache salt\0" + key).hexdigest()


def forwarded_key_cache_salt(key_id: int) -> str:
    """On a replica: the namespace of the key the front end authenticated, by its index."""
    return f"key-index:{key_id}"


class APIKeyAuthMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or Anthropic's ``X-Api-Key: <key>``) names a configured key."""

    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], open_health_metrics: bool = False
    ) -> None:
        self.app = app
        self._key_digests = [_digest(k.encode()) for k in api_keys]
        self._key_salts = [key_cache_salt(k.encode()) for k in api_keys]
        self._open_paths = OPEN_PATHS if open_health_metrics else frozenset()

    def _key_index(self, scope: Scope) -> int | None:
        values = header_value(scope, b"authorization")
        api_keys = header_value(scope, b"x-api-key")  # Anthropic's SDK sends the key so
        if len(values) > 1 or len(api_keys) > 1:
            return None
        tokens = {k.strip() for k in api_keys}
        if values:
            scheme, _, bearer = values[0].partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            tokens.add(bearer.strip())
        if len(tokens) != 1:  # none, or two different keys: which one would it be?
            return None
        token = tokens.pop()
        if not token:
            return None
        presented = _digest(token)
        match = None
        for index, digest in enumerate(self._key_digests):
            if hmac.compare_digest(presented, digest) and match is None:
                match = index
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._key_digests:
            forwarded = header_value(scope, KEY_ID_HEADER.encode())
            if len(forwarded) == 1 and forwarded[0].isdigit():
                key_id = int(forwarded[0])
                state = scope.setdefault("state", {})
                state["api_key_id"] = key_id
                state["api_key_salt"] = forwarded_key_cache_salt(key_id)
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD") and scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        index = self._key_index(scope)
        if index is None:
            await send_error(
                send,
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers=[("WWW-Authenticate", "Bearer")],
            )
            return
        state = scope.setdefault("state", {})
        state["api_key_id"] = index
        state["api_key_salt"] = self._key_salts[index]
        await self.app(scope, receive, send)
