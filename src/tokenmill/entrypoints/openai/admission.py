"""Admission control: bound the requests in flight, per server and per API key.

Owns the decision to take a generation request at all, made before its body is read or
tokenized: beyond ``--max-num-seqs + --max-queue-len`` requests in flight, or beyond an
API key's ``--per-key-max-concurrency``, the answer is an immediate 429 with
``Retry-After``, so overload costs almost nothing and a few heavy clients cannot take every
slot. While the server drains on SIGTERM every new request gets 503.
"""

from __future__ import annotations

from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.openai.middleware import send_error
from tokenmill.entrypoints.openai.state import ServerState

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1


class AdmissionController:
    """Counts admitted requests, in total and per API key."""

    def __init__(self, max_in_flight: int, per_key_max: int | None) -> None:
        self.max_in_flight = max_in_flight
        self.per_key_max = per_key_max
        self.num_in_flight = 0
        self._per_key: Counter[int] = Counter()

    def try_acquire(self, key_id: int | None) -> str | None:
        """Admit one request, or return why not."""
        if self.num_in_flight >= self.max_in_flight:
            return "the server is at capacity (running batch and waiting queue are full); retry later"
        if key_id is not None and self.per_key_max is not None and self._per_key[key_id] >= self.per_key_max:
            return f"this API key already has {self.per_key_max} requests in flight; retry later"
        self.num_in_flight += 1
        if key_id is not None:
            self._per_key[key_id] += 1
        return None

    def release(self, key_id: int | None) -> None:
        self.num_in_flight -= 1
        if key_id is not None:
            self._per_key[key_id] -= 1
            if self._per_key[key_id] <= 0:
                del self._per_key[key_id]


class AdmissionMiddleware:
    """429 when full, 503 while draining; otherwise holds a slot until the response ends."""

    def __init__(self, app: ASGIApp, state: ServerState, controller: AdmissionController) -> None:
        self.app = app
        self.state = state
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.is_draining and scope["path"] != "/metrics":
            await send_error(send, 503, "the server is shutting down", headers=[("Retry-After", "1")])
            return
        if scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        key_id = scope.get("state", {}).get("api_key_id")
        refusal = self.controller.try_acquire(key_id)
        if refusal is not None:
            await send_error(send, 429, refusal, code="rate_limit_exceeded",
                             headers=[("Retry-After", str(RETRY_AFTER_S))])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.controller.release(key_id)
