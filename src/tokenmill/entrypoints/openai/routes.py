"""Routes at request time: which route a request is on, and the limits it then runs under.

Owns applying ``--routes-config`` (schema in ``routes_config.py``; operator's guide in
docs/routes.md). A route is selected by the request's API key, else by its
``X-Tokenmill-Route`` header, else by its ``model``; a key bound to a route cannot leave it
with the header. ``RoutesMiddleware`` runs before the server-wide admission: a request
selected by key or header is refused (429) by its route's own bounds before it takes any
server-wide slot, so one route's flood never turns into 429s for another (model-selected
requests are gated once their body is parsed). Then, in order:

- ``route_body``: model selection and the route's default sampling fields;
- ``with_route_priority``: the route's priority;
- ``route_caps``: the route's bounds (context, prompt length, ``max_tokens`` cap, ``max_n``,
  allowed features) as data, which the engine's input processor applies with every other
  bound (``engine/request_limits.py``);
- ``charge_route_input``: the input-tokens-per-minute quota, once the prompts are tokenized;
- the response's end: its generated tokens count against the output quota.

Over a quota is a 429 whose ``Retry-After`` is when enough of the 60-second window has
expired for the request to fit.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter as PromCounter
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.engine.request_limits import RouteCaps
from tokenmill.entrypoints.openai.admission import GENERATION_PATHS
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.middleware import header_value, send_error
from tokenmill.entrypoints.openai.routes_config import (
    QUOTA_WINDOW_S,
    ROUTE_HEADER,
    Route,
    RoutesConfig,
    load_routes,
)
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.errors import ConfigError, InvalidRequestError, ModelLoadError
from tokenmill.metrics import ServerMetrics
from tokenmill.metrics.names import PREFIX
from tokenmill.model.config import ModelConfig
from tokenmill.model.source import resolve_model_path

logger = logging.getLogger(__name__)

TICKET_SCOPE_KEY = "route_ticket"
"""Where a request's RouteTicket lives in ``scope["state"]``."""


class SlidingWindow:
    """Tokens counted over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = QUOTA_WINDOW_S) -> None:
        self.window_s = window_s
        self._entries: deque[tuple[float, int]] = deque()
        self._total = 0

    def used(self, now: float) -> int:
        while self._entries and self._entries[0][0] <= now - self.window_s:
            self._total -= self._entries.popleft()[1]
        return self._total

    def add(self, now: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self._entries.append((now, num_tokens))
            self._total += num_tokens

    def retry_after_s(self, now: float, target: int) -> int:
        """Whole seconds until the tokens counted drop to ``target`` or below (at least 1)."""
        remaining, wait = self.used(now), 0.0
        for when, num_tokens in self._entries:
            if remaining <= target:
                break
            remaining -= num_tokens
            wait = when + self.window_s - now
        return max(1, math.ceil(wait if remaining <= target else self.window_s))


@dataclass
class _RouteState:
    """What one route has admitted and counted."""

    route: Route
    caps: RouteCaps
    """The route's bounds, as the engine applies them."""
    num_seqs_in_flight: int = 0
    requests_per_key: Counter[int | None] = field(default_factory=Counter)
    input_per_key: dict[int | None, SlidingWindow] = field(default_factory=dict)
    output_per_key: dict[int | None, SlidingWindow] = field(default_factory=dict)


@dataclass
class RouteTicket:
    """One admitted request of a route: the sequences and the key's request it holds."""

    state: _RouteState
    key_id: int | None
    num_seqs: int = 1
    is_released: bool = False

    @property
    def route(self) -> Route:
        return self.state.route


class RouteTable:
    """The configured routes, their selectors and their live counts."""

    def __init__(
        self,
        config: RoutesConfig,
        api_keys: tuple[str, ...],
        served_model_names: tuple[str, ...],
        scheduling_policy: str,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        rejections: Any = None,
    ) -> None:
        """Checks the routes against the server (ConfigError naming the route and field)."""
        self.config = config
        self.default_model = served_model_names[0] if served_model_names else None
        self.clock = clock
        self.rejections = rejections
        self._states = {r.name: _RouteState(r, _caps_of(r)) for r in config.routes}
        self._by_key: dict[int, _RouteState] = {}
        self._by_header: dict[str, _RouteState] = {}
        self._by_model: dict[str, _RouteState] = {}
        for i, route in enumerate(config.routes):
            state = self._states[route.name]
            for j, key in enumerate(route.match.api_keys):
                if key not in api_keys:
                    raise ConfigError(
                        f"{config.where('routes', i, 'match', 'api_keys', j)}: {key[:4]}… is not "
                        "an --api-key of this server, so no request can authenticate with it"
                    )
                self._by_key[api_keys.index(key)] = state
            for j, model in enumerate(route.match.models):
                if model not in served_model_names:
                    raise ConfigError(
                        f"{config.where('routes', i, 'match', 'models', j)}: {model!r} is not a "
                        f"served model name (--served-model-name: {', '.join(served_model_names)})"
                    )
                self._by_model[model] = state
            for value in route.match.headers:
                self._by_header[value] = state
            if route.priority not in (None, 0) and scheduling_policy != "priority":
                raise ConfigError(
                    f"{config.where('routes', i, 'priority')}: needs --scheduling-policy priority"
                )
            for name in ("max_model_len", "max_input_tokens"):
                value = getattr(route, name)
                if value is not None and max_model_len is not None and value > max_model_len:
                    raise ConfigError(
                        f"{config.where('routes', i, name)}: {value} is more than "
                        f"the served context ({max_model_len}: --max-model-len, or the model's)"
                    )

    def total_max_in_flight(self) -> int | None:
        """Sequences all routes may hold together; None if any route is unbounded."""
        bounds = [r.max_in_flight for r in self.config.routes]
        return None if any(b is None for b in bounds) else sum(b for b in bounds if b)

    # ---- selection ---------------------------------------------------------------------
    def select_early(self, key_id: int | None, header: str | None) -> _RouteState | None:
        """The route an API key or the route header selects, before the body is read."""
        by_key = self._by_key.get(key_id) if key_id is not None else None
        if header is None:
            return by_key
        by_header = self._by_header.get(header)
        if by_header is None:
            raise InvalidRequestError(f"{ROUTE_HEADER}: no route has this value")
        if by_key is not None and by_key is not by_header:
            raise APIError(
                403,
                f"this API key is bound to route {by_key.route.name!r}; "
                f"{ROUTE_HEADER} may not select another",
                code="route_not_allowed",
            )
        return by_header

    def select_by_model(self, model: Any) -> _RouteState | None:
        name = model if isinstance(model, str) else self.default_model
        return self._by_model.get(name) if name is not None else None

    # ---- admission ---------------------------------------------------------------------
    def _refuse(
        self, state: _RouteState, reason: str, message: str, retry_after_s: int
    ) -> APIError:
        if self.rejections is not None:
            self.rejections.labels(state.route.name, reason).inc()
        return APIError(
            429,
            f"route {state.route.name!r}: {message}",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )

    def acquire(self, state: _RouteState, key_id: int | None) -> RouteTicket:
        """Admit one request as one sequence, or raise a 429 saying which bound it hit."""
        route, now = state.route, self.clock()
        quotas = route.quotas
        if route.max_in_flight is not None and state.num_seqs_in_flight >= route.max_in_flight:
            raise self._refuse(
                state,
                "in_flight",
                f"{route.max_in_flight} sequences already in flight; retry later",
                1,
            )
        limit = quotas.max_concurrent_requests
        if limit is not None and state.requests_per_key[key_id] >= limit:
            raise self._refuse(
                state, "concurrency", f"this API key already has {limit} requests in flight", 1
            )
        for window_of, limit, what in (
            (state.input_per_key, quotas.input_tokens_per_minute, "input"),
            (state.output_per_key, quotas.output_tokens_per_minute, "output"),
        ):
            window = window_of.get(key_id)
            if limit is not None and window is not None and window.used(now) >= limit:
                raise self._refuse(
                    state,
                    f"{what}_tokens",
                    f"this API key used its {limit} {what} tokens per minute",
                    window.retry_after_s(now, limit - 1),
                )
        state.num_seqs_in_flight += 1
        state.requests_per_key[key_id] += 1
        return RouteTicket(state, key_id)

    def grow(self, ticket: RouteTicket, num_prompts: int, n: int) -> None:
        """Hold ``num_prompts * n`` sequences: 400 if more than the route ever admits, else 429."""
        state, route = ticket.state, ticket.route
        num_seqs = num_prompts * n
        bound = route.max_in_flight
        if bound is not None and num_seqs > bound:
            raise InvalidRequestError(
                f"route {route.name!r} admits {bound} sequences at once; this request needs "
                f"{num_seqs} ({num_prompts} prompt(s) x n={n})",
                param="n" if n > bound else "prompt",
            )
        extra = num_seqs - ticket.num_seqs
        if extra <= 0:
            return
        if bound is not None and state.num_seqs_in_flight + extra > bound:
            raise self._refuse(
                state, "in_flight", f"no room for {num_seqs} more sequences now; retry later", 1
            )
        state.num_seqs_in_flight += extra
        ticket.num_seqs = num_seqs

    def charge_input(self, ticket: RouteTicket, num_tokens: int) -> None:
        """Count a request's prompt tokens against its key's input quota (429 or 400 if over)."""
        limit = ticket.route.quotas.input_tokens_per_minute
        if limit is None:
            return
        if num_tokens > limit:
            raise InvalidRequestError(
                f"route {ticket.route.name!r}: the prompt(s) have {num_tokens} tokens, more than "
                f"the {limit} input tokens per minute this API key may send",
                param="prompt",
            )
        now = self.clock()
        window = ticket.state.input_per_key.setdefault(ticket.key_id, SlidingWindow())
        if window.used(now) + num_tokens > limit:
            raise self._refuse(
                ticket.state,
                "input_tokens",
                f"{num_tokens} more prompt tokens would exceed this API key's {limit} input tokens per minute",
                window.retry_after_s(now, limit - num_tokens),
            )
        window.add(now, num_tokens)

    def release(self, ticket: RouteTicket, num_output_tokens: int) -> None:
        """The request ended: free its sequences and count what it generated."""
        if ticket.is_released:
            return
        ticket.is_released = True
        state = ticket.state
        state.num_seqs_in_flight -= ticket.num_seqs
        state.requests_per_key[ticket.key_id] -= 1
        if state.requests_per_key[ticket.key_id] <= 0:
            del state.requests_per_key[ticket.key_id]
        if state.route.quotas.output_tokens_per_minute is not None:
            window = state.output_per_key.setdefault(ticket.key_id, SlidingWindow())
            window.add(self.clock(), num_output_tokens)


# ---- hooks the generation routes call ---------------------------------------------------------
def _table(request: Request) -> RouteTable | None:
    return getattr(request.app.state, "routes", None)


def route_ticket(request: Request) -> RouteTicket | None:
    """The request's route ticket, if it is on a route."""
    return request.scope.get("state", {}).get(TICKET_SCOPE_KEY)


def route_queue(request: Request) -> str:
    """The engine queue the request's route sends it to: ``standard`` or ``beam``."""
    ticket = route_ticket(request)
    return ticket.route.queue if ticket is not None else "standard"


def route_body(request: Request, data: dict[str, Any]) -> dict[str, Any]:
    """Select a route by model if none was selected yet; fill in the route's defaults."""
    table = _table(request)
    if table is None:
        return data
    ticket = route_ticket(request)
    if ticket is None:
        state = table.select_by_model(data.get("model"))
        if state is None:
            return data
        ticket = table.acquire(state, request.scope.get("state", {}).get("api_key_id"))
        request.scope.setdefault("state", {})[TICKET_SCOPE_KEY] = ticket
    defaults = ticket.route.defaults.as_body_fields()
    if ticket.route.queue == "beam":  # the route's requests are beam searches, in that queue
        defaults.setdefault("use_beam_search", True)
    return {**defaults, **data}


def route_caps(request: Request) -> RouteCaps | None:
    """The bounds of the request's route, as data for the engine, which applies them
    (``engine/request_limits.py``); None off any route."""
    ticket = route_ticket(request)
    return ticket.state.caps if ticket is not None else None


def with_route_priority(request: Request, body: Any) -> Any:
    """The body with the route's priority, if it sets one."""
    ticket = route_ticket(request)
    if ticket is None or ticket.route.priority is None:
        return body
    return body.model_copy(update={"priority": ticket.route.priority})


def grow_route(request: Request, num_prompts: int, n: int) -> None:
    """Grow the route's hold to the request's real number of sequences."""
    ticket, table = route_ticket(request), _table(request)
    if ticket is not None and table is not None:
        table.grow(ticket, num_prompts, n)


def charge_route_input(request: Request, prompts: list[ProcessedRequest]) -> None:
    """Charge the prompts' tokens against the route's input quota."""
    ticket, table = route_ticket(request), _table(request)
    if ticket is not None and table is not None:
        table.charge_input(ticket, sum(len(p.prompt_token_ids) for p in prompts))


class RoutesMiddleware:
    """Selects a route by API key or header before server-wide admission; releases it at the end."""

    def __init__(self, app: ASGIApp, table: RouteTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        scope_state = scope.setdefault("state", {})
        headers = header_value(scope, ROUTE_HEADER.encode())
        try:
            if len(headers) > 1:  # else a client's header could win over a gateway's
                raise InvalidRequestError(
                    f"{ROUTE_HEADER} was sent {len(headers)} times; send it once"
                )
            route_state = self.table.select_early(
                scope_state.get("api_key_id"),
                headers[0].decode("latin-1").strip() if headers else None,
            )
            if route_state is not None:
                scope_state[TICKET_SCOPE_KEY] = self.table.acquire(
                    route_state, scope_state.get("api_key_id")
                )
        except (APIError, InvalidRequestError) as exc:
            status = exc.status_code if isinstance(exc, APIError) else 400
            code = exc.code if isinstance(exc, APIError) else None
            extra = exc.headers.items() if isinstance(exc, APIError) else ()
            await send_error(send, status, exc.message, code=code, headers=extra)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            ticket = scope_state.get(TICKET_SCOPE_KEY)
            if ticket is not None:
                generated = (scope_state.get("generation") or {}).get("completion_tokens") or 0
                self.table.release(ticket, int(generated))


def build_route_table(
    config: ServerConfig, engine_config: EngineConfig, metrics: ServerMetrics
) -> RouteTable | None:
    """The server's routes from ``--routes-config`` (None without one); ConfigError if invalid.

    Without ``--max-model-len`` the model's own context (its ``config.json``) bounds the
    routes' contexts. Warns when the routes' own bounds add up to more than the server admits: then a flooded
    route can still fill the server-wide queue and others get 429s from it.
    """
    if config.routes_config is None:
        return None
    rejections = PromCounter(
        PREFIX + "route_rejections",
        "Requests a route refused with 429, by route and bound (in_flight, concurrency, input_tokens, output_tokens).",
        ["model_name", "route", "reason"],
        registry=metrics.registry,
    )
    routes = load_routes(config.routes_config)
    max_model_len = engine_config.max_model_len or _model_context_len(engine_config)
    table = RouteTable(
        routes,
        config.api_keys,
        config.served_model_names,
        engine_config.scheduling_policy,
        max_model_len,
        rejections=_LabelledCounter(rejections, metrics.model_name),
    )
    total = table.total_max_in_flight()
    if total is None or total > config.max_seqs_in_flight:
        logger.warning(
            "routes: their max_in_flight bounds add up to %s sequences but the server admits %d "
            "(--max-num-seqs + --max-queue-len): a flooded route can make others wait for "
            "server-wide room (429)",
            "no bound" if total is None else total,
            config.max_seqs_in_flight,
        )
    logger.info("routes: %s", ", ".join(r.name for r in table.config.routes))
    return table


def _model_context_len(engine_config: EngineConfig) -> int | None:
    """The model's context length from its config.json; None if unreadable (the engine says why)."""
    try:
        config = ModelConfig.from_folder(
            resolve_model_path(engine_config.model), "native", engine_config.hf_config_path
        )
    except (ModelLoadError, ConfigError):
        return None
    return config.max_position_embeddings


def _caps_of(route: Route) -> RouteCaps:
    return RouteCaps(
        name=route.name,
        max_model_len=route.max_model_len,
        max_input_tokens=route.max_input_tokens,
        max_tokens=route.max_tokens,
        max_n=route.features.max_n,
        allow_logprobs=route.features.logprobs,
        allow_beam_search=route.features.beam_search,
    )


class _LabelledCounter:
    """A route-rejection counter with the model name filled in."""

    def __init__(self, counter: PromCounter, model_name: str) -> None:
        self._counter = counter
        self._model_name = model_name

    def labels(self, route: str, reason: str) -> Any:
        return self._counter.labels(self._model_name, route, reason)
