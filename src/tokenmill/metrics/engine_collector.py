"""Engine-wide gauges and counters, read at scrape time from the latest ``EngineStats``.

Read from the engine thread's published stats when Prometheus scrapes, so they never drift
from the engine; each series vLLM also has is exported again under ``vllm:`` with its
``engine`` label, and vLLM's families with no tokenmill series under ``vllm:`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tokenmill.core.stats import ITERATION_TOKENS_BUCKETS, EngineStats
from tokenmill.metrics.names import PREFIX, VLLM_ENGINE, VLLM_LABELS, VLLM_PREFIX

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


class EngineStatsCollector(Collector):
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
        labels = VLLM_LABELS
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
                "What the engine runs: dtype, quantization, KV cache dtype, compute threads, CPU ISA, "
                "step token budget.",
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
