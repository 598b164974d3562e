"""The data-parallel front end: one HTTP server in front of N replicas (``--data-parallel-size``).

Owns what is done once per request rather than once per replica: the single server's
listener (TLS, ``--uds``, head limits) and gates (``proxy.add_front_middlewares``: body
limit, ``--api-key``, CORS, Anthropic's error shape), admission (``--max-num-seqs`` +
``--max-queue-len`` per replica, times the replicas; ``--per-key-max-concurrency`` across
all of them), and the choice of replica. Every route is forwarded as it came (streams
stream through), so the replicas' validation, errors and shapes are the API's; runtime LoRA
loads and unloads go to every replica. The choice (``--dp-routing``): ``prefix`` hashes the
prompt's leading blocks as the replicas' paged caches do (``core/prefix_router.py``) and
sends it where that prefix went before, else to the least loaded replica.

Failures: a request that could not be delivered (the replica's socket refused it: it died or
is restarting) or that its replica answered 503 before starting (loading, draining) is sent to
another replica, waiting up to ``--dp-retry-timeout`` for one to be ready. A request that
was delivered and then lost its replica gets 502 with the API's error JSON, or, on a stream
already under way, an error event and ``[DONE]``: it may have run, so it is not re-run behind
the client's back. A client that leaves closes its upstream (the replica aborts).
``/health`` is 200 while at least one replica is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill.core.prefix_router import PrefixAffinityRouter, prompt_block_hashes
from tokenmill.entrypoints.data_parallel.metrics import FrontMetrics, merge_replica_metrics
from tokenmill.entrypoints.data_parallel.proxy import (
    LORA_PATHS,
    REPLICA_HEADER,
    ReleasingResponse,
    add_front_middlewares,
    error_response,
    forwarded_headers,
    refusal_response,
    response_headers,
    stream_error,
)
from tokenmill.entrypoints.data_parallel.route_key import RouteKeys
from tokenmill.entrypoints.data_parallel.supervisor import Replica, ReplicaSupervisor
from tokenmill.entrypoints.openai.admission import GENERATION_PATHS
from tokenmill.entrypoints.openai.draining import DrainingServer
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.entrypoints.openai.streaming import ClientDisconnected, run_until_disconnected

logger = logging.getLogger(__name__)

POLL_S = 0.02
__all__ = ["REPLICA_HEADER", "FrontEnd", "build_front_app", "run_data_parallel"]


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
        self.ready_epoch = [0] * num_replicas
        """Times each replica became ready: a request that could not connect to a replica
        tries it again only after it became ready anew."""
        self._next = 0

    def mark_ready(self, replica: int) -> None:
        self.ready_epoch[replica] += 1
        self.router.mark_alive(replica)

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
        self, hashes: list[bytes], exclude: Callable[[], frozenset[int]], deadline: float
    ) -> int | None:
        """``pick``, waiting up to ``deadline`` while no replica is ready (restarting, loading).

        None at once when ready replicas exist but each was excluded (they refused it)."""
        while True:
            excluded = exclude()
            replica = self.pick(hashes, excluded)
            if replica is not None or time.monotonic() >= deadline:
                return replica
            if self.router.live_replicas():
                return None
            await asyncio.sleep(POLL_S)


class FrontEnd:
    """The front end's state: pool, supervisor, admission, route keys and runtime LoRAs."""

    def __init__(
        self,
        args: argparse.Namespace,
        config: ServerConfig,
        block_size: int,
        tokenizer_path: str,
    ) -> None:
        from tokenmill.entrypoints.openai.admission import AdmissionController
        from tokenmill.entrypoints.openai.chat_options import resolve_chat_template
        from tokenmill.resolved_model import read_tokenizer

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
        self.route_keys = RouteKeys(
            read_tokenizer(tokenizer_path),
            args.dp_route_prefix_chars,
            resolve_chat_template(config.chat_template),
        )
        self.loras: dict[str, bytes] = {}
        """Runtime-loaded adapters (name -> the load request's body), replayed on a replica
        that restarts before it takes requests."""
        self.is_draining = False
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tokenmill-dp-")
        self.supervisor = ReplicaSupervisor(
            args,
            self._socket_dir.name,
            args.dp_health_interval,
            on_ready=self.pool.mark_ready,
            on_down=lambda i: self.pool.router.mark_dead(i, forget=self._has_exited(i)),
            prepare=self._replay_loras,
            max_connections=config.max_seqs_in_flight,
        )
        self.retry_timeout_s = args.dp_retry_timeout
        self._last_metrics: dict[int, str] = {}

    def _has_exited(self, index: int) -> bool:
        process = self.supervisor.replicas[index].process
        return process is None or process.exitcode is not None

    # ---- requests ------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        path = request.url.path
        if self.is_draining:  # as the single server refuses while it drains
            return error_response(503, "the server is shutting down", headers={"Retry-After": "1"})
        if request.method == "POST" and path in LORA_PATHS:
            return await self._broadcast_lora(request)
        is_generation = request.method == "POST" and path in GENERATION_PATHS
        if not is_generation:
            return await self._forward(request, False)
        try:
            ticket = self.admission.acquire(request.scope.get("state", {}).get("api_key_id"))
        except APIError as refusal:
            return refusal_response(refusal)
        try:
            response = await self._forward(request, True)
        except BaseException:
            self.admission.release(ticket)
            raise
        return ReleasingResponse(response, lambda: self.admission.release(ticket))

    async def _forward(self, request: Request, is_generation: bool) -> Response:
        body = await request.body()  # within the limit: BodyLimitMiddleware refused the rest
        token_ids = None
        if is_generation and self.pool.policy == "prefix":
            token_ids = await asyncio.to_thread(self.route_keys.token_ids, request.url.path, body)
        return await self._send(request, body, self.pool.hashes(token_ids))

    async def _send(self, request: Request, body: bytes, hashes: list[bytes]) -> Response:
        headers = forwarded_headers(
            request.headers.items(), request.scope.get("state", {}).get("api_key_id")
        )
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        deadline = time.monotonic() + self.retry_timeout_s
        refused: set[int] = set()
        unreachable: dict[int, int] = {}  # replica -> its ready epoch when it could not connect
        last_refusal: Response | None = None
        is_retry = False

        def excluded() -> frozenset[int]:
            epochs = self.pool.ready_epoch
            return frozenset(refused | {r for r, e in unreachable.items() if epochs[r] == e})

        while True:
            replica = await self.pool.wait_pick(hashes, excluded, deadline)
            if replica is None:
                if last_refusal is not None:
                    return last_refusal
                self.metrics.num_no_replica += 1
                return error_response(
                    503, "no replica is ready; retry later", code="no_replica_ready"
                )
            if is_retry:
                self.metrics.num_retried += 1
            is_retry = True
            client = self.supervisor.replicas[replica].client
            try:  # a non-streaming answer's head comes when it is done: watch the client
                upstream = await run_until_disconnected(
                    request,
                    client.send(
                        client.build_request(request.method, url, headers=headers, content=body),
                        stream=True,
                    ),
                )
            except ClientDisconnected:  # closing the connection aborts it at the replica
                self.pool.router.finished(replica)
                return Response(status_code=499)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never delivered
                logger.warning("replica %d unreachable (%s); trying another", replica, exc)
                self.pool.router.finished(replica)
                unreachable[replica] = self.pool.ready_epoch[replica]
                self.supervisor.mark_unreachable(replica)
                continue
            except httpx.TransportError as exc:  # delivered, then the replica went away
                self.pool.router.finished(replica)
                return self._lost(replica, exc)
            if upstream.status_code == 503 and len(refused) + 1 < self.pool.router.num_replicas:
                last_refusal = await self._buffered(replica, upstream, request)
                refused.add(replica)
                continue
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(
                    self._stream(replica, upstream, request.url.path),
                    status_code=upstream.status_code,
                    headers=response_headers(upstream.headers.items(), str(replica)),
                )
            return await self._buffered(replica, upstream, request)

    async def _buffered(self, replica: int, upstream: httpx.Response, request: Request) -> Response:
        """The whole answer; if the client leaves first, the upstream connection is closed
        (the replica sees the disconnect and aborts the request)."""
        try:
            content = await run_until_disconnected(request, upstream.aread())
        except ClientDisconnected:
            return Response(status_code=499)
        except httpx.TransportError as exc:
            return self._lost(replica, exc)
        finally:
            self.pool.router.finished(replica)
            await upstream.aclose()
        return Response(
            content,
            status_code=upstream.status_code,
            headers=response_headers(upstream.headers.items(), str(replica)),
        )

    def _lost(self, replica: int, exc: Exception) -> Response:
        self.metrics.num_failed_in_flight += 1
        logger.error("replica %d failed during a request: %s", replica, exc)
        return error_response(
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
            yield stream_error(path, 502, message, "replica_failed")
        finally:  # counted as finished before the replica can see the stream close
            self.pool.router.finished(replica)
            await upstream.aclose()

    # ---- runtime LoRA ----------------------------------------------------------------
    async def _broadcast_lora(self, request: Request) -> Response:
        """Load or unload on every ready replica; the first error if one failed.

        What was loaded is remembered and replayed on a replica that restarts."""
        path = request.url.path
        body = await request.body()
        headers = forwarded_headers(
            request.headers.items(), request.scope.get("state", {}).get("api_key_id")
        )
        ready = [r for r in self.supervisor.replicas if r.is_ready]
        if not ready:
            return error_response(503, "no replica is ready; retry later", code="no_replica_ready")

        async def post(replica: Replica) -> httpx.Response | Response:
            try:
                return await replica.client.post(path, headers=headers, content=body)
            except httpx.TransportError as exc:
                return self._lost(replica.index, exc)

        answers = await asyncio.gather(*(post(r) for r in ready))
        name = None
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            name = json.loads(body).get("lora_name")
        if isinstance(name, str) and any(a.status_code == 200 for a in answers):
            if path.endswith("/load_lora_adapter"):
                self.loras[name] = body
            else:
                self.loras.pop(name, None)
        failed = [(r, a) for r, a in zip(ready, answers, strict=True) if a.status_code != 200]
        replica, answer = failed[0] if failed else (ready[0], answers[0])
        if isinstance(answer, Response):
            return answer
        return Response(
            answer.content,
            status_code=answer.status_code,
            headers=response_headers(answer.headers.items(), str(replica.index)),
        )

    async def _replay_loras(self, replica: Replica) -> bool:
        """Load the runtime adapters on a replica before it takes requests; False if one failed
        (it stays not ready and is tried again at the next check)."""
        for name, body in list(self.loras.items()):
            try:
                answer = await replica.client.post(
                    "/v1/load_lora_adapter",
                    content=body,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                logger.warning("replica %d: reloading LoRA %r failed: %s", replica.index, name, exc)
                return False
            if answer.status_code != 200 and "already been loaded" not in answer.text:
                logger.warning(
                    "replica %d: reloading LoRA %r failed: %s", replica.index, name, answer.text
                )
                return False
        return True

    # ---- own routes ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if any(r.is_ready for r in self.supervisor.replicas):
            return Response(status_code=200)
        if self.is_draining:
            return error_response(503, "the server is shutting down")
        return error_response(503, "no replica is ready", code="no_replica_ready")

    async def replicas(self, request: Request) -> Response:
        replicas = self.supervisor.describe()
        for entry in replicas:
            entry["in_flight"] = self.pool.router.load[entry["replica"]]
        return JSONResponse(
            {
                "replicas": replicas,
                "routing": self.pool.policy,
                "admitted": self.admission.num_requests_in_flight,  # front-end admission
            }
        )

    async def metrics_route(self, request: Request) -> Response:
        async def scrape(index: int) -> None:
            replica = self.supervisor.replicas[index]
            if replica.process is None:
                return
            try:
                response = await replica.client.get("/metrics", timeout=5.0)
            except httpx.HTTPError:
                return
            if response.status_code == 200:
                self._last_metrics[index] = response.text

        # A replica that misses a scrape keeps its last series: sums never go backwards
        # but for a real restart (its first scrape replaces them).
        await asyncio.gather(*(scrape(i) for i in range(len(self.supervisor.replicas))))
        text = merge_replica_metrics(dict(self._last_metrics))
        text += self.metrics.render(
            [r.is_ready for r in self.supervisor.replicas],
            [r.num_restarts for r in self.supervisor.replicas],
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def build_front_app(front: FrontEnd) -> Starlette:
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
    add_front_middlewares(app, front.config)
    return app


class FrontServer(DrainingServer):
    """Drains on SIGTERM as the single server does: the replicas get SIGTERM at once (each
    refuses new requests, lets its own finish for ``--shutdown-timeout``, then ends those
    left with 503, or an error event and ``[DONE]`` on a stream), the front end refuses new
    requests and exits once the replicas' answers have passed through. SIGINT: no wait."""

    def __init__(self, config: uvicorn.Config, front: FrontEnd) -> None:
        super().__init__(config)
        self.front = front

    @property
    def shutdown_timeout_s(self) -> float:
        return self.front.config.shutdown_timeout_s

    async def drain(self, timeout_s: float) -> None:
        front = self.front
        front.is_draining = True
        admission = front.admission
        logger.info(
            "shutting down: draining %d in-flight request(s), up to %.0fs",
            admission.num_requests_in_flight,
            timeout_s,
        )
        front.supervisor.terminate(sigint=timeout_s == 0.0)
        deadline = time.monotonic() + timeout_s + 2.0  # the replicas' cut-off, then its grace
        while admission.num_requests_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        self.should_exit = True


def run_data_parallel(args: argparse.Namespace) -> int:
    """Serve the front end until SIGTERM/SIGINT; the replicas drain and stop with it."""
    from tokenmill.entrypoints.cli import serve_model
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.openai.server import server_config_from_args, uvicorn_config
    from tokenmill.model.source import resolve_model_path

    engine_config = engine_config_from_args(args, serve_model(args))
    config = server_config_from_args(args, engine_config)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request
    tokenizer_path = str(resolve_model_path(engine_config.tokenizer or engine_config.model))
    front = FrontEnd(args, config, engine_config.block_size, tokenizer_path)
    if not engine_config.enable_prefix_caching and args.dp_routing == "prefix":
        logger.warning("--dp-routing prefix without prefix caching: routing by load only")
        front.pool.policy = "least_loaded"
    app = build_front_app(front)
    uv_config = uvicorn_config(app, config, timeout_graceful_shutdown=2)
    logger.info(
        "data parallel: %d replicas behind http://%s:%d (routing: %s)",
        args.data_parallel_size,
        config.host,
        config.port,
        front.pool.policy,
    )
    FrontServer(uv_config, front).run()
    return 0
