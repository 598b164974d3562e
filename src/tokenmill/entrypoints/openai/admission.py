"""Admission control: bound the sequences in flight, per server, and the requests per API key.

Owns the decision to take a generation request at all. It is made in two steps, so overload
costs almost nothing: before the body is read, a request is admitted as one sequence (or
refused with 429 and ``Retry-After``); once the body is parsed, the route grows that to the
request's real number of sequences (prompts times ``n``), with 429 if they do not fit now and
400 if they could never fit in ``--max-num-seqs + --max-queue-len``. An API key's
``--per-key-max-concurrency`` counts its HTTP requests, so a few heavy clients cannot take
every slot. A beam search request, once its body says so, gives its place back and holds
one of its own instead (``--max-beam-search-requests`` + ``--max-beam-search-queue-len``):
beam requests never take a standard request's place, so a beam flood cannot make standard
requests get 429 (a beam request holds one standard place only while its body is read).
While the server drains on SIGTERM every new request gets 503.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.middleware import send_error
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.errors import InvalidRequestError

GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)
"""Routes that run the model: admitted (and counted by ``/load``) as one request each."""
RETRY_AFTER_S = 1
TICKET_SCOPE_KEY = "admission_ticket"
"""Where the middleware leaves the request's AdmissionTicket in ``scope["state"]``."""


def _refusal(message: str) -> APIError:
    return APIError(
        429, message, code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


@dataclass
class AdmissionTicket:
    """One admitted HTTP request: its API key and the sequences it holds."""

    key_id: int | None
    num_seqs: int = 1
    num_beam_requests: int = 0
    """Beam searches it holds (one per prompt) in the beam bound, instead of sequences."""


class AdmissionController:
    """Counts admitted sequences and requests, in total and per API key."""

    def __init__(
        self,
        max_seqs_in_flight: int,
        per_key_max: int | None,
        max_beam_requests_in_flight: int | None = None,
    ) -> None:
        self.max_seqs_in_flight = max_seqs_in_flight
        """Sequences admitted at once: the running batch plus the waiting queue."""
        self.max_beam_requests_in_flight = max_beam_requests_in_flight
        """Beam search requests admitted at once (running and queued), apart from the rest;
        None for no bound."""
        self.num_beam_requests_in_flight = 0
        self.per_key_max = per_key_max
        """Most HTTP requests one API key may have in flight; None for no quota."""
        self.num_requests_in_flight = 0
        self.num_seqs_in_flight = 0
        self._per_key: Counter[int] = Counter()

    def acquire(self, key_id: int | None) -> AdmissionTicket:
        """Admit one request as one sequence; raises a 429 APIError saying why not."""
        if self.num_seqs_in_flight >= self.max_seqs_in_flight:
            raise _refusal(
                "the server is at capacity (running batch and waiting queue are full); retry later"
            )
        if (
            key_id is not None
            and self.per_key_max is not None
            and self._per_key[key_id] >= self.per_key_max
        ):
            raise _refusal(
                f"this API key already has {self.per_key_max} requests in flight; retry later"
            )
        self.num_requests_in_flight += 1
        self.num_seqs_in_flight += 1
        if key_id is not None:
            self._per_key[key_id] += 1
        return AdmissionTicket(key_id)

    def grow(
        self, ticket: AdmissionTicket, num_prompts: int, n: int, is_beam: bool = False
    ) -> None:
        """Hold ``num_prompts * n`` sequences for this request: 400 if they never fit, 429 if
        not now. A beam search holds one beam place per prompt instead, and no sequence."""
        if is_beam:
            self._grow_beam(ticket, num_prompts)
            return
        num_seqs = num_prompts * n
        if num_seqs > self.max_seqs_in_flight:
            param = "n" if n > self.max_seqs_in_flight else "prompt"
            raise InvalidRequestError(
                f"this request needs {num_seqs} sequences ({num_prompts} prompt(s) x n={n}), more than the "
                f"{self.max_seqs_in_flight} this server admits at once (--max-num-seqs + --max-queue-len); "
                "split it into smaller requests",
                param=param,
            )
        extra = num_seqs - ticket.num_seqs
        if extra <= 0:
            return
        if self.num_seqs_in_flight + extra > self.max_seqs_in_flight:
            raise _refusal(f"the server has no room for {num_seqs} more sequences now; retry later")
        self.num_seqs_in_flight += extra
        ticket.num_seqs = num_seqs

    def _grow_beam(self, ticket: AdmissionTicket, num_searches: int) -> None:
        limit = self.max_beam_requests_in_flight
        if limit is None:
            limit = num_searches + self.num_beam_requests_in_flight
        if num_searches > limit:
            raise InvalidRequestError(
                f"this request needs {num_searches} beam searches (one per prompt), more than "
                f"the {limit} this server admits at once (--max-beam-search-requests + "
                "--max-beam-search-queue-len); split it into smaller requests",
                param="prompt",
            )
        extra = num_searches - ticket.num_beam_requests
        if self.num_beam_requests_in_flight + extra > limit:
            raise _refusal(
                "the beam search queue is full (--max-beam-search-requests + "
                "--max-beam-search-queue-len); retry later"
            )
        self.num_beam_requests_in_flight += extra
        ticket.num_beam_requests = num_searches
        self.num_seqs_in_flight -= ticket.num_seqs  # its standard place goes back
        ticket.num_seqs = 0

    def release(self, ticket: AdmissionTicket) -> None:
        self.num_requests_in_flight -= 1
        self.num_seqs_in_flight -= ticket.num_seqs
        ticket.num_seqs = 0
        self.num_beam_requests_in_flight -= ticket.num_beam_requests
        ticket.num_beam_requests = 0
        key_id = ticket.key_id
        if key_id is not None:
            self._per_key[key_id] -= 1
            if self._per_key[key_id] <= 0:
                del self._per_key[key_id]


def admit_sequences(request: Request, num_prompts: int, n: int, is_beam: bool = False) -> None:
    """Grow the admission of this HTTP request to its real number of sequences (or beam searches)."""
    ticket = request.scope.get("state", {}).get(TICKET_SCOPE_KEY)
    if ticket is not None:
        controller: AdmissionController = request.app.state.admission
        controller.grow(ticket, num_prompts, n, is_beam)


class AdmissionMiddleware:
    """429 when full, 503 while draining; otherwise holds a ticket until the response ends."""

    def __init__(self, app: ASGIApp, state: ServerState, controller: AdmissionController) -> None:
        self.app = app
        self.state = state
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.is_draining and scope["path"] != "/metrics":
            await send_error(
                send, 503, "the server is shutting down", headers=[("Retry-After", "1")]
            )
            return
        if scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        scope_state = scope.setdefault("state", {})
        try:
            ticket = self.controller.acquire(scope_state.get("api_key_id"))
        except APIError as refusal:
            await send_error(
                send,
                refusal.status_code,
                refusal.message,
                code=refusal.code,
                headers=refusal.headers.items(),
            )
            return
        scope_state[TICKET_SCOPE_KEY] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            self.controller.release(ticket)
