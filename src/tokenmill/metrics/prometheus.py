"""ServerMetrics: the Prometheus registry behind ``GET /metrics``.

Names follow vLLM's (``vllm:num_requests_running`` becomes ``tokenmill:num_requests_running``)
so dashboards and ``bench serve`` read either server, and every series carries a
``model_name`` label. Engine-wide gauges and counters are read from the engine thread's
latest published ``EngineStats`` at scrape time, so they never drift from the engine;
per-request histograms are observed by the HTTP layer when a request finishes. Each
instance owns its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from tokenmill.engine.llm_engine import EngineStats
from tokenmill.outputs import RequestMetrics

PREFIX = "tokenmill:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so percentiles compare across the two servers.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                           5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                             50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _EngineStatsCollector(Collector):
    """Reads engine-wide figures at scrape time from the latest EngineStats."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats() or EngineStats()
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_usage)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens)
        yield counter("generation_tokens", "Number of generated tokens.", stats.num_generation_tokens)
        yield counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.num_prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.num_prefix_hit_tokens)


class ServerMetrics:
    """All server metrics for one served model, in a registry of their own."""

    def __init__(
        self, model_name: str, max_model_len: int, read_stats: Callable[[], EngineStats | None]
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model_name, read_stats))
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished completions, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"], registry=reg,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             TOKEN_LATENCY_BUCKETS_S)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TOKEN_LATENCY_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before the first schedule.",
                                    REQUEST_LATENCY_BUCKETS_S)
        self.prefill_time = histogram("request_prefill_time_seconds", "First schedule to first token.",
                                      REQUEST_LATENCY_BUCKETS_S)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS_S)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.", token_buckets)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per finished request.",
                                           token_buckets)

    def observe_finished(
        self,
        metrics: RequestMetrics,
        num_prompt_tokens: int,
        finish_reasons: Sequence[str | None],
        num_output_tokens: int,
        inter_token_latencies_s: Sequence[float] = (),
    ) -> None:
        """Record one finished engine request (all its n completions)."""
        name = self.model_name
        for reason in finish_reasons:
            self.request_success.labels(name, reason or "abort").inc()
        self.prompt_tokens.labels(name).observe(num_prompt_tokens)
        self.generation_tokens.labels(name).observe(num_output_tokens)
        for gap in inter_token_latencies_s:
            self.itl.labels(name).observe(gap)
        m = metrics
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill_time.labels(name).observe(m.first_token_time - m.first_scheduled_time)
            if m.last_token_time is not None:
                self.decode_time.labels(name).observe(m.last_token_time - m.first_token_time)
                per_request_outputs = max(1, num_output_tokens // max(1, len(finish_reasons)))
                if per_request_outputs > 1:
                    self.tpot.labels(name).observe(
                        (m.last_token_time - m.first_token_time) / (per_request_outputs - 1)
                    )
        if m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
