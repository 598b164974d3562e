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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

from tokenmill.core.stats import EngineStats
from tokenmill.metrics.engine_collector import EngineStatsCollector
from tokenmill.metrics.names import (
    PREFIX,
    REQUEST_LATENCY_BUCKETS_S,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TOKEN_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    VLLM_ENGINE,
    VLLM_LABELS,
    VLLM_PREFIX,
    build_1_2_5_buckets,
)
from tokenmill.metrics.timing import RequestTiming


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
        self.registry.register(EngineStatsCollector(model_name, read_stats))
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
