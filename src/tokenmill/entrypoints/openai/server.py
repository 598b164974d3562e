"""``tokenmill serve``: server flags, the FastAPI app, and uvicorn with a graceful SIGTERM.

Owns assembling the server: flags (vLLM's names where vLLM has one) into a ServerConfig,
the middleware order (access log, header limit, API key, routes, admission, then body limit,
so an unauthenticated or excess request costs nothing), the routers, and the process life cycle.
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
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineState
from tokenmill.engine.llm_engine import resolve_model_path
from tokenmill.entrypoints.config_args import add_config_args, config_kwargs
from tokenmill.entrypoints.log_limits import install_log_rate_limit
from tokenmill.entrypoints.openai.admission import AdmissionController, AdmissionMiddleware
from tokenmill.entrypoints.openai.chat_options import ChatOptions, resolve_chat_template
from tokenmill.entrypoints.openai.draining import DrainingServer
from tokenmill.entrypoints.openai.errors import error_body_bytes, install_exception_handlers
from tokenmill.entrypoints.openai.gates import add_gates
from tokenmill.entrypoints.openai.generation_config import load_generation_defaults
from tokenmill.entrypoints.openai.lora import check_lora_name, parse_lora_module
from tokenmill.entrypoints.openai.middleware import (
    AccessLogMiddleware,
)
from tokenmill.entrypoints.openai.openapi import install_openapi
from tokenmill.entrypoints.openai.routers import (
    chat,
    completions,
    embeddings,
    health,
    lora,
    messages,
    models,
    responses,
    sagemaker,
    score,
    tokenize,
)
from tokenmill.entrypoints.openai.routes import RoutesMiddleware, build_route_table
from tokenmill.entrypoints.openai.state import ServerConfig, ServerState
from tokenmill.entrypoints.openai.stats_log import log_stats_periodically
from tokenmill.entrypoints.openai.tokenization import RequestTokenizer
from tokenmill.entrypoints.startup_checks import check_before_serving, warn_if_tools_unrendered
from tokenmill.errors import ConfigError, InvalidRequestError
from tokenmill.metrics import ServerMetrics
from tokenmill.metrics.ops import ResponseCountMiddleware, install_ops_metrics

logger = logging.getLogger(__name__)

API_KEY_ENV_VAR = "TOKENMILL_API_KEY"
DEFAULT_BUCKET_MAX_TOKENS = 2**17
DEAD_ENGINE_GRACE_S = 5.0
"""After the engine dies at runtime: how long /health answers 503 before the process exits."""
CUT_OFF_GRACE_S = 0.5
"""After the drain cuts requests off: how long they get to send their 503 before connections close."""


_NOT_FLAGS = ("max_num_seqs", "max_beam_search_requests")
"""ServerConfig fields copied from the engine's config rather than set by a flag."""


def add_server_args(
    parser: argparse.ArgumentParser, group_for: Callable[[str], Any] | None = None
) -> None:
    """Flags of ``tokenmill serve`` beyond the engine's: one per ServerConfig field."""
    add_config_args(
        parser.add_argument_group("server"), ServerConfig, exclude=_NOT_FLAGS, group_for=group_for
    )
    parser.epilog = (
        "max_tokens beyond the context left after the prompt (--max-model-len minus prompt tokens) "
        "is clamped to it; prompts that leave no room get 400 context_length_exceeded."
    )


def server_config_from_args(args: argparse.Namespace, engine_config: EngineConfig) -> ServerConfig:
    """Map flags (and $TOKENMILL_API_KEY) onto a validated ServerConfig."""
    values = config_kwargs(args, ServerConfig, exclude=_NOT_FLAGS)
    env_keys = os.environ.get(API_KEY_ENV_VAR, "").split(",")
    values["api_keys"] = (*values["api_keys"], *(k.strip() for k in env_keys if k.strip()))
    config = ServerConfig(
        **values,
        max_num_seqs=engine_config.max_num_seqs,
        max_beam_search_requests=engine_config.max_beam_search_requests,
    )
    if config.per_key_max_concurrency is not None and not config.api_keys:
        logger.warning("--per-key-max-concurrency has no effect without --api-key")
    return config


def build_app(engine: AsyncLLMEngine, config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    """The ASGI app; the engine starts loading when the app starts (lifespan)."""
    if not config.served_model_names:  # resolved once: clients use the model argument
        config = dataclasses.replace(config, served_model_names=(engine_config.model,))
    metrics = ServerMetrics(
        config.served_model_names[0],
        engine_config.max_model_len or DEFAULT_BUCKET_MAX_TOKENS,
        lambda: engine.stats,
    )
    tokenization = RequestTokenizer(
        engine,
        config.max_concurrent_tokenizations,
        config.chat_template_timeout_s,
        config.max_request_body_bytes,
    )
    response_counter = install_ops_metrics(
        metrics,
        is_dead=lambda: engine.state is EngineState.DEAD,
        read_startup=lambda: engine.startup_costs,
    )
    state = ServerState(
        config,
        engine_config,
        engine,
        metrics,
        tokenization,
        chat=chat_options(config),
        generation_defaults=load_generation_defaults(
            engine_config.generation_config,
            resolve_model_path(engine_config.model),
            engine_config.override_generation_config,
        ),
    )
    if (
        config.lora_modules or config.allow_runtime_lora_updating
    ) and not engine_config.enable_lora:
        raise ConfigError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    for entry in config.lora_modules:
        adapter = parse_lora_module(entry)
        try:
            check_lora_name(adapter.name, state.base_model_names)
        except InvalidRequestError as exc:
            raise ConfigError(f"--lora-modules: {exc.message}") from None
        state.loras.add(adapter.name, adapter.path, adapter.base_model_name)
    admission = AdmissionController(
        config.max_seqs_in_flight,
        config.per_key_max_concurrency,
        config.max_beam_requests_in_flight,
    )
    routes = build_route_table(config, engine_config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watcher = asyncio.ensure_future(_log_when_ready(state))
        stats_log = (
            None
            if config.disable_log_stats
            else asyncio.ensure_future(log_stats_periodically(state, config.log_stats_interval_s))
        )
        try:
            yield
        finally:
            watcher.cancel()
            if stats_log is not None:
                stats_log.cancel()
            tokenization.shutdown()
            await asyncio.to_thread(engine.shutdown)

    docs = not config.disable_fastapi_docs
    app = FastAPI(
        title="tokenmill",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        root_path=config.root_path or "",
    )
    app.state.server = state
    app.state.server_load_metrics = 0
    app.state.admission = admission
    app.state.routes = routes
    install_exception_handlers(app)
    for module in (
        completions,
        chat,
        responses,
        messages,
        embeddings,
        score,
        models,
        health,
        sagemaker,
        tokenize,
    ):
        app.include_router(module.router)
    if config.allow_runtime_lora_updating:
        app.include_router(lora.router)
    install_openapi(app, config)
    # Added innermost first: the last one added runs first.

    def inside_auth() -> None:
        app.add_middleware(AdmissionMiddleware, state=state, controller=admission)
        if routes is not None:  # before admission: a route's own bounds refuse first
            app.add_middleware(RoutesMiddleware, table=routes)

    add_gates(app, config, inside_auth, track_load=config.enable_server_load_tracking)
    if config.record_trace:
        from tokenmill.entrypoints.openai.trace_record import TraceRecorder, TraceRecordMiddleware

        app.add_middleware(
            TraceRecordMiddleware,
            recorder=TraceRecorder(config.record_trace, config.record_trace_prompts),
        )
    app.add_middleware(
        AccessLogMiddleware,
        skip_paths=frozenset(
            p.strip()
            for p in (config.disable_access_log_for_endpoints or "").split(",")
            if p.strip()
        ),
    )
    app.add_middleware(
        ResponseCountMiddleware, counter=response_counter, model_name=config.served_model_names[0]
    )
    return app


def chat_options(config: ServerConfig) -> ChatOptions:
    """The chat flags, read once: the template file, and template variables checked now."""
    from tokenmill.entrypoints.openai.routers.chat import check_chat_template_kwargs

    if config.default_chat_template_kwargs:
        try:
            check_chat_template_kwargs(config.default_chat_template_kwargs, {})
        except Exception as exc:
            raise ConfigError(f"--default-chat-template-kwargs: {exc}") from None
    return ChatOptions(
        template=resolve_chat_template(config.chat_template),
        content_format=config.chat_template_content_format,
        default_kwargs=config.default_chat_template_kwargs,
        response_role=config.response_role,
    )


async def _log_when_ready(state: ServerState) -> None:
    engine, config = state.engine, state.config
    try:
        await engine.wait_ready()
    except EngineDeadError:
        logger.error("the model failed to load; shutting down")
        return
    await state.tokenization.warm_up()
    logger.info(
        "ready: serving %s on http://%s:%d",
        ", ".join(config.served_model_names),
        config.host,
        config.port,
    )


class _JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed or oversized request heads in OpenAI's shape.

    After the 400 it closes like nginx's lingering close: it half-closes (the client reads the
    answer and then EOF) and reads and drops what the client is still sending, for up to
    ``LINGER_S`` or until the client's EOF (on which the transport closes). Closing at once with unread bytes in the socket sends a TCP reset, which can
    destroy the 400 before the client reads it (a client still writing a 64 KiB head does).
    """

    LINGER_S = 5.0
    _is_lingering = False

    def send_400_response(self, msg: str) -> None:
        import h11

        body = error_body_bytes(
            400, "invalid HTTP request (malformed, or request line and headers too large)"
        )
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._is_lingering = True
        self.transport.write_eof()
        asyncio.get_running_loop().call_later(self.LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._is_lingering:  # the rest of a refused request: read and dropped
            return
        super().data_received(data)


class GracefulServer(DrainingServer):
    """uvicorn.Server that drains on SIGTERM, and exits 1 when the engine failed to load or died."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.state: ServerState = app.state.server
        self.admission: AdmissionController = app.state.admission
        self.exit_code = 0
        self._engine_dead_since: float | None = None
        self.dead_engine_grace_s = DEAD_ENGINE_GRACE_S

    @property
    def shutdown_timeout_s(self) -> float:
        return self.state.config.shutdown_timeout_s

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
            logger.error(
                "the engine died; /health answers 503 and the server exits in %.0fs",
                self.dead_engine_grace_s,
            )
        elapsed = now - self._engine_dead_since
        if elapsed < self.dead_engine_grace_s:
            return False
        return (
            self.admission.num_requests_in_flight == 0
            or elapsed >= self.dead_engine_grace_s + self.state.config.shutdown_timeout_s
        )

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish for ``timeout_s``, then cut off the rest.

        Cut-off requests answer 503 (an error event then ``[DONE]`` on a stream) and are
        aborted in the engine; the server exits once they have answered, within
        ``CUT_OFF_GRACE_S`` more, so the process ends about a second after the timeout.
        """
        state = self.state
        state.is_draining = True
        admission = self.admission
        logger.info(
            "shutting down: draining %d in-flight request(s), up to %.0fs",
            admission.num_requests_in_flight,
            timeout_s,
        )
        loop = asyncio.get_running_loop()
        await _wait_until(lambda: admission.num_requests_in_flight == 0, loop.time() + timeout_s)
        if admission.num_requests_in_flight:
            num_cut = state.cut_off_running()
            logger.warning(
                "shutdown timeout: %d request(s) still in flight are cut off (503)", num_cut
            )
            await _wait_until(
                lambda: admission.num_requests_in_flight == 0, loop.time() + CUT_OFF_GRACE_S
            )
        self.should_exit = True


async def _wait_until(is_done: Callable[[], bool], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not is_done() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def check_lora_modules(config: ServerConfig, engine_config: EngineConfig) -> None:
    """Read every ``--lora-modules`` adapter against the model before serving (LoRAError if one does not fit)."""
    if not config.lora_modules or not engine_config.enable_lora:
        return  # build_app names the missing --enable-lora
    import torch

    from tokenmill.engine.llm_engine import resolve_model_path
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import load_lora_adapter

    model_config = ModelConfig.from_folder(
        resolve_model_path(engine_config.model),
        engine_config.model_impl,
        engine_config.hf_config_path,
    )
    if model_config.model_impl == "transformers":
        from tokenmill.model.transformers_fallback import check_features

        check_features(engine_config.quantization, engine_config.enable_lora)
    for entry in config.lora_modules:
        adapter = parse_lora_module(entry)
        load_lora_adapter(adapter.path, model_config, engine_config.max_lora_rank, torch.float32)


def uvicorn_config(app: Any, config: ServerConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for a tokenmill HTTP server: listening (TCP or ``--uds``), TLS and
    mTLS (``--ssl-*``), the head limits and error shape of ``_JSONErrorH11Protocol``, and the
    accept back-off; the single server and the data-parallel front end both listen so."""
    settings: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        uds=config.uds,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
        ssl_ciphers=config.ssl_ciphers or "TLSv1",  # uvicorn's default
        http=_JSONErrorH11Protocol,
        loop="tokenmill.entrypoints.openai.event_loop:new_event_loop",  # accept() backs off
        lifespan="on",
        access_log=False,
        log_level=config.uvicorn_log_level,
        server_header=False,
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=5,
    )
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the engine failed to load or died."""
    config = server_config_from_args(args, engine_config)
    check_before_serving(engine_config)  # all before listening: a failure is one line, exit 1
    if config.enable_auto_tool_choice:
        warn_if_tools_unrendered(
            engine_config, resolve_chat_template(config.chat_template), config.tool_call_parser
        )
    check_lora_modules(config, engine_config)
    engine = AsyncLLMEngine(engine_config)
    app = build_app(engine, config, engine_config)
    if config.disable_access_log:
        logging.getLogger("tokenmill.access").setLevel(logging.WARNING)
    uv_config = uvicorn_config(
        app,
        config,
        timeout_graceful_shutdown=CUT_OFF_GRACE_S,  # a float works (asyncio timeout)
    )
    install_log_rate_limit("uvicorn", "uvicorn.error")  # repeated errors are summarised
    server = GracefulServer(uv_config, app)
    server.run()
    return server.exit_code
