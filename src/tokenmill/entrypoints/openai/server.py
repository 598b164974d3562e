"""``tokenmill serve``: server flags, the FastAPI app, and uvicorn with a graceful SIGTERM.

Owns assembling the server: flags (vLLM's names where vLLM has one) into a ServerConfig,
the middleware order (access log, header limit, API key, admission, then body limit, so
an unauthenticated or excess request costs nothing), the routers, and the process life cycle.
HTTP is up at once and ``/health`` says 503 while the model loads on the engine thread; if
loading fails the process exits 1. If the engine dies later, ``/health`` says 503 and
in-flight requests get an error for a few seconds, then the process exits 1. On SIGTERM the server drains: ``/health`` and new
requests get 503 while in-flight ones finish (up to ``--shutdown-timeout``); those still running
then are cut off with a 503 (an error event and ``[DONE]`` on a stream) and aborted, and the
process exits 0 about a second after the timeout. Ctrl-C (SIGINT) does the same with no wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineState
from tokenmill.entrypoints.engine_args import parse_memory
from tokenmill.entrypoints.openai.admission import AdmissionController, AdmissionMiddleware
from tokenmill.entrypoints.openai.auth import APIKeyAuthMiddleware
from tokenmill.entrypoints.openai.errors import error_body_bytes, install_exception_handlers
from tokenmill.entrypoints.openai.middleware import (
    AccessLogMiddleware,
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
)
from tokenmill.entrypoints.openai.openapi import install_openapi
from tokenmill.entrypoints.openai.routers import chat, completions, health, models, tokenize
from tokenmill.entrypoints.openai.state import ServerConfig, ServerState
from tokenmill.entrypoints.openai.tokenization import RequestTokenizer
from tokenmill.errors import ConfigError
from tokenmill.metrics import ServerMetrics

logger = logging.getLogger(__name__)

API_KEY_ENV_VAR = "TOKENMILL_API_KEY"
DEFAULT_BUCKET_MAX_TOKENS = 2**17
DEAD_ENGINE_GRACE_S = 5.0
"""After the engine dies at runtime: how long /health answers 503 before the process exits."""
CUT_OFF_GRACE_S = 0.5
"""After the drain cuts requests off: how long they get to send their 503 before connections close."""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill serve`` beyond the engine's."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send in 'model' (default: the model argument)")
    g.add_argument("--api-key", action="append", default=None,
                   help=f"accepted bearer token; repeat for several (also ${API_KEY_ENV_VAR}, comma-separated)")
    g.add_argument("--disable-auth-for-health-metrics", action="store_true",
                   help="leave /health and /metrics (GET and HEAD) open when API keys are set")
    g.add_argument("--max-queue-len", type=int, default=ServerConfig.max_queue_len,
                   help="sequences (prompts x n) admitted beyond --max-num-seqs; more get 429 with "
                        "Retry-After at once, and a request that alone needs more than both gets 400")
    g.add_argument("--per-key-max-concurrency", type=int, default=None,
                   help="most requests one API key may have in flight (429 beyond it)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may wait plus run; then it is aborted and returns its partial "
                        "output with finish_reason 'length' (or 503 if it produced nothing)")
    g.add_argument("--max-request-body-bytes", type=parse_memory, default=10 * 2**20,
                   help="largest request body (413 beyond it), e.g. 10MiB")
    g.add_argument("--max-header-bytes", type=parse_memory, default=16 * 2**10,
                   help="largest request line plus headers (431 beyond it)")
    g.add_argument("--max-header-count", type=int, default=ServerConfig.max_header_count,
                   help="most headers a request may have (431 beyond it; default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish; those still running then "
                        "get a 503 and the server exits about a second later")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests supply their own chat template (still sandboxed)")
    g.add_argument("--chat-template-timeout", type=float, default=ServerConfig.chat_template_timeout_s,
                   help="seconds a request-supplied chat template may take to render (400 beyond it)")
    g.add_argument("--max-concurrent-tokenizations", type=int, default=ServerConfig.max_concurrent_tokenizations,
                   help="threads that tokenize prompts and render chat templates; more requests wait for one")
    g.add_argument("--disable-access-log", action="store_true", help="no per-request log line")
    parser.epilog = (
        "max_tokens beyond the context left after the prompt (--max-model-len minus prompt tokens) "
        "is clamped to it; prompts that leave no room get 400 context_length_exceeded."
    )


def server_config_from_args(args: argparse.Namespace, engine_config: EngineConfig) -> ServerConfig:
    """Map flags (and $TOKENMILL_API_KEY) onto a validated ServerConfig."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV_VAR, "").split(",") if k.strip()]
    if any(not k.strip() for k in keys):
        raise ConfigError("--api-key must not be empty")
    checks = [
        (0 <= args.port <= 65535, "--port must be in [0, 65535] (0: any free port)"),
        (args.max_queue_len >= 0, "--max-queue-len must be >= 0"),
        (args.per_key_max_concurrency is None or args.per_key_max_concurrency >= 1,
         "--per-key-max-concurrency must be >= 1"),
        (args.request_timeout > 0, "--request-timeout must be > 0"),
        (args.shutdown_timeout >= 0, "--shutdown-timeout must be >= 0"),
        (args.max_request_body_bytes >= 1024, "--max-request-body-bytes must be at least 1KiB"),
        (args.max_header_bytes >= 1024, "--max-header-bytes must be at least 1KiB"),
        (args.max_header_count >= 8, "--max-header-count must be at least 8"),
        (args.chat_template_timeout > 0, "--chat-template-timeout must be > 0"),
        (args.max_concurrent_tokenizations >= 1, "--max-concurrent-tokenizations must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if args.per_key_max_concurrency is not None and not keys:
        logger.warning("--per-key-max-concurrency has no effect without --api-key")
    names = tuple(args.served_model_name or [engine_config.model])
    return ServerConfig(
        host=args.host, port=args.port, served_model_names=names, api_keys=tuple(keys),
        disable_auth_for_health_metrics=args.disable_auth_for_health_metrics,
        max_queue_len=args.max_queue_len, per_key_max_concurrency=args.per_key_max_concurrency,
        request_timeout_s=args.request_timeout, max_request_body_bytes=int(args.max_request_body_bytes),
        max_header_bytes=int(args.max_header_bytes), max_header_count=args.max_header_count,
        shutdown_timeout_s=args.shutdown_timeout,
        trust_request_chat_template=args.trust_request_chat_template, max_num_seqs=engine_config.max_num_seqs,
        chat_template_timeout_s=args.chat_template_timeout,
        max_concurrent_tokenizations=args.max_concurrent_tokenizations,
    )


def build_app(engine: AsyncLLMEngine, config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    """The ASGI app; the engine starts loading when the app starts (lifespan)."""
    metrics = ServerMetrics(
        config.served_model_names[0], engine_config.max_model_len or DEFAULT_BUCKET_MAX_TOKENS, lambda: engine.stats
    )
    tokenization = RequestTokenizer(engine, config.max_concurrent_tokenizations, config.chat_template_timeout_s,
                                    config.max_request_body_bytes)
    state = ServerState(config, engine_config, engine, metrics, tokenization)
    admission = AdmissionController(config.max_seqs_in_flight, config.per_key_max_concurrency)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watcher = asyncio.ensure_future(_log_when_ready(state))
        try:
            yield
        finally:
            watcher.cancel()
            tokenization.shutdown()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    app.state.admission = admission
    install_exception_handlers(app)
    for module in (completions, chat, models, health, tokenize):
        app.include_router(module.router)
    install_openapi(app, config)
    # Added innermost first: the last one added runs first.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_request_body_bytes)
    app.add_middleware(AdmissionMiddleware, state=state, controller=admission)
    app.add_middleware(APIKeyAuthMiddleware, api_keys=config.api_keys,
                       open_health_metrics=config.disable_auth_for_health_metrics)
    app.add_middleware(HeaderLimitMiddleware, max_header_bytes=config.max_header_bytes,
                       max_header_count=config.max_header_count)
    app.add_middleware(AccessLogMiddleware)
    return app


async def _log_when_ready(state: ServerState) -> None:
    engine, config = state.engine, state.config
    try:
        await engine.wait_ready()
    except EngineDeadError:
        logger.error("the model failed to load; shutting down")
        return
    await state.tokenization.warm_up()
    logger.info("ready: serving %s on http://%s:%d", ", ".join(config.served_model_names), config.host, config.port)


class _JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed or oversized request heads in OpenAI's shape."""

    def send_400_response(self, msg: str) -> None:
        import h11

        body = error_body_bytes(400, "invalid HTTP request (malformed, or request line and headers too large)")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGTERM, and exits 1 when the engine failed to load or died."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.state: ServerState = app.state.server
        self.admission: AdmissionController = app.state.admission
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_drain_started = False
        self._engine_dead_since: float | None = None
        self.dead_engine_grace_s = DEAD_ENGINE_GRACE_S

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        engine = self.state.engine
        if engine.failed_to_load:
            self.exit_code = 1
            return True
        if engine.state is EngineState.DEAD and self._should_exit_dead():
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    def _should_exit_dead(self) -> bool:
        """After a runtime engine death: True once the grace time passed and in-flight requests ended.

        They fail at once; ``--shutdown-timeout`` bounds the wait for clients slow to read the error.
        """
        now = asyncio.get_running_loop().time()
        if self._engine_dead_since is None:
            self._engine_dead_since = now
            logger.error("the engine died; /health answers 503 and the server exits in %.0fs",
                         self.dead_engine_grace_s)
        elapsed = now - self._engine_dead_since
        if elapsed < self.dead_engine_grace_s:
            return False
        return (self.admission.num_requests_in_flight == 0
                or elapsed >= self.dead_engine_grace_s + self.state.config.shutdown_timeout_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM drains for ``--shutdown-timeout``; SIGINT (Ctrl-C) cuts off at once; a second signal forces."""
        if sig in (signal.SIGTERM, signal.SIGINT) and not self._is_drain_started and self._loop is not None:
            self._is_drain_started = True
            timeout_s = self.state.config.shutdown_timeout_s if sig == signal.SIGTERM else 0.0
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(timeout_s)))
            return
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def _drain(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish for ``timeout_s``, then cut off the rest.

        Cut-off requests answer 503 (an error event then ``[DONE]`` on a stream) and are
        aborted in the engine; the server exits once they have answered, within
        ``CUT_OFF_GRACE_S`` more, so the process ends about a second after the timeout.
        """
        state = self.state
        state.is_draining = True
        admission = self.admission
        logger.info("shutting down: draining %d in-flight request(s), up to %.0fs",
                    admission.num_requests_in_flight, timeout_s)
        loop = asyncio.get_running_loop()
        await _wait_until(lambda: admission.num_requests_in_flight == 0, loop.time() + timeout_s)
        if admission.num_requests_in_flight:
            num_cut = state.cut_off_running()
            logger.warning("shutdown timeout: %d request(s) still in flight are cut off (503)", num_cut)
            await _wait_until(lambda: admission.num_requests_in_flight == 0, loop.time() + CUT_OFF_GRACE_S)
        self.should_exit = True


async def _wait_until(is_done: Callable[[], bool], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not is_done() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the engine failed to load or died."""
    config = server_config_from_args(args, engine_config)
    engine = AsyncLLMEngine(engine_config)
    app = build_app(engine, config, engine_config)
    if args.disable_access_log:
        logging.getLogger("tokenmill.access").setLevel(logging.WARNING)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, http=_JSONErrorH11Protocol, lifespan="on",
        access_log=False, log_level=logging.getLogger().getEffectiveLevel(), server_header=False,
        h11_max_incomplete_event_size=config.max_header_bytes, timeout_keep_alive=5,
        timeout_graceful_shutdown=CUT_OFF_GRACE_S,
    )
    server = GracefulServer(uv_config, app)
    server.run()
    return server.exit_code
