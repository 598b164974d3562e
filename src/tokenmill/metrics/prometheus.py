"""ServerMetrics: the Prometheus registry behind ``GET /metrics``.

Every series is exported as ``tokenmill:<name>`` with a ``model_name`` label, and each one
vLLM has is exported again as ``vllm:<name>`` with vLLM's labels (``model_name``, ``engine``)
and buckets, so dashboards and alert rules written for vLLM work unchanged; vLLM families
that apply here but had no tokenmill series (``iteration_tokens_total``,
``request_params_n``, ``cache_config_info``...) are exported under ``vllm:`` only. Engine-wide gauges and counters are read from the engine thread's
latest published ``EngineStats`` at scrape time, so they never drift from the engine.
Per-request latencies are timed by the HTTP layer on the event loop, from the outputs it
receives (never from objects the engine thread still mutates): inter-token latency per
choice as tokens arrive, everything else once per engine request when it ends. Each instance
owns its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tokenmill.core.stats import ITERATION_TOKENS_BUCKETS, EngineStats

PREFIX = "tokenmill:"
VLLM_PREFIX = "vllm:"
VLLM_ENGINE = "0"
"""vLLM's ``engine`` label: the data-parallel engine index; one engine here."""
CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50)

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
    n: int = 1
    """The request's ``n`` (vLLM's request_params_n)."""
    max_tokens: int | None = None
    """The request's ``max_tokens`` after clamping (vLLM's request_params_max_tokens)."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache served."""
    num_preemptions: int = 0

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
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


_VLLM_ENGINE_NAMES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens",
        "generation_tokens",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    }
)
"""Engine-wide tokenmill series that vLLM exports under the same name."""


def _as_vllm(family: Metric) -> Metric:
    """The same samples as ``vllm:<name>``, with vLLM's extra ``engine`` label."""
    copy = Metric(VLLM_PREFIX + family.name.removeprefix(PREFIX), family.documentation, family.type)
    for sample in family.samples:
        copy.add_sample(
            VLLM_PREFIX + sample.name.removeprefix(PREFIX),
            {**sample.labels, "engine": VLLM_ENGINE},
            sample.value,
        )
    return copy


class _EngineStatsCollector(Collector):
    """Reads engine-wide figures at scrape time from the latest EngineStats."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        for family in self._tokenmill_families():
            yield family
            if family.name.removeprefix(PREFIX) in _VLLM_ENGINE_NAMES:
                yield _as_vllm(family)
        yield from self._vllm_only_families()

    def _vllm_only_families(self) -> Iterator[Metric]:
        """vLLM's engine families with no tokenmill series of their own."""
        stats = self._read_stats() or EngineStats()
        labels = ["model_name", "engine"]
        values = [self._model_name, VLLM_ENGINE]
        waiting = GaugeMetricFamily(
            VLLM_PREFIX + "num_requests_waiting_by_reason",
            "Number of waiting requests by reason ('capacity': waiting for room; 'deferred': held by a constraint such as the LoRA budget).",
            labels=[*labels, "reason"],
        )
        waiting.add_metric([*values, "capacity"], stats.num_waiting)
        waiting.add_metric([*values, "deferred"], 0)
        yield waiting
        sleep = GaugeMetricFamily(
            VLLM_PREFIX + "engine_sleep_state",
            "Engine sleep state (tokenmill has no sleep mode: always awake).",
            labels=[*labels, "sleep_state"],
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.add_metric([*values, state], value)
        yield sleep
        cached = CounterMetricFamily(
            VLLM_PREFIX + "prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels=labels,
        )
        cached.add_metric(values, stats.num_prefix_hit_tokens)
        yield cached
        by_source = CounterMetricFamily(
            VLLM_PREFIX + "prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*labels, "source"],
        )
        computed = max(0, stats.num_prompt_tokens - stats.num_prefix_hit_tokens)
        for source, value in (
            ("local_compute", computed),
            ("local_cache_hit", stats.num_prefix_hit_tokens),
            ("external_kv_transfer", 0),
        ):
            by_source.add_metric([*values, source], value)
        yield by_source
        iteration = HistogramMetricFamily(
            VLLM_PREFIX + "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=labels,
        )
        cumulative, buckets = 0, []
        for bound, count in zip(
            (*ITERATION_TOKENS_BUCKETS, float("inf")), stats.iteration_token_counts, strict=True
        ):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        iteration.add_metric(values, buckets, stats.iteration_tokens_sum)
        yield iteration
        if stats.cache_config:
            names = sorted(stats.cache_config)
            info = GaugeMetricFamily(
                VLLM_PREFIX + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=[*names, "engine"],
            )
            info.add_metric([*(stats.cache_config[n] for n in names), VLLM_ENGINE], 1)
            yield info

    def _tokenmill_families(self) -> Iterator[Metric]:
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
        yield gauge(
            "kv_cache_resident_bytes",
            "Bytes of the KV pool resident in memory (pages touched at least once; on a CPU the "
            "pool fills lazily up to its size, so RSS grows with it until then).",
            stats.kv_cache_resident_bytes,
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
        if stats.moe_tokens_per_expert:  # mixture-of-experts models only
            routed = CounterMetricFamily(
                PREFIX + "moe_routed_tokens",
                "Tokens routed to each expert of each sparse layer (top-k: k per token).",
                labels=["model_name", "layer", "expert"],
            )
            for layer, counts in enumerate(stats.moe_tokens_per_expert):
                for expert, count in enumerate(counts):
                    routed.add_metric([self._model_name, str(layer), str(expert)], count)
            yield routed

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
        (
            "spec_decode_draft_model_steps",
            "Engine steps in which the draft model ran (0 while the policy keeps it off).",
            stats.spec_num_draft_model_steps,
        ),
        (
            "spec_decode_draft_model_tokens",
            "Tokens the draft model computed: catch-up on unread tokens plus draft inputs.",
            stats.spec_num_draft_model_tokens,
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
    policy = CounterMetricFamily(
        PREFIX + "spec_decode_policy_steps",
        "Engine steps by the draft tokens the batch-size policy allowed per request (0: off).",
        labels=["model_name", "num_speculative_tokens"],
    )
    for k, value in sorted(stats.spec_policy_steps.items()):
        policy.add_metric([model_name, str(k)], value)
    yield policy


VLLM_LABELS = ["model_name", "engine"]


@dataclass(frozen=True)
class _Histograms:
    """One histogram under both names: tokenmill's and vLLM's."""

    tokenmill: Any
    vllm: Any

    def observe(self, value: float) -> None:
        self.tokenmill.observe(value)
        self.vllm.observe(value)


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

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> _Histograms:
            """``tokenmill:<name>`` and vLLM's ``vllm:<name>``, observed together."""
            return _Histograms(
                Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(
                    model_name
                ),
                Histogram(
                    VLLM_PREFIX + name, doc, VLLM_LABELS, buckets=buckets, registry=reg
                ).labels(model_name, VLLM_ENGINE),
            )

        def vllm_histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(
                VLLM_PREFIX + name, doc, VLLM_LABELS, buckets=buckets, registry=reg
            ).labels(model_name, VLLM_ENGINE)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by the first choice's finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.vllm_request_success = Counter(
            VLLM_PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*VLLM_LABELS, "finished_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort", "error"):  # vLLM shows every reason at 0
            self.vllm_request_success.labels(model_name, VLLM_ENGINE, reason)
        self.params_n = vllm_histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = vllm_histogram(
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.max_num_generation_tokens = vllm_histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_num_preemptions = vllm_histogram(
            "request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = vllm_histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        self.inference_time = vllm_histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
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
        self.itl.observe(gap_s)

    def observe_lora(self, lora_name: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Count one ended engine request that ran with a LoRA adapter."""
        self.lora_requests.labels(self.model_name, lora_name).inc()
        self.lora_prompt_tokens.labels(self.model_name, lora_name).inc(num_prompt_tokens)
        self.lora_generation_tokens.labels(self.model_name, lora_name).inc(num_output_tokens)

    def observe_finished(self, timing: RequestTiming) -> None:
        """Record one ended engine request: counted once, TPOT once per choice."""
        name = self.model_name
        self.request_success.labels(name, timing.finished_reason).inc()
        self.vllm_request_success.labels(name, VLLM_ENGINE, timing.finished_reason).inc()
        self.prompt_tokens.observe(timing.num_prompt_tokens)
        self.generation_tokens.observe(timing.num_output_tokens)
        self.e2e.observe(timing.end_time - timing.arrival_time)
        self.params_n.observe(timing.n)
        if timing.max_tokens is not None:
            self.params_max_tokens.observe(timing.max_tokens)
        self.max_num_generation_tokens.observe(
            max((c.num_tokens for c in timing.choices), default=0)
        )
        self.request_num_preemptions.observe(timing.num_preemptions)
        scheduled = timing.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(scheduled - timing.arrival_time)
            self.inference_time.observe(max(0.0, timing.end_time - scheduled))
            self.prefill_kv_computed.observe(
                max(0, timing.num_prompt_tokens - timing.num_cached_tokens)
            )
        first, last = timing.first_token_time, timing.last_token_time
        if first is not None and last is not None:
            self.ttft.observe(first - timing.arrival_time)
            if scheduled is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
            self.decode_time.observe(last - first)
        for choice in timing.choices:
            tpot_s = choice.tpot_s
            if tpot_s is not None:
                self.tpot.observe(tpot_s)

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
