"""Benchmark metric maths: per-request timing records and the summary the field agrees on.

Definitions follow vLLM's ``bench serve`` (``calculate_metrics``) so that numbers are
comparable across tools: TTFT is the time to the first streamed token chunk, ITL the gaps
between later chunks, E2E the time to the last chunk, and
TPOT = (E2E − TTFT) / (output tokens − 1). Percentiles interpolate linearly (numpy's
default) and std is the population std. Nothing here does I/O: inputs are records,
outputs are plain dicts ready for JSON.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
"""The latency families every summary reports, with vLLM's key names."""
PERCENTILES: tuple[int, ...] = (90, 95, 99)
"""Percentiles reported for every latency family (plus mean, median and std)."""
STATS: tuple[str, ...] = ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))
"""Statistic prefixes of the summary keys, e.g. ``p95`` in ``p95_ttft_ms``."""
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
"""Per-request latencies that ``--goodput`` SLOs may bound (ITL is per-chunk, not per-request)."""


@dataclass
class RequestRecord:
    """Timings and token counts of one benchmark request, successful or not.

    Times are seconds. ``send_time_s`` is relative to the benchmark start; the other
    times are relative to the request's own send time.
    """

    index: int
    """Position of the request in the workload (stable across runs with the same seed)."""
    send_time_s: float = 0.0
    """When the request was sent, seconds after the benchmark started."""
    success: bool = False
    """True when the server answered and the stream completed."""
    error: str = ""
    """Why the request failed: a short reason used to group failures (empty on success)."""
    prompt_tokens: int = 0
    """Prompt length in tokens (server usage when reported, else the dataset's count)."""
    output_tokens: int = 0
    """Generated tokens (server usage when reported, else re-tokenized or chunk count)."""
    output_tokens_source: str = "usage"
    """Where ``output_tokens`` came from: ``usage``, ``tokenizer``, ``chunks`` or ``engine``."""
    ttft_s: float = 0.0
    """Time to first token: send to the first chunk carrying a token."""
    itl_s: list[float] = field(default_factory=list)
    """Inter-token latencies: the gaps between successive token-carrying chunks."""
    e2e_s: float = 0.0
    """End-to-end latency: send to the last chunk of the response."""
    generated_text: str = ""
    """The streamed text, kept for re-tokenizing and for the saved result."""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None when fewer than two tokens came back."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def chunk_times_s(self) -> list[float]:
        """Arrival times of every token chunk, relative to the benchmark start."""
        if not self.success:
            return []
        times = [self.send_time_s + self.ttft_s]
        for gap_s in self.itl_s:
            times.append(times[-1] + gap_s)
        return times

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with derived TPOT; times stay in seconds like vLLM's result files."""
        data = asdict(self)
        data["tpot_s"] = self.tpot_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        """Inverse of ``to_dict``; ignores derived and unknown keys."""
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def parse_latency_limits(
    items: str | Iterable[str] | None,
    separator: str,
    key_of: Callable[[str], str | None],
    what: str,
    expected: str,
) -> dict[str, float]:
    """Parse ``NAME<separator>MS`` terms, split on commas and spaces, into ``{key: MS}``.

    The one grammar behind ``--goodput`` (``ttft:500``) and ``--sla`` (``ttft_p95_ms=800``).
    ``key_of`` maps a lower-cased name to its key, or None when the name is unknown; each
    limit must be a finite number of milliseconds >= 0. Errors name the bad term, calling
    it a ``what``, and say what was ``expected``.
    """
    limits_ms: dict[str, float] = {}
    for item in [items] if isinstance(items, str) else items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(separator)
            key = key_of(name.strip().lower()) if sep else None
            if key is None:
                raise ValueError(f"bad {what} {part!r}: expected {expected}")
            try:
                limit_ms = float(value)
            except ValueError:
                raise ValueError(f"bad {what} {part!r}: {value!r} is not a number of ms") from None
            if not math.isfinite(limit_ms) or limit_ms < 0:
                raise ValueError(
                    f"bad {what} {part!r}: the limit must be a finite number of ms >= 0"
                )
            limits_ms[key] = limit_ms
    return limits_ms


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into SLOs in milliseconds, naming any bad item."""
    return parse_latency_limits(
        items,
        ":",
        lambda name: name if name in GOODPUT_METRICS else None,
        "goodput SLO",
        f"NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}",
    )


def latency_stats_ms(values_s: Sequence[float], metric: str) -> dict[str, float]:
    """Mean, median, std and percentiles of ``values_s`` in ms, keyed like ``p95_ttft_ms``.

    An empty list gives zeros, as vLLM does, so result files always have every key.
    """
    data_ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    stats = {
        f"mean_{metric}_ms": float(np.mean(data_ms)),
        f"median_{metric}_ms": float(np.median(data_ms)),
        f"std_{metric}_ms": float(np.std(data_ms)),
    }
    for p in PERCENTILES:
        stats[f"p{p}_{metric}_ms"] = float(np.percentile(data_ms, p))
    return stats


def is_good_request(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO (TPOT of a 1-token reply counts as 0)."""
    if not record.success:
        return False
    tpot_s = record.tpot_s or 0.0
    values_ms = {"ttft": record.ttft_s * 1000, "tpot": tpot_s * 1000, "e2el": record.e2e_s * 1000}
    return all(values_ms[name] <= limit_ms for name, limit_ms in slos_ms.items())


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Peak output tokens/s, and the most requests active during one 1-second bucket.

    Mirrors vLLM (its ``max_concurrent_requests``): each token chunk lands in the bucket of
    its arrival second counted from the first send; a request counts in every second it
    was in flight. Requests that run one after another within a second all count, so the
    second figure exceeds ``--max-concurrency`` when requests are short; see
    ``peak_in_flight`` for the number in flight at one instant.
    """
    done = [r for r in records if r.success]
    if not done:
        return 0.0, 0
    start_s = min(r.send_time_s for r in done)
    end_s = max(r.send_time_s + r.e2e_s for r in done)
    num_buckets = math.ceil(end_s - start_s) + 1
    tokens_per_bucket = np.zeros(num_buckets)
    requests_per_bucket = np.zeros(num_buckets)
    for r in done:
        for t in r.chunk_times_s():
            bucket = int(t - start_s)
            if 0 <= bucket < num_buckets:
                tokens_per_bucket[bucket] += 1
        first = int(r.send_time_s - start_s)
        last = min(int(r.send_time_s + r.e2e_s - start_s), num_buckets - 1)
        requests_per_bucket[first : last + 1] += 1
    return float(tokens_per_bucket.max()), int(requests_per_bucket.max())


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most successful requests in flight at one instant (send to last chunk).

    A request that ends as another starts does not overlap it, so under a concurrency cap
    this never exceeds the cap.
    """
    events = []
    for r in records:
        if r.success:
            events += [(r.send_time_s, 1), (r.send_time_s + r.e2e_s, -1)]
    events.sort()  # at equal times an end (-1) sorts before a start (+1)
    peak = in_flight = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return peak


def failure_reasons(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Count of failed requests per reason, most frequent first."""
    counts = Counter(r.error or "unknown error" for r in records if not r.success)
    return dict(counts.most_common())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The benchmark summary with vLLM's key names: counts, throughputs and latency stats.

    ``max_concurrent_requests`` keeps vLLM's name and meaning (most requests active within
    one second); ``max_in_flight_requests`` is the most in flight at one instant.

    ``duration_s`` is the wall time of the measured run (warm-up excluded); throughputs
    divide by it. ``goodput_slos`` maps ``ttft``/``tpot``/``e2el`` to limits in ms; when
    given, ``request_goodput`` is the rate of requests meeting every one of them.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    ttfts_s = [r.ttft_s for r in done]
    tpots_s = [t for t in (r.tpot_s for r in done) if t is not None]
    itls_s = [gap for r in done for gap in r.itl_s]
    e2els_s = [r.e2e_s for r in done]
    peak_tokens_per_s, peak_requests_per_s = peak_output_rate(done)

    summary: dict[str, Any] = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failure_reasons": failure_reasons(records),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens_per_s,
        "max_concurrent_requests": peak_requests_per_s,
        "max_in_flight_requests": peak_in_flight(done),
    }
    if goodput_slos:
        num_good = sum(is_good_request(r, goodput_slos) for r in done)
        summary["request_goodput"] = num_good / duration_s
        summary["goodput_slos_ms"] = dict(goodput_slos)
    for metric, values_s in zip(LATENCY_METRICS, (ttfts_s, tpots_s, itls_s, e2els_s), strict=True):
        summary.update(latency_stats_ms(values_s, metric))
    return summary


PEAK_KEYS: tuple[str, ...] = (
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "max_in_flight_requests",
)
"""Summary keys that are peaks within one round: over several rounds, the highest round's."""


def summarize_rounds(
    rounds: Sequence[tuple[Sequence[RequestRecord], float]],
    goodput_slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The summary of repeated runs of one workload, with each round's figures kept.

    Counts, throughputs and latency statistics pool every round (throughput is all tokens
    over all measured seconds); peaks are the highest round's, since rounds do not overlap
    in time. ``rounds`` lists each round's scalar figures, so a reader can see the spread.
    """
    if not rounds:
        raise ValueError("summarize_rounds needs at least one round")
    per_round = [summarize(records, duration_s, goodput_slos) for records, duration_s in rounds]
    pooled = summarize(
        [r for records, _ in rounds for r in records], sum(d for _, d in rounds), goodput_slos
    )
    for key in PEAK_KEYS:
        pooled[key] = max(s[key] for s in per_round)
    pooled["num_rounds"] = len(rounds)
    pooled["rounds"] = [
        {k: v for k, v in s.items() if v is None or isinstance(v, (int, float))} for s in per_round
    ]
    return pooled
