"""The Ray Serve application (``--data-parallel-backend ray``, ``pip install 'tokenmill[ray]'``).

Two deployments, as Ray's own ``ray.serve.llm`` is built:

- ``TokenmillIngress`` (HTTP): a Starlette app behind the local front end's gates
  (``proxy.add_front_middlewares``: limits, API keys, CORS, Anthropic's errors), then
  admission, once; Ray's own limits on it sit above tokenmill's admission. It reads
  the body and hands the engine deployment a ``RoutedRequest`` whose ``prompt`` or
  ``messages`` attribute is what Ray's ``PrefixCacheAffinityRouter`` matches on (it routes
  by the prompt's text in a prefix tree, falling back to power-of-two choices when loads are
  imbalanced).
- ``TokenmillEngine`` (N replicas, placed, health-checked and restarted by Ray, autoscaled on
  ongoing requests per replica): each replica runs a plain ``tokenmill serve`` process on a
  private unix socket (the same one ``--data-parallel-size`` runs) and streams its answer
  back through the handle. Its constructor returns once that process is ready (Ray routes
  nothing to it before); ``check_health`` fails when the process died or its ``/health`` is
  not 200, so Ray replaces the replica; a request Ray could not deliver is retried by Ray on another one.

``/metrics`` on the ingress: each replica pushes its series to a named registry actor every
``--dp-metrics-push-interval``; the ingress merges them (per replica, with a ``replica`` label, and summed).

Locally, ``tokenmill serve --data-parallel-backend ray --data-parallel-size 2 ...`` starts
Ray (or joins ``RAY_ADDRESS``), deploys the application and serves until Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

REGISTRY_NAME = "tokenmill-metrics-registry"


class ReplicaUnavailable(RuntimeError):
    """The replica's engine process is gone or refused the connection: the request never
    started there, so the ingress may send it to another replica."""


@dataclass
class RoutedRequest:
    """One HTTP request as the ingress hands it to an engine replica."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class PromptRequest(RoutedRequest):
    """Ray's prefix-aware router reads ``prompt`` (it stops at the first of ``messages`` and
    ``prompt`` an argument has, even when None: so each class has exactly one)."""

    prompt: str = ""


@dataclass
class ChatRequest(RoutedRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)


def routed_request(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Any:
    """A ChatRequest (messages) or PromptRequest (prompt text) for a body.

    Ray's router needs one of the two on every request (it raises otherwise), so a request
    without a prompt gets an empty one (routed by load)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        payload = json.loads(body) if body else {}
        if isinstance(payload, dict):
            if isinstance(payload.get("messages"), list):
                messages = [
                    {"role": str(m.get("role", "")), "content": m.get("content") or ""}
                    for m in payload["messages"]
                    if isinstance(m, dict)
                ]
                if payload.get("system"):
                    messages.insert(0, {"role": "system", "content": str(payload["system"])})
                return ChatRequest(method, path, headers, body, messages=messages)
            value = payload.get("prompt", payload.get("input", ""))
            if isinstance(value, list) and value and isinstance(value[0], str):
                value = value[0]
            if isinstance(value, str) and value:
                return PromptRequest(method, path, headers, body, prompt=value)
    # Not empty: Ray's router divides by the text's length.
    return PromptRequest(method, path, headers, body, prompt=path)


def build_application(args: argparse.Namespace) -> Any:
    """The Ray Serve application for these flags (``serve.run`` it, or deploy it)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:  # ray.serve.llm's package needs ray[llm] (pyarrow...); the router does not
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # type: ignore[assignment]
            PrefixCacheAffinityRouter,
        )
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from tokenmill.entrypoints.cli import serve_model
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.openai.server import server_config_from_args

    engine_config = engine_config_from_args(args, serve_model(args))
    config = server_config_from_args(args, engine_config)
    n = args.data_parallel_size
    max_replicas = max(n, getattr(args, "ray_max_replicas", None) or n)
    push_s: float = args.dp_metrics_push_interval
    # What one replica admits (running + queued, plain and beam search); tokenmill's own
    # admission at the ingress refuses beyond it with 429, so Ray's limits sit above it:
    # as many again for the routes that are not generation (models, tokenize, health).
    per_replica = config.max_seqs_in_flight + config.max_beam_requests_in_flight
    ingress_ongoing = 2 * per_replica * max_replicas

    @serve.deployment(
        name="TokenmillEngine",
        num_replicas="auto" if max_replicas > n else n,
        autoscaling_config=(
            AutoscalingConfig(
                min_replicas=n,
                max_replicas=max_replicas,
                target_ongoing_requests=max(1, engine_config.max_num_seqs),
            )
            if max_replicas > n
            else None
        ),
        max_ongoing_requests=2 * per_replica,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={"imbalanced_threshold": args.dp_max_load_imbalance},
        ),
        health_check_period_s=args.dp_health_interval,
        health_check_timeout_s=args.dp_health_timeout,
        graceful_shutdown_timeout_s=config.shutdown_timeout_s + 5.0,
        ray_actor_options={"num_cpus": 0},
    )
    class TokenmillEngine:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray awaits it
            """Start the replica's process and return once it serves: Ray sends no request
            to a replica before its constructor returned."""
            import multiprocessing

            import httpx

            from tokenmill.entrypoints.data_parallel.supervisor import replica_args, run_replica

            self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-ray-")
            self._socket = os.path.join(self._dir.name, "replica.sock")
            child_args = replica_args(args, 0, self._socket)
            child_args.data_parallel_backend = "mp"
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_replica, args=(child_args, 0, os.getpid()), name="tokenmill-replica"
            )
            self._process.start()
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self._socket),
                base_url="http://replica",
                timeout=httpx.Timeout(None, connect=args.dp_health_timeout),
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=max(1, per_replica)
                ),
            )
            self._id = serve.get_replica_context().replica_tag
            await asyncio.wait_for(self._wait_ready(), args.dp_ready_timeout)
            self._push = asyncio.get_running_loop().create_task(self._push_metrics())

        async def _wait_ready(self) -> None:
            import httpx

            while True:
                self._check_process()
                with contextlib.suppress(httpx.HTTPError):
                    if (await self._client.get("/health")).status_code == 200:
                        return
                await asyncio.sleep(0.2)

        def _check_process(self) -> None:
            if self._process.exitcode is not None:  # Ray replaces this replica
                raise ReplicaUnavailable(f"the engine process exited ({self._process.exitcode})")

        async def _push_metrics(self) -> None:
            import ray

            registry = None
            while True:
                await asyncio.sleep(push_s)
                with contextlib.suppress(Exception):
                    registry = registry or ray.get_actor(REGISTRY_NAME, namespace="serve")
                    text = (await self._client.get("/metrics")).text
                    await registry.put.remote(self._id, text)

        async def check_health(self) -> None:
            """Ray's periodic check: the process lives and its ``/health`` says 200."""
            self._check_process()
            response = await self._client.get("/health", timeout=args.dp_health_timeout)
            if response.status_code != 200:
                raise RuntimeError(f"the engine's /health answered {response.status_code}")

        async def forward(self, request: RoutedRequest) -> AsyncIterator[Any]:
            """The replica's answer: first (status, headers), then body chunks."""
            import httpx

            self._check_process()
            try:
                upstream = await self._client.send(
                    self._client.build_request(
                        request.method, request.path, headers=request.headers, content=request.body
                    ),
                    stream=True,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing was sent
                raise ReplicaUnavailable(f"the engine refused the connection ({exc})") from None
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                # The engine closed the connection before its answer's head: it died with
                # the request (a kill, an OOM). Nothing reached the client, so the
                # request may go again elsewhere; a live engine never drops it so.
                raise ReplicaUnavailable(f"the engine dropped the connection ({exc!r})") from None
            try:
                yield (upstream.status_code, list(upstream.headers.items()), self._id)
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        async def __del__(self) -> None:
            import ray

            with contextlib.suppress(Exception):  # its series leave the ingress's /metrics
                await ray.get_actor(REGISTRY_NAME, namespace="serve").remove.remote(self._id)
            with contextlib.suppress(Exception):
                self._process.terminate()
                await asyncio.to_thread(self._process.join, config.shutdown_timeout_s + 2.0)
            with contextlib.suppress(Exception):
                self._process.kill()

    @serve.deployment(
        name="TokenmillIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=ingress_ongoing,
        max_queued_requests=ingress_ongoing,
    )
    @serve.ingress()
    class TokenmillIngress:
        """The HTTP side: the front end's gates (``proxy.add_front_middlewares``: body and
        head limits, API keys, CORS, Anthropic's error shape), admission, then the engine."""

        def __init__(self, engine: Any) -> None:
            from tokenmill.entrypoints.openai.admission import AdmissionController

            self.engine = engine.options(stream=True)
            self.admission = AdmissionController(
                config.max_seqs_in_flight * max_replicas,
                config.per_key_max_concurrency,
                config.max_beam_requests_in_flight * max_replicas,
            )

        def __serve_build_asgi_app__(self) -> Starlette:
            from tokenmill.entrypoints.data_parallel.proxy import add_front_middlewares

            methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
            app = Starlette(
                routes=[
                    Route("/metrics", self.metrics, methods=["GET"]),
                    Route("/{path:path}", self.forward, methods=methods),
                ]
            )
            add_front_middlewares(app, config)
            return app

        async def metrics(self, request: Request) -> Response:
            import ray

            from tokenmill.entrypoints.data_parallel.metrics import merge_replica_metrics

            registry = ray.get_actor(REGISTRY_NAME, namespace="serve")
            texts = await registry.get_all.remote()
            merged = merge_replica_metrics(texts)  # labelled by Ray's replica tag
            return Response(merged, media_type="text/plain; version=0.0.4; charset=utf-8")

        async def forward(self, request: Request) -> Response:
            from tokenmill.entrypoints.data_parallel.proxy import (
                ReleasingResponse,
                refusal_response,
            )
            from tokenmill.entrypoints.openai.admission import GENERATION_PATHS
            from tokenmill.entrypoints.openai.errors import APIError

            if request.method != "POST" or request.url.path not in GENERATION_PATHS:
                return await self._forward(request)
            try:
                ticket = self.admission.acquire(request.scope.get("state", {}).get("api_key_id"))
            except APIError as refusal:
                return refusal_response(refusal)
            try:
                response = await self._forward(request)
            except BaseException:
                self.admission.release(ticket)
                raise
            return ReleasingResponse(response, lambda: self.admission.release(ticket))

        async def _forward(self, request: Request) -> Response:
            from tokenmill.entrypoints.data_parallel.proxy import (
                error_response,
                forwarded_headers,
                response_headers,
                stream_error,
            )

            path = request.url.path
            body = await request.body()  # within the limit: BodyLimitMiddleware refused the rest
            headers = forwarded_headers(
                request.headers.items(), request.scope.get("state", {}).get("api_key_id")
            )
            url = path + (f"?{request.url.query}" if request.url.query else "")
            # A replica whose engine is gone answers ReplicaUnavailable before anything
            # started: the request goes again (Ray's router picks anew; the dead replica
            # fails its health check and is replaced) until --dp-retry-timeout.
            deadline = time.monotonic() + args.dp_retry_timeout
            while True:
                chunks = self.engine.forward.remote(
                    routed_request(request.method, url, headers, body)
                )
                try:  # a non-streaming answer's head comes when it is done
                    status, upstream_headers, replica = await chunks.__anext__()
                except asyncio.CancelledError:  # the client left (Ray's proxy cancels the call)
                    with contextlib.suppress(Exception):
                        chunks.cancel()
                    raise
                except ReplicaUnavailable:
                    if time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
                        continue
                    return error_response(
                        503, "no replica could take the request; retry it", "replica_unavailable"
                    )
                except Exception as exc:
                    return error_response(
                        502,
                        f"the replica failed ({type(exc).__name__}); retry it",
                        "replica_failed",
                    )
                break
            out_headers = response_headers(upstream_headers, str(replica))
            is_stream = out_headers.get("content-type", "").startswith("text/event-stream")

            async def body_chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in chunks:
                        yield chunk
                except Exception:
                    if is_stream:  # else the body is cut short: the client sees it
                        message = "the replica serving this stream failed; retry the request"
                        yield stream_error(path, 502, message, "replica_failed")
                finally:  # the client left: the replica's request is cancelled
                    with contextlib.suppress(Exception):
                        chunks.cancel()

            return StreamingResponse(body_chunks(), status_code=status, headers=out_headers)

    return TokenmillIngress.bind(TokenmillEngine.bind())  # type: ignore[attr-defined]


def _start_registry(push_s: float) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class MetricsRegistry:
        """Each replica's last pushed series, by Ray's replica tag. A replica that Ray
        stops removes its own; one that died is dropped after ``STALE_PUSHES`` silent pushes
        (a missed push or two keeps the last series: sums do not go backwards)."""

        STALE_PUSHES = 30

        def __init__(self) -> None:
            self.texts: dict[str, tuple[float, str]] = {}

        def put(self, replica: str, text: str) -> None:
            self.texts[replica] = (time.time(), text)

        def remove(self, replica: str) -> None:
            self.texts.pop(replica, None)

        def get_all(self) -> dict[str, str]:
            now = time.time()
            self.texts = {
                r: (at, t)
                for r, (at, t) in self.texts.items()
                if now - at < self.STALE_PUSHES * push_s
            }
            return {r: t for r, (_, t) in self.texts.items()}

    MetricsRegistry.options(  # type: ignore[attr-defined]
        name=REGISTRY_NAME, namespace="serve", lifetime="detached", get_if_exists=True
    ).remote()


PROXY_TIMEOUT_VARS = (
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S",
)
"""Ray Serve's HTTP proxy check timeouts (``--ray-proxy-timeout``)."""


def _proxy_timeouts(timeout_s: float) -> dict[str, str]:
    """Ray's proxy timeout variables at ``timeout_s``, except those the user set already."""
    return {name: os.environ.get(name, str(timeout_s)) for name in PROXY_TIMEOUT_VARS}


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join ``RAY_ADDRESS``) Ray, deploy the application, serve until a signal."""
    try:
        import ray
        from ray import serve
    except ImportError:
        from tokenmill.errors import ConfigError

        raise ConfigError(
            "--data-parallel-backend ray needs Ray Serve: pip install 'tokenmill[ray]'"
        ) from None
    from tokenmill.entrypoints.openai.server import server_config_from_args

    # Ray's workers import tokenmill as this process does (a source checkout on PYTHONPATH too),
    # and Serve's controller reads its proxy timeouts from the environment when it starts.
    env_vars = _proxy_timeouts(args.ray_proxy_timeout)
    os.environ.update(env_vars)  # a local cluster started by ray.init inherits them
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env_vars["PYTHONPATH"] = os.pathsep.join(paths)
    ray.init(
        address=os.environ.get("RAY_ADDRESS"),
        include_dashboard=False,
        namespace="serve",
        runtime_env={"env_vars": env_vars},
    )
    from tokenmill.entrypoints.cli import serve_model
    from tokenmill.entrypoints.engine_args import engine_config_from_args

    config = server_config_from_args(args, engine_config_from_args(args, serve_model(args)))
    serve.start(http_options={"host": config.host, "port": config.port})
    _start_registry(args.dp_metrics_push_interval)
    serve.run(build_application(args), name="tokenmill", route_prefix="/")
    logger.info("Ray Serve: tokenmill on http://%s:%d", config.host, config.port)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    serve.delete("tokenmill")
    return 0
