"""The data-parallel front end: one HTTP server in front of N replicas (``--data-parallel-size``).

Owns what is done once per request rather than once per replica: authentication
(``--api-key``), admission (``--max-num-seqs`` + ``--max-queue-len`` per replica, times the
replicas; ``--per-key-max-concurrency`` across all of them), the body limit, and the choice of
replica. Every route is forwarded as it came (streams stream through), so the replicas'
validation, errors and shapes are the API's. The choice (``--dp-routing``): ``prefix`` hashes
the prompt's leading blocks as the replicas' paged caches do (``core/prefix_router.py``) and
sends it where that prefix went before, else to the least loaded replica.

Failures: a request that could not be delivered (the replica's socket refused it: it died or
is restarting) or that its replica answered 503 before starting (loading, draining) is sent to
another replica, waiting up to ``--dp-retry-timeout`` for one to be ready. A request that
was delivered and then lost its replica gets 502 with the API's error JSON, or, on a stream
already under way, an error event and ``[DONE]``: it may have run, so it is not re-run behind
the client's back. ``/health`` is 200 while at least one replica is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill.core.prefix_router import PrefixAffinityRouter, prompt_block_hashes
from tokenmill.entrypoints.data_parallel.metrics import FrontMetrics, merge_replica_metrics
from tokenmill.entrypoints.data_parallel.route_key import RouteKeys
from tokenmill.entrypoints.data_parallel.supervisor import ReplicaSupervisor
from tokenmill.entrypoints.openai.admission import GENERATION_PATHS
from tokenmill.entrypoints.openai.errors import APIError, error_body_bytes
from tokenmill.entrypoints.openai.state import ServerConfig

logger = logging.getLogger(__name__)

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
        "authorization",  # checked here; replicas have no keys
        "x-api-key",
    }
)
POLL_S = 0.02


def _error(status: int, message: str, code: str | None = None) -> Response:
    return Response(
        error_body_bytes(status, message, code=code),
        status_code=status,
        media_type="application/json",
    )


class ReplicaPool:
    """Which replicas take requests, and the routing policy that picks one."""

    def __init__(
        self,
        num_replicas: int,
        policy: str,
        block_size: int,
        max_blocks_per_replica: int,
        max_load_imbalance: int,
        metrics: FrontMetrics,
    ) -> None:
        self.policy = policy
        self.block_size = block_size
        self.metrics = metrics
        self.router = PrefixAffinityRouter(
            num_replicas, block_size, max_blocks_per_replica, max_load_imbalance
        )
        for i in range(num_replicas):
            self.router.is_alive[i] = False  # ready once its /health says 200
        self._next = 0

    def hashes(self, token_ids: list[int] | None) -> list[bytes]:
        if self.policy != "prefix" or not token_ids:
            return []
        return prompt_block_hashes(token_ids, self.block_size)

    def pick(self, hashes: list[bytes], exclude: frozenset[int]) -> int | None:
        """A ready replica not in ``exclude``, recorded as started; None when there is none."""
        live = self.router.live_replicas(exclude)
        if not live:
            return None
        if self.policy == "round_robin":
            replica = live[self._next % len(live)]
            self._next += 1
            reason = "round_robin"
        else:
            replica, depth = self.router.choose(hashes, exclude)
            reason = "prefix" if depth else "least_loaded"
        self.router.started(replica, hashes)
        self.metrics.routed[(replica, reason)] += 1
        return replica

    async def wait_pick(
        self, hashes: list[bytes], exclude: frozenset[int], deadline: float
    ) -> int | None:
        """``pick``, waiting up to ``deadline`` while no replica is ready (restarting, loading).

        None at once when ready replicas exist but each was excluded (they refused it)."""
        while True:
            replica = self.pick(hashes, exclude)
            if replica is not None or time.monotonic() >= deadline:
                return replica
            if self.router.live_replicas():
                return None
            await asyncio.sleep(POLL_S)


class FrontEnd:
    """The front end's state: pool, supervisor, admission and route keys."""

    def __init__(self, args: argparse.Namespace, config: ServerConfig, block_size: int) -> None:
        from tokenmill.engine.llm_engine import resolve_model_path
        from tokenmill.entrypoints.openai.admission import AdmissionController
        from tokenmill.entrypoints.openai.chat_options import resolve_chat_template
        from tokenmill.tokenizer.tokenizer import Tokenizer

        self.args = args
        self.config = config
        n = args.data_parallel_size
        self.metrics = FrontMetrics()
        self.pool = ReplicaPool(
            n,
            args.dp_routing,
            block_size,
            args.dp_max_blocks_per_replica,
            args.dp_max_load_imbalance,
            self.metrics,
        )
        self.admission = AdmissionController(
            config.max_seqs_in_flight * n,
            config.per_key_max_concurrency,
            config.max_beam_requests_in_flight * n,
        )
        model = args.tokenizer or resolve_model_path(args.model or args.model_flag or "demo")
        self.route_keys = RouteKeys(
            Tokenizer.from_pretrained(model),
            args.dp_route_prefix_chars,
            resolve_chat_template(config.chat_template),
        )
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tokenmill-dp-")
        self.supervisor = ReplicaSupervisor(
            args,
            self._socket_dir.name,
            args.dp_health_interval,
            on_ready=self.pool.router.mark_alive,
            on_down=lambda i: self.pool.router.mark_dead(i, forget=self._has_exited(i)),
        )
        self.retry_timeout_s = args.dp_retry_timeout

    def _has_exited(self, index: int) -> bool:
        process = self.supervisor.replicas[index].process
        return process is None or process.exitcode is not None

    # ---- requests ------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        path = request.url.path
        is_generation = request.method == "POST" and path in GENERATION_PATHS
        ticket = None
        if is_generation:
            try:
                ticket = self.admission.acquire(request.scope.get("state", {}).get("api_key_id"))
            except APIError as refusal:
                return Response(
                    json.dumps(refusal.body()),
                    status_code=refusal.status_code,
                    headers=refusal.headers,
                    media_type="application/json",
                )
        try:
            body = await request.body()
            if len(body) > self.config.max_request_body_bytes:
                return _error(
                    413, f"request body exceeds {self.config.max_request_body_bytes} bytes"
                )
            token_ids = None
            if is_generation and self.pool.policy == "prefix":
                token_ids = await asyncio.to_thread(self.route_keys.token_ids, path, body)
            hashes = self.pool.hashes(token_ids)
            response = await self._send(request, body, hashes)
        except BaseException:
            if ticket is not None:
                self.admission.release(ticket)
            raise
        if ticket is not None:
            if isinstance(response, StreamingResponse):
                response.background = BackgroundTask(self.admission.release, ticket)
            else:
                self.admission.release(ticket)
        return response

    async def _send(self, request: Request, body: bytes, hashes: list[bytes]) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        deadline = time.monotonic() + self.retry_timeout_s
        refused: set[int] = set()
        last_refusal: Response | None = None
        is_retry = False
        while True:
            replica = await self.pool.wait_pick(hashes, frozenset(refused), deadline)
            if replica is None:
                if last_refusal is not None:
                    return last_refusal
                self.metrics.num_no_replica += 1
                return _error(503, "no replica is ready; retry later", code="no_replica_ready")
            if is_retry:
                self.metrics.num_retried += 1
            is_retry = True
            client = self.supervisor.replicas[replica].client
            try:
                upstream = await client.send(
                    client.build_request(request.method, url, headers=headers, content=body),
                    stream=True,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never delivered
                logger.warning("replica %d unreachable (%s); trying another", replica, exc)
                self.pool.router.finished(replica)
                self.supervisor.mark_unreachable(replica)
                continue
            except httpx.TransportError as exc:  # delivered, then the replica went away
                self.pool.router.finished(replica)
                return self._lost(replica, exc)
            if upstream.status_code == 503 and len(refused) + 1 < self.pool.router.num_replicas:
                last_refusal = await self._buffered(replica, upstream)
                refused.add(replica)
                continue
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(
                    self._stream(replica, upstream, request.url.path),
                    status_code=upstream.status_code,
                    headers=_response_headers(upstream, replica),
                )
            return await self._buffered(replica, upstream)

    async def _buffered(self, replica: int, upstream: httpx.Response) -> Response:
        try:
            content = await upstream.aread()
        except httpx.TransportError as exc:
            return self._lost(replica, exc)
        finally:
            self.pool.router.finished(replica)
            await upstream.aclose()
        return Response(
            content,
            status_code=upstream.status_code,
            headers=_response_headers(upstream, replica),
        )

    def _lost(self, replica: int, exc: Exception) -> Response:
        self.metrics.num_failed_in_flight += 1
        logger.error("replica %d failed during a request: %s", replica, exc)
        return _error(
            502,
            f"the replica serving this request failed ({type(exc).__name__}); the request may "
            "have been partly processed; retry it",
            code="replica_failed",
        )

    async def _stream(
        self, replica: int, upstream: httpx.Response, path: str
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            self.metrics.num_failed_in_flight += 1
            logger.error("replica %d failed during a stream: %s", replica, exc)
            message = "the replica serving this stream failed; retry the request"
            if path.endswith("/messages"):  # Anthropic's stream error event
                event = {"type": "error", "error": {"type": "api_error", "message": message}}
                yield f"event: error\ndata: {json.dumps(event)}\n\n".encode()
            else:
                yield b"data: " + error_body_bytes(502, message, code="replica_failed") + b"\n\n"
                yield b"data: [DONE]\n\n"
        finally:  # counted as finished before the replica can see the stream close
            self.pool.router.finished(replica)
            await upstream.aclose()

    # ---- own routes ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if any(r.is_ready for r in self.supervisor.replicas):
            return Response(status_code=200)
        return _error(503, "no replica is ready", code="no_replica_ready")

    async def replicas(self, request: Request) -> Response:
        replicas = self.supervisor.describe()
        for entry in replicas:
            entry["in_flight"] = self.pool.router.load[entry["replica"]]
        return JSONResponse({"replicas": replicas, "routing": self.pool.policy})

    async def metrics_route(self, request: Request) -> Response:
        async def scrape(index: int) -> tuple[int, str | None]:
            replica = self.supervisor.replicas[index]
            if replica.process is None:
                return index, None
            try:
                response = await replica.client.get("/metrics", timeout=5.0)
            except httpx.HTTPError:
                return index, None
            return index, response.text if response.status_code == 200 else None

        results = await asyncio.gather(*(scrape(i) for i in range(len(self.supervisor.replicas))))
        text = merge_replica_metrics({i: t for i, t in results if t is not None})
        text += self.metrics.render(
            [r.is_ready for r in self.supervisor.replicas],
            [r.num_restarts for r in self.supervisor.replicas],
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


REPLICA_HEADER = "x-tokenmill-replica"
"""Response header naming the replica that answered (for logs and debugging)."""


def _response_headers(upstream: httpx.Response, replica: int) -> dict[str, str]:
    headers = {
        k: v
        for k, v in upstream.headers.items()
        if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding"
    }
    headers[REPLICA_HEADER] = str(replica)
    return headers


def build_front_app(front: FrontEnd) -> Starlette:
    from tokenmill.entrypoints.openai.auth import APIKeyAuthMiddleware

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        front.supervisor.start()
        try:
            yield
        finally:
            await front.supervisor.stop(front.config.shutdown_timeout_s + 5.0)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    app = Starlette(
        routes=[
            Route("/health", front.health, methods=["GET", "HEAD"]),
            Route("/metrics", front.metrics_route, methods=["GET"]),
            Route("/dp/replicas", front.replicas, methods=["GET"]),
            Route("/{path:path}", front.forward, methods=methods),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(
        APIKeyAuthMiddleware,
        api_keys=front.config.api_keys,
        open_health_metrics=front.config.disable_auth_for_health_metrics,
    )
    config = front.config
    if config.allowed_origins:  # CORS at the front (replicas are reached by it alone)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_credentials=config.allow_credentials,
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )
    return app


def run_data_parallel(args: argparse.Namespace) -> int:
    """Serve the front end until SIGTERM/SIGINT; the replicas drain and stop with it."""
    from tokenmill.entrypoints.cli import serve_model
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.openai.server import server_config_from_args

    engine_config = engine_config_from_args(args, serve_model(args))
    config = server_config_from_args(args, engine_config)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request
    front = FrontEnd(args, config, engine_config.block_size)
    if not engine_config.enable_prefix_caching and args.dp_routing == "prefix":
        logger.warning("--dp-routing prefix without prefix caching: routing by load only")
        front.pool.policy = "least_loaded"
    app = build_front_app(front)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        uds=config.uds,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        lifespan="on",
        access_log=False,
        log_level=config.uvicorn_log_level,
        server_header=False,
        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
    )
    logger.info(
        "data parallel: %d replicas behind http://%s:%d (routing: %s)",
        args.data_parallel_size,
        config.host,
        config.port,
        front.pool.policy,
    )
    server = uvicorn.Server(uv_config)
    server.run()
    return 0
