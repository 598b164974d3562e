"""ServerMetrics: the Prometheus registry behind ``GET /metrics``.

Names follow vLLM's (``vllm:num_requests_running`` becomes ``tokenmill:num_requests_running``)
so dashboards and ``bench serve`` read either server, and every series carries a
``model_name`` label. Engine-wide gauges and counters are read from the engine thread's
latest published ``EngineStats`` at scrape time, so they never drift from the engine.
Per-request latencies are timed by the HTTP layer on the event loop, from the outputs it
receives (never from objects the engine thread still mutates): inter-token latency per
choice as tokens arrive, everything else once per engine request when it ends. Each instance
owns its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

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

from tokenmill.core.stats import EngineStats

PREFIX = "tokenmill:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so percentiles compare across the two servers.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


@dataclass
class ChoiceTiming:
    """When one choice's first and last tokens reached the server, and how many it has."""

    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if self.first_token_time is None or self.last_token_time is None or self.num_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_tokens - 1)


@dataclass
class RequestTiming:
    """One engine request (one prompt, all its n choices) as the server saw it end."""

    arrival_time: float
    """When the HTTP request arrived (time.monotonic), so tokenization counts."""
    end_time: float
    """Its final output, or when it was aborted or timed out."""
    num_prompt_tokens: int
    finished_reason: str
    """The first choice's reason (stop, length, abort): vLLM counts requests, not choices."""
    choices: list[ChoiceTiming] = field(default_factory=list)
    first_scheduled_time: float | None = None
    """From the engine; None if it was never scheduled."""

    @property
    def first_token_time(self) -> float | None:
        times = [c.first_token_time for c in self.choices if c.first_token_time is not None]
        return min(times) if times else None

    @property
    def last_token_time(self) -> float | None:
        times = [c.last_token_time for c in self.choices if c.last_token_time is not None]
        return max(times) if times else None

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)


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

        yield gauge(
            "num_requests_running", "Number of requests in the running batch.", stats.num_running
        )
        yield gauge(
            "num_requests_waiting", "Number of requests waiting to be scheduled.", stats.num_waiting
        )
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_usage
        )
        yield gauge(
            "compile_time_seconds",
            "Start-up time spent compiling the decode step (static KV).",
            stats.compile_time_s,
        )
        yield gauge(
            "kv_cache_capacity_tokens",
            "Tokens the KV pool holds, allocated at start-up (grows with a smaller --kv-cache-dtype).",
            stats.kv_capacity_tokens,
        )
        if stats.precision:  # vLLM's cache_config_info idea: configuration as labels, value 1
            names = sorted(stats.precision)
            info = GaugeMetricFamily(
                PREFIX + "engine_config_info",
                "What the engine runs: dtype, quantization, KV cache dtype, compute threads, CPU ISA.",
                labels=["model_name", *names],
            )
            info.add_metric([self._model_name, *(stats.precision[n] for n in names)], 1)
            yield info
        yield counter(
            "prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens
        )
        yield counter(
            "generation_tokens", "Number of generated tokens.", stats.num_generation_tokens
        )
        yield counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.num_prefix_query_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.num_prefix_hit_tokens,
        )
        yield from _spec_decode_metrics(stats, self._model_name)


def _spec_decode_metrics(stats: EngineStats, model_name: str) -> Iterator[Metric]:
    """Speculative decoding counters, with vLLM's names (zero without speculation)."""
    for name, doc, value in (
        (
            "spec_decode_num_drafts",
            "Requests that verified draft tokens, per step.",
            stats.spec_num_drafts,
        ),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
        (
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_num_accepted_tokens,
        ),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 first).",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([model_name, str(position)], value)
    yield per_pos


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
            PREFIX + "request_success",
            "Finished requests, by the first choice's finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS_S
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive outputs of one choice.",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per choice.",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS_S
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time waiting before the first schedule.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First schedule to first token.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS_S
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        lora_labels = [*labels, "lora_name"]
        self.lora_requests = Counter(
            PREFIX + "lora_requests",
            "Ended requests (finished, aborted or timed out) per LoRA adapter.",
            lora_labels,
            registry=reg,
        )
        self.lora_prompt_tokens = Counter(
            PREFIX + "lora_prompt_tokens",
            "Prompt tokens of ended requests per LoRA adapter.",
            lora_labels,
            registry=reg,
        )
        self.lora_generation_tokens = Counter(
            PREFIX + "lora_generation_tokens",
            "Generated tokens of ended requests per LoRA adapter.",
            lora_labels,
            registry=reg,
        )

    def observe_inter_token_latency(self, gap_s: float) -> None:
        """Record the gap between two successive token-carrying outputs of one choice."""
        self.itl.labels(self.model_name).observe(gap_s)

    def observe_lora(self, lora_name: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Count one ended engine request that ran with a LoRA adapter."""
        self.lora_requests.labels(self.model_name, lora_name).inc()
        self.lora_prompt_tokens.labels(self.model_name, lora_name).inc(num_prompt_tokens)
        self.lora_generation_tokens.labels(self.model_name, lora_name).inc(num_output_tokens)

    def observe_finished(self, timing: RequestTiming) -> None:
        """Record one ended engine request: counted once, TPOT once per choice."""
        name = self.model_name
        self.request_success.labels(name, timing.finished_reason).inc()
        self.prompt_tokens.labels(name).observe(timing.num_prompt_tokens)
        self.generation_tokens.labels(name).observe(timing.num_output_tokens)
        self.e2e.labels(name).observe(timing.end_time - timing.arrival_time)
        scheduled = timing.first_scheduled_time
        if scheduled is not None:
            self.queue_time.labels(name).observe(scheduled - timing.arrival_time)
        first, last = timing.first_token_time, timing.last_token_time
        if first is not None and last is not None:
            self.ttft.labels(name).observe(first - timing.arrival_time)
            if scheduled is not None:
                self.prefill_time.labels(name).observe(max(0.0, first - scheduled))
            self.decode_time.labels(name).observe(last - first)
        for choice in timing.choices:
            tpot_s = choice.tpot_s
            if tpot_s is not None:
                self.tpot.labels(name).observe(tpot_s)

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
