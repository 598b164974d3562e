"""Operational metrics the alert rules in ``deploy/`` need beyond the engine's figures.

Owns three things on a ServerMetrics registry: HTTP responses counted by status (error and
429 rates; an ASGI middleware outermost, so refusals by auth, header limits and admission
count too), whether the engine is dead (the process exits seconds later, so alerts also
watch Prometheus' own ``up``), and what this start cost: model load, KV allocation and
compile time per decode bucket, labelled ``cache="warm"`` when inductor's compile cache
served the bucket and ``cold`` when it compiled from scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.core.stats import StartupCosts
from tokenmill.metrics.names import PREFIX
from tokenmill.metrics.prometheus import ServerMetrics

KNOWN_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
        "/ping",
        "/load",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    }
)
"""Paths counted under their own label; anything else is ``other`` (bounded cardinality)."""


class _OpsCollector(Collector):
    """Engine-dead flag and start-up costs, read at scrape time."""

    def __init__(
        self,
        model_name: str,
        is_dead: Callable[[], bool],
        read_startup: Callable[[], StartupCosts | None],
    ) -> None:
        self._model_name = model_name
        self._is_dead = is_dead
        self._read_startup = read_startup

    def collect(self) -> Iterator[Metric]:
        name = self._model_name
        dead = GaugeMetricFamily(
            PREFIX + "engine_dead",
            "1 once the engine thread died (the server exits shortly after).",
            labels=["model_name"],
        )
        dead.add_metric([name], 1.0 if self._is_dead() else 0.0)
        yield dead
        costs = self._read_startup()
        if costs is None:  # still loading: no figures yet
            return
        cache = costs.compile_cache

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name", "compile_cache"])
            family.add_metric([name, cache], value)
            return family

        yield gauge(
            "startup_seconds",
            "Engine start-up time, wall clock, by compile cache state.",
            costs.total_s,
        )
        yield gauge(
            "startup_model_load_seconds",
            "Start-up time loading config, tokenizer and weights.",
            costs.model_load_s,
        )
        yield gauge(
            "startup_kv_allocation_seconds",
            "Start-up time sizing and allocating the KV cache.",
            costs.kv_allocation_s,
        )
        per_bucket = GaugeMetricFamily(
            PREFIX + "startup_compile_seconds",
            "Start-up time compiling the decode step for one batch-size bucket (static KV).",
            labels=["model_name", "bucket", "cache"],
        )
        for bucket, seconds in sorted(costs.compile_s_by_bucket.items()):
            state = costs.compile_cache_by_bucket.get(bucket, "unknown")
            per_bucket.add_metric([name, str(bucket), state], seconds)
        yield per_bucket


class ResponseCountMiddleware:
    """Counts every HTTP response by path and status code (``tokenmill:http_responses_total``)."""

    def __init__(self, app: ASGIApp, counter: Counter, model_name: str) -> None:
        self.app = app
        self.counter = counter
        self.model_name = model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            # 499: the client left before an answer started (nginx's code, as the access log).
            self.counter.labels(self.model_name, path, str(status[0] or 499)).inc()


def install_ops_metrics(
    metrics: ServerMetrics,
    is_dead: Callable[[], bool],
    read_startup: Callable[[], StartupCosts | None],
) -> Counter:
    """Register the ops collector on ``metrics``; returns the response counter for the middleware."""
    metrics.registry.register(_OpsCollector(metrics.model_name, is_dead, read_startup))
    return Counter(
        PREFIX + "http_responses",
        "HTTP responses by path and status code (4xx and 5xx included).",
        ["model_name", "path", "status"],
        registry=metrics.registry,
    )
