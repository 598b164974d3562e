"""ServerConfig and ServerState: what every router needs, in one object on ``app.state``.

Owns the server's own settings (separate from EngineConfig, which the offline API shares),
the model-name lookup that answers 404 for unknown models, and the readiness rules the
routes follow: loading or draining is a 503, a dead engine a 500.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from starlette.requests import Request

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineState
from tokenmill.entrypoints.openai.chat_options import ChatOptions
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.lora import LoRARegistry, parse_lora_module
from tokenmill.entrypoints.openai.reasoning import REASONING_PARSERS
from tokenmill.entrypoints.openai.responses_api import ResponseStore
from tokenmill.entrypoints.openai.tokenization import RequestTokenizer
from tokenmill.errors import ConfigError
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics import ServerMetrics

_SAFE_MODEL_NAME = re.compile(r"[A-Za-z0-9_:@+-][A-Za-z0-9._:@/+-]{0,127}")
"""Names echoed back in a 404; anything path-like is not repeated to the client."""


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of ``tokenmill serve``; its flags are generated from these fields."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0: any free port)."""
    served_model_names: tuple[str, ...] = field(
        default=(), metadata={"flag": "--served-model-name"}
    )
    """Model name(s) clients send in 'model', the first reported first by /v1/models; default: the model argument."""
    api_keys: tuple[str, ...] = field(
        default=(), metadata={"flag": "--api-key", "action": "append"}
    )
    """Accepted bearer token; repeat for several (also $TOKENMILL_API_KEY, comma-separated); default: no authentication."""
    disable_auth_for_health_metrics: bool = False
    """Leave /health and /metrics (GET and HEAD) open even when API keys are set."""
    max_queue_len: int = 1024
    """Sequences (prompts x n) admitted beyond --max-num-seqs; more get 429 with Retry-After at once, and a request that alone needs more than both gets 400."""
    per_key_max_concurrency: int | None = None
    """Most requests one API key may have in flight (429 beyond it); default: no quota."""
    share_prefix_cache_across_api_keys: bool = False
    """Let requests under different API keys reuse each other's prefix-cache blocks, for one tenant holding several keys. By default each key's requests are salted by a hash of the key, so no key can tell (by latency or cached_tokens) what another key sent recently."""
    request_timeout_s: float = field(default=600.0, metadata={"flag": "--request-timeout"})
    """Seconds a request may wait plus run; then it is aborted and returns its partial output with finish_reason 'length' (or 503 if it produced nothing)."""
    max_request_body_bytes: int = field(default=10 * 2**20, metadata={"parse": "bytes"})
    """Largest request body, e.g. 10MiB (413 beyond it)."""
    max_header_bytes: int = field(
        default=16 * 2**10,
        metadata={"parse": "bytes", "aliases": ("--h11-max-incomplete-event-size",)},
    )
    """Largest request line plus headers (431 beyond it)."""
    max_header_count: int = field(default=100, metadata={"aliases": ("--h11-max-header-count",)})
    """Most headers a request may have (431 beyond it)."""
    shutdown_timeout_s: float = field(default=30.0, metadata={"flag": "--shutdown-timeout"})
    """On SIGTERM, seconds in-flight requests may take to finish; those still running then get a 503 and the server exits about a second later."""
    trust_request_chat_template: bool = False
    """Let requests supply their own chat template (rendered in the sandbox either way)."""
    chat_template_timeout_s: float = field(
        default=2.0, metadata={"flag": "--chat-template-timeout"}
    )
    """Seconds a request-supplied chat template may take to render (400 beyond it)."""
    max_concurrent_tokenizations: int = field(
        default=4, metadata={"aliases": ("--renderer-num-workers",)}
    )
    """Threads that tokenize prompts and render chat templates; more requests wait for one."""
    grammar_compile_timeout_s: float = field(
        default=10.0, metadata={"flag": "--grammar-compile-timeout"}
    )
    """Seconds a structured-output schema, regex or grammar may take to compile, from when its compile starts (400 beyond it); compiling runs on its own threads, never the engine's."""
    max_concurrent_grammar_compiles: int = 1
    """Structured-output constraints compiled at once (on threads at the lowest CPU priority); more wait for a turn. A large schema is seconds of CPU, and each concurrent compile takes it from the engine's step (8 at once stretched other streams' token gaps to ~0.5 s on 2 cores)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide to call tools (tool_choice 'auto'); needs --tool-call-parser."""
    tool_call_parser: str | None = None
    """How tool calls are read from the model's text: 'hermes' (<tool_call>{...}</tool_call>) or 'llama3_json'."""
    disable_access_log: bool = field(
        default=False, metadata={"aliases": ("--disable-uvicorn-access-log",)}
    )
    """No per-request log line."""
    routes_config: str | None = None
    """YAML file of routes (per API key, model or X-Tokenmill-Route header: context, max_tokens cap, defaults, features, priority, queue bound, quotas; see docs/routes.md); default: no routes."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters clients can name in 'model': name=path, or JSON {"name": .., "path": .., "base_model_name": ..}; needs --enable-lora."""
    allow_runtime_lora_updating: bool = False
    """Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); they need the API key like every route."""
    chat_template: str | None = None
    """The chat template to use instead of the model's: a file, or the template itself."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """How message content reaches the template: 'string' (text parts joined), 'openai' (a list of {type, text} parts) or 'auto' (detected from the template)."""
    default_chat_template_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"parse": "json_object"}
    )
    """A JSON object of chat template variables every request gets (e.g. '{"enable_thinking": false}'); a request's chat_template_kwargs win."""
    response_role: str = "assistant"
    """The role of chat responses when the request sets add_generation_prompt (the default)."""
    return_tokens_as_token_ids: bool = False
    """Default of the request field: name logprob tokens 'token_id:N' instead of their text."""
    reasoning_parser: str | None = None
    """Split the model's <think>...</think> reasoning into message.reasoning_content: 'deepseek_r1' or 'qwen3'."""
    enable_prompt_tokens_details: bool = False
    """Add usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache."""
    enable_force_include_usage: bool = False
    """Send usage on every response, also streams that did not ask for it (stream_options.include_usage)."""
    enable_log_requests: bool = False
    """Log each request's prompt, token ids and sampling parameters when it arrives."""
    enable_log_outputs: bool = False
    """With --enable-log-requests: also log each request's output when it ends."""
    max_log_len: int | None = None
    """Most prompt characters (and prompt token ids) a request log line shows; default: all."""
    disable_log_stats: bool = False
    """No periodic log line of throughput, running/waiting requests and KV cache usage."""
    log_stats_interval_s: float = field(default=10.0, metadata={"flag": "--log-stats-interval"})
    """Seconds between those periodic stats lines (vLLM logs every 10 s)."""
    enable_server_load_tracking: bool = False
    """Count the generation requests in flight in app.state.server_load_metrics (vLLM's /load reads it)."""
    disable_fastapi_docs: bool = False
    """Serve no /docs, /redoc or /openapi.json."""
    root_path: str | None = None
    """The path prefix a proxy serves this app under (ASGI root_path)."""
    allowed_origins: tuple[str, ...] = field(default=(), metadata={"parse": "json_list"})
    """CORS: origins browsers may call from, a JSON list (e.g. '["*"]'); default: no cross-origin calls."""
    allowed_methods: tuple[str, ...] = field(default=("*",), metadata={"parse": "json_list"})
    """CORS: allowed methods, a JSON list."""
    allowed_headers: tuple[str, ...] = field(default=("*",), metadata={"parse": "json_list"})
    """CORS: allowed request headers, a JSON list."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, Authorization) on cross-origin calls."""
    ssl_keyfile: str | None = None
    """TLS private key file; with --ssl-certfile the server speaks HTTPS."""
    ssl_certfile: str | None = None
    """TLS certificate file."""
    ssl_ca_certs: str | None = None
    """CA certificates file, to verify client certificates."""
    ssl_cert_reqs: int = 0
    """Client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)."""
    ssl_ciphers: str | None = None
    """TLS cipher suites (OpenSSL cipher list format)."""
    uds: str | None = None
    """Listen on this Unix domain socket instead of --host/--port."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Log level of uvicorn's own loggers."""
    disable_access_log_for_endpoints: str | None = None
    """Comma-separated paths (e.g. /health,/metrics) with no access-log line."""
    record_trace: str | None = None
    """Append each served completion/chat request's shape (arrival ms, token counts, prefix-block hashes) to this JSONL file, in the Mooncake trace format that `tokenmill tune --workload` replays."""
    record_trace_prompts: bool = False
    """With --record-trace, also write each request's prompt text or messages (off: the trace holds no user content)."""
    max_stored_responses: int = 1000
    """Responses kept in memory per API key for previous_response_id and GET /v1/responses/{id} (least recently used evicted; 0: none kept; a restart forgets them). Each key sees only its own."""
    max_beam_search_queue_len: int = 64
    """Beam search requests admitted beyond --max-beam-search-requests (those running); more get 429. Beam requests hold no place of --max-num-seqs + --max-queue-len, so a flood of them never refuses a standard request."""
    max_num_seqs: int = 256
    """The engine's running-batch bound, copied here for admission control (not a flag)."""
    max_beam_search_requests: int = 4
    """The engine's running beam-search bound, copied here for admission control (not a flag)."""

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, "--port must be in [0, 65535] (0: any free port)"),
            (all(k.strip() for k in self.api_keys), "--api-key must not be empty"),
            (self.max_queue_len >= 0, "--max-queue-len must be >= 0"),
            (self.max_beam_search_queue_len >= 0, "--max-beam-search-queue-len must be >= 0"),
            (
                self.per_key_max_concurrency is None or self.per_key_max_concurrency >= 1,
                "--per-key-max-concurrency must be >= 1",
            ),
            (self.request_timeout_s > 0, "--request-timeout must be > 0"),
            (self.shutdown_timeout_s >= 0, "--shutdown-timeout must be >= 0"),
            (self.max_request_body_bytes >= 1024, "--max-request-body-bytes must be at least 1KiB"),
            (self.max_header_bytes >= 1024, "--max-header-bytes must be at least 1KiB"),
            (self.max_header_count >= 8, "--max-header-count must be at least 8"),
            (self.chat_template_timeout_s > 0, "--chat-template-timeout must be > 0"),
            (self.max_concurrent_tokenizations >= 1, "--max-concurrent-tokenizations must be >= 1"),
            (self.max_stored_responses >= 0, "--max-stored-responses must be >= 0"),
            (self.grammar_compile_timeout_s > 0, "--grammar-compile-timeout must be > 0"),
            (
                self.max_concurrent_grammar_compiles >= 1,
                "--max-concurrent-grammar-compiles must be >= 1",
            ),
            (
                self.tool_call_parser in (None, "hermes", "llama3_json"),
                "--tool-call-parser must be 'hermes' or 'llama3_json'",
            ),
            (
                not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                "--enable-auto-tool-choice needs --tool-call-parser",
            ),
            (
                self.reasoning_parser in (None, *REASONING_PARSERS),
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}",
            ),
            (self.max_log_len is None or self.max_log_len >= 0, "--max-log-len must be >= 0"),
            (self.log_stats_interval_s > 0, "--log-stats-interval must be > 0"),
            (self.ssl_cert_reqs in (0, 1, 2), "--ssl-cert-reqs must be 0, 1 or 2"),
            (
                (self.ssl_keyfile is None) == (self.ssl_certfile is None),
                "--ssl-keyfile and --ssl-certfile go together",
            ),
            (bool(self.response_role.strip()), "--response-role must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        names = [parse_lora_module(m).name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules: a name appears twice in {names}")

    @property
    def max_seqs_in_flight(self) -> int:
        """Sequences admitted at once: the running batch plus the waiting queue."""
        return self.max_num_seqs + self.max_queue_len

    @property
    def max_beam_requests_in_flight(self) -> int:
        """Beam search requests admitted at once: running plus queued, apart from the rest."""
        return self.max_beam_search_requests + self.max_beam_search_queue_len


GRAMMAR_THREAD_NICE = 19
"""Scheduling priority of the compile threads (Linux nice): the engine's step wins the CPU."""


def _lower_thread_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_THREAD_NICE)


def new_grammar_pool(num_workers: int) -> ThreadPoolExecutor:
    """The threads structured-output constraints compile on, at the lowest CPU priority:
    a 155 KB schema takes seconds of CPU, which on a small machine the step needs."""
    return ThreadPoolExecutor(
        num_workers, thread_name_prefix="tokenmill-grammar", initializer=_lower_thread_priority
    )


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
    loras: LoRARegistry = field(default_factory=LoRARegistry)
    """LoRA adapters clients can name in ``model``."""
    chat: ChatOptions = field(default_factory=ChatOptions)
    """The operator's chat template, content format, template variables and response role."""
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    """Request-field defaults from the generation config (``--generation-config``)."""
    grammar_pool: ThreadPoolExecutor = field(init=False)
    """Where structured-output constraints compile: off the event loop and the engine
    thread, ``--max-concurrent-grammar-compiles`` at a time."""
    response_store: ResponseStore = field(init=False)
    """Stored Responses API responses (``--max-stored-responses``)."""

    def __post_init__(self) -> None:
        self.grammar_pool = new_grammar_pool(self.config.max_concurrent_grammar_compiles)
        self.response_store = ResponseStore(self.config.max_stored_responses)

    @property
    def base_model_names(self) -> tuple[str, ...]:
        """Names that mean the base model (served names and the model argument): no adapter
        may take one."""
        return (*self.config.served_model_names, self.engine_config.model)

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
        if name in self.config.served_model_names or name in self.loras:
            return name
        is_plain = _SAFE_MODEL_NAME.fullmatch(name) and ".." not in name and "//" not in name
        shown = f"`{name}`" if is_plain else "requested"
        raise APIError(
            404, f"The model {shown} does not exist.", param="model", code="model_not_found"
        )

    def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a resolved model name runs with; None for the base model."""
        return self.loras.get(model)

    def require_runner(self, runner: str, path: str) -> None:
        """400 when a route needs the other ``--runner`` (generation vs pooling) than this server's."""
        has = "pooling" if self.engine_config.is_pooling else "generate"
        if runner != has:
            raise APIError(
                400,
                f"{path} needs a server started with --runner {runner}; this one runs "
                f"--runner {has}",
                code="unsupported_runner",
            )

    def ready_engine(self) -> AsyncLLMEngine:
        """The engine, if it may take a new request now."""
        if self.is_draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
        state = self.engine.state
        if state is EngineState.READY:
            return self.engine
        if state in (EngineState.CREATED, EngineState.LOADING):
            raise APIError(
                503, "the model is still loading; retry shortly", headers={"Retry-After": "5"}
            )
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
