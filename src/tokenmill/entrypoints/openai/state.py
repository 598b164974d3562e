"""ServerConfig and ServerState: what every router needs, in one object on ``app.state``.

Owns the server's own settings (separate from EngineConfig, which the offline API shares),
the model-name lookup that answers 404 for unknown models, and the readiness rules the
routes follow: loading or draining is a 503, a dead engine a 500.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineState
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.tokenization import RequestTokenizer
from tokenmill.metrics import ServerMetrics

_SAFE_MODEL_NAME = re.compile(r"[A-Za-z0-9_:@+-][A-Za-z0-9._:@/+-]{0,127}")
"""Names echoed back in a 404; anything path-like is not repeated to the client."""


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of ``tokenmill serve``; flags map 1:1 onto fields."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("demo",)
    """Names clients put in ``model``; the first is reported first by /v1/models."""
    api_keys: tuple[str, ...] = ()
    """Accepted bearer tokens; empty means no authentication."""
    disable_auth_for_health_metrics: bool = False
    """Leave /health and /metrics (GET and HEAD) open even when API keys are set."""
    max_queue_len: int = 1024
    """Sequences admitted beyond the running batch; more get 429 at once."""
    per_key_max_concurrency: int | None = None
    """Most requests one API key may have in flight; None for no quota."""
    request_timeout_s: float = 600.0
    """A request waiting or running longer is aborted (partial output or an error)."""
    max_request_body_bytes: int = 10 * 2**20
    """Larger bodies get 413."""
    max_header_bytes: int = 16 * 2**10
    """Larger request heads get 431 (or 400 from the HTTP parser)."""
    max_header_count: int = 100
    """Requests with more headers get 431."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    trust_request_chat_template: bool = False
    """Let requests pass their own chat template (rendered in the sandbox either way)."""
    max_num_seqs: int = 256
    """The engine's running-batch bound, copied here for admission control."""
    max_concurrent_tokenizations: int = 4
    """Threads tokenizing and rendering chat templates at once; more requests queue for them."""
    chat_template_timeout_s: float = 2.0
    """Time budget of rendering a request-supplied chat template."""

    @property
    def max_seqs_in_flight(self) -> int:
        """Sequences admitted at once: the running batch plus the waiting queue."""
        return self.max_num_seqs + self.max_queue_len


class RunningRequest(Protocol):
    """What the drain needs of a request that is generating: a way to end it now."""

    def cut_off(self) -> None: ...


@dataclass
class ServerState:
    """Shared by every route: settings, the engine, metrics and the draining flag."""

    config: ServerConfig
    engine_config: EngineConfig
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    tokenization: RequestTokenizer
    """Where request text becomes token ids (bounded length, bounded pool)."""
    is_draining: bool = False
    """Set on SIGTERM: new requests get 503 while in-flight ones finish."""
    is_cut_off: bool = False
    """Set when the drain's time is up: running requests end with 503 and no new one starts."""
    active_runs: set[RunningRequest] = field(default_factory=set)
    """Requests generating now (GenerationRuns register themselves), so the drain can end them."""

    def cut_off_running(self) -> int:
        """End every generating request with a 503 (its engine requests are aborted); returns how many."""
        self.is_cut_off = True
        runs = list(self.active_runs)
        for run in runs:
            run.cut_off()
        return len(runs)

    @property
    def default_model(self) -> str:
        return self.config.served_model_names[0]

    def resolve_model(self, name: str | None) -> str:
        """The served name a request addresses; unknown names are a 404."""
        if name is None:
            return self.default_model
        if name in self.config.served_model_names:
            return name
        is_plain = _SAFE_MODEL_NAME.fullmatch(name) and ".." not in name and "//" not in name
        shown = f"`{name}`" if is_plain else "requested"
        raise APIError(404, f"The model {shown} does not exist.", param="model", code="model_not_found")

    def ready_engine(self) -> AsyncLLMEngine:
        """The engine, if it may take a new request now."""
        if self.is_draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
        state = self.engine.state
        if state is EngineState.READY:
            return self.engine
        if state in (EngineState.CREATED, EngineState.LOADING):
            raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
        raise EngineDeadError("engine not running")

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_ready and not self.is_draining


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving this request."""
    return request.app.state.server


_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a client may send as ``X-Request-Id`` (anything else gets a generated id)."""


def new_request_id(prefix: str, client_id: str | None = None) -> str:
    """OpenAI-style ids: ``cmpl-<hex>``, ``chatcmpl-<hex>``; ``cmpl-<client id>`` when the
    client sent a plain ``X-Request-Id`` (as vLLM does), so its logs and ours line up."""
    if client_id and _CLIENT_REQUEST_ID.fullmatch(client_id):
        return f"{prefix}-{client_id}"
    return f"{prefix}-{uuid.uuid4().hex}"
