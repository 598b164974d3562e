"""Server-side figures read from a target's Prometheus ``/metrics`` during a benchmark.

Client timings say how fast; the server's own gauges say why: how full the KV cache got,
how often requests were preempted, how much memory the process held. The scraper reads
``/metrics`` before, periodically during, and after the run, keeping peaks of gauges and
deltas of counters. tokenmill's names (``tokenmill:``) and vLLM's (``vllm:``) are both
understood; a target without ``/metrics`` simply yields ``{"available": False}``.

Every scrape costs the target CPU time while it serves: rendering its exposition (~9 ms for
tokenmill's 560 samples with prometheus_client, under the GIL), and parsing costs the
client ~8 ms. Polled every 0.5 s on a 2-core machine, that raised tokenmill's one-stream
TPOT by 1.5 ms (12%; llama.cpp, without ``/metrics``, paid nothing), so the default
interval is ``DEFAULT_INTERVAL_S``: counter deltas are exact whatever the interval, and
gauge peaks are sampled less often.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench import MissingExtraError
from tokenmill.bench.server_clock import server_clock_figures

try:
    import httpx
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("httpx") from exc

# Each figure lists the metric names that carry it, first match wins.
KV_USAGE_NAMES: tuple[str, ...] = (
    "tokenmill:kv_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
PREEMPTION_NAMES: tuple[str, ...] = (
    "tokenmill:num_preemptions_total",
    "vllm:num_preemptions_total",
    "vllm:num_preemptions",
)
RUNNING_NAMES: tuple[str, ...] = ("tokenmill:num_requests_running", "vllm:num_requests_running")
WAITING_NAMES: tuple[str, ...] = ("tokenmill:num_requests_waiting", "vllm:num_requests_waiting")
PREFIX_QUERY_NAMES: tuple[str, ...] = (
    "tokenmill:prefix_cache_queries_total",
    "vllm:prefix_cache_queries_total",
)
PREFIX_HIT_NAMES: tuple[str, ...] = (
    "tokenmill:prefix_cache_hits_total",
    "vllm:prefix_cache_hits_total",
)
RSS_NAMES: tuple[str, ...] = ("process_resident_memory_bytes",)
SPEC_DRAFTS_NAMES: tuple[str, ...] = (
    "tokenmill:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_drafts_total",
)
SPEC_DRAFT_TOKENS_NAMES: tuple[str, ...] = (
    "tokenmill:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
)
SPEC_ACCEPTED_NAMES: tuple[str, ...] = (
    "tokenmill:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


DEFAULT_INTERVAL_S = 5.0
"""Seconds between polls during a run (see the module docstring for why not less)."""


def parse_prometheus_text(text: str) -> dict[str, list[float]]:
    """Sample values per metric name from the Prometheus text format, labels dropped.

    Handles label values containing spaces or braces, and skips comments and lines that
    are not samples. Several label sets of one name give several values.
    """
    samples: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            rest = _after_labels(line, brace)
            if rest is None:
                continue
        else:
            if space == -1:
                continue
            name, rest = line[:space], line[space:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        samples.setdefault(name, []).append(value)
    return samples


def sum_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` ('' for samples without it).

    For the data-parallel front end's ``/metrics``, whose series carry a ``replica`` label
    and whose aggregate has none: ``sum_by_label(text, name, "replica")``.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _after_labels(line: str, brace: int) -> str | None:
    """The text after the closing brace of a label set, honouring quoted values."""
    in_quotes = False
    i = brace + 1
    while i < len(line):
        ch = line[i]
        if ch == "\\" and in_quotes:
            i += 2
            continue
        if ch == '"':
            in_quotes = not in_quotes
        elif ch == "}" and not in_quotes:
            return line[i + 1 :]
        i += 1
    return None


def read_engine_config(text: str) -> dict[str, str]:
    """The labels of ``tokenmill:engine_config_info`` (dtype, quantization, KV cache dtype,
    threads), so a result file says what the server ran; empty for other servers."""
    for line in text.splitlines():
        if line.startswith("tokenmill:engine_config_info{"):
            body = line[line.index("{") + 1 : line.rindex("}")]
            return {
                key: value.strip('"')
                for key, value in (pair.split("=", 1) for pair in re.findall(r'\w+="[^"]*"', body))
                if key != "model_name"
            }
    return {}


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_STARTUP_FIGURES = {
    "tokenmill:startup_seconds": "startup_s",
    "tokenmill:startup_model_load_seconds": "model_load_s",
    "tokenmill:startup_kv_allocation_seconds": "kv_allocation_s",
}


def read_startup_costs(text: str) -> dict[str, Any] | None:
    """tokenmill's start-up costs from one scrape (None for servers without them).

    ``compile_cache`` is ``warm`` when inductor's cache served every decode bucket, so a
    warm restart is reported apart from a cold one; ``compile_s_by_bucket`` per bucket.
    """
    costs: dict[str, Any] = {}
    by_bucket: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("tokenmill:startup_") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels = dict(_LABEL.findall(rest.rsplit("}", 1)[0]))
        try:
            value = float(rest.rsplit("}", 1)[1].split()[0])
        except (IndexError, ValueError):
            continue
        if name in _STARTUP_FIGURES:
            costs[_STARTUP_FIGURES[name]] = value
            costs["compile_cache"] = labels.get("compile_cache")
        elif name == "tokenmill:startup_compile_seconds":
            by_bucket[labels.get("bucket", "?")] = value
    if not costs:
        return None
    costs["compile_s"] = sum(by_bucket.values())
    costs["compile_s_by_bucket"] = by_bucket
    return costs


def _first(samples: dict[str, list[float]], names: tuple[str, ...], combine: str) -> float | None:
    for name in names:
        values = [v for v in samples.get(name, []) if math.isfinite(v)]
        if values:
            return max(values) if combine == "max" else sum(values)
    return None


def read_figures(samples: dict[str, list[float]]) -> dict[str, float | None]:
    """The figures the bench reports, from one scrape: gauges by max, counters by sum."""
    return {
        "kv_cache_usage": _first(samples, KV_USAGE_NAMES, "max"),
        "num_preemptions": _first(samples, PREEMPTION_NAMES, "sum"),
        "num_requests_running": _first(samples, RUNNING_NAMES, "max"),
        "num_requests_waiting": _first(samples, WAITING_NAMES, "max"),
        "prefix_cache_queries": _first(samples, PREFIX_QUERY_NAMES, "sum"),
        "prefix_cache_hits": _first(samples, PREFIX_HIT_NAMES, "sum"),
        "resident_memory_bytes": _first(samples, RSS_NAMES, "sum"),
        "spec_num_drafts": _first(samples, SPEC_DRAFTS_NAMES, "sum"),
        "spec_num_draft_tokens": _first(samples, SPEC_DRAFT_TOKENS_NAMES, "sum"),
        "spec_num_accepted_tokens": _first(samples, SPEC_ACCEPTED_NAMES, "sum"),
    }


def spec_decode_figures(
    before: dict[str, float | None], after: dict[str, float | None]
) -> dict[str, float | None]:
    """Speculative decoding over the run: acceptance rate (accepted / drafted tokens) and
    mean accepted length (tokens a verifying step yields: 1 + accepted / drafts, as vLLM's)."""

    def delta(name: str) -> float | None:
        return _delta(after.get(name), before.get(name))

    drafts, drafted, accepted = (
        delta("spec_num_drafts"),
        delta("spec_num_draft_tokens"),
        delta("spec_num_accepted_tokens"),
    )
    rate = mean_length = None
    if accepted is not None and drafted:
        rate = accepted / drafted
    if accepted is not None and drafts:
        mean_length = 1.0 + accepted / drafts
    return {
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": rate,
        "spec_mean_accepted_length": mean_length,
    }


def _delta(after: float | None, before: float | None) -> float | None:
    if after is None:
        return None
    return after - (before or 0.0)


@dataclass
class MetricsScraper:
    """Polls ``metrics_url`` while a benchmark runs and keeps peaks and counter deltas."""

    client: httpx.AsyncClient
    metrics_url: str
    interval_s: float = DEFAULT_INTERVAL_S
    headers: dict[str, str] = field(default_factory=dict)
    """Sent with every scrape: a server started with an API key guards ``/metrics`` too."""
    is_available: bool = False
    num_scrapes: int = 0
    before: dict[str, float | None] = field(default_factory=dict)
    after: dict[str, float | None] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    engine_config: dict[str, str] = field(default_factory=dict)
    """What a tokenmill target runs (``read_engine_config``)."""
    startup: dict[str, Any] | None = None
    """The target's start-up costs, from the first scrape that has them."""
    first_text: str | None = None
    """The first scrape's exposition (histograms are read as deltas from it)."""
    last_text: str | None = None
    """The latest scrape's exposition."""
    _task: asyncio.Task[None] | None = None

    async def scrape(self) -> dict[str, float | None] | None:
        """One scrape; None when the target has no usable ``/metrics``."""
        try:
            response = await self.client.get(self.metrics_url, headers=self.headers)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        figures = read_figures(parse_prometheus_text(response.text))
        self.first_text = self.first_text or response.text
        self.last_text = response.text
        self.engine_config = self.engine_config or read_engine_config(response.text)
        if self.startup is None:
            self.startup = read_startup_costs(response.text)
        self.num_scrapes += 1
        for name, value in figures.items():
            if value is not None:
                self.peaks[name] = max(self.peaks.get(name, value), value)
        return figures

    async def start(self) -> None:
        """Take the 'before' scrape and, if it worked, start polling for peaks."""
        figures = await self.scrape()
        self.is_available = figures is not None and any(v is not None for v in figures.values())
        if not self.is_available:
            return
        self.before = figures or {}
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def stop(self) -> None:
        """Stop polling and take the 'after' scrape."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.is_available:
            self.after = await self.scrape() or {}

    def report(self) -> dict[str, Any]:
        """What the result file stores: peaks of gauges, counter deltas over the run."""
        if not self.is_available:
            return {"available": False}
        queries = _delta(
            self.after.get("prefix_cache_queries"), self.before.get("prefix_cache_queries")
        )
        hits = _delta(self.after.get("prefix_cache_hits"), self.before.get("prefix_cache_hits"))
        return {
            "available": True,
            "num_scrapes": self.num_scrapes,
            "peak_kv_cache_usage": self.peaks.get("kv_cache_usage"),
            "num_preemptions": _delta(
                self.after.get("num_preemptions"), self.before.get("num_preemptions")
            ),
            "peak_num_requests_running": self.peaks.get("num_requests_running"),
            "peak_num_requests_waiting": self.peaks.get("num_requests_waiting"),
            "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
            "peak_resident_memory_bytes": self.peaks.get("resident_memory_bytes"),
            "engine_config": self.engine_config,
            "startup": self.startup,
            **spec_decode_figures(self.before, self.after),
            **server_clock_figures(self.first_text, self.last_text),
        }
