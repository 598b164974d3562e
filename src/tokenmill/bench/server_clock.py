"""TTFT and TPOT by the server's own clock, from its ``/metrics`` histograms.

The client's timings include its own scheduling delays: on a small machine the load
generator competes with the server for cores. The server's histograms (tokenmill's
``tokenmill:`` names and vLLM's ``vllm:``) time the same quantities from arrival inside
the server; the mean comes exactly from ``_sum``/``_count`` deltas over the run, P95
from the bucket deltas (interpolated within a bucket, as Prometheus'
``histogram_quantile``). Where the client's mean differs from the server's by more than
``DISAGREEMENT`` the result says so.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TTFT_HISTOGRAMS = ("tokenmill:time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
TPOT_HISTOGRAMS = (
    "tokenmill:request_time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds",
)
DISAGREEMENT = 0.05
"""Relative difference of client and server means beyond which the report flags it."""

Histogram = dict[str, Any]
"""``{"buckets": {le: cumulative count}, "sum": s, "count": n}``, label sets summed."""


def read_histograms(text: str) -> dict[str, Histogram]:
    """Every histogram of an exposition, its label sets summed."""
    out: dict[str, Histogram] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return out
    for family in families:
        if family.type != "histogram":
            continue
        h = out.setdefault(family.name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                h["buckets"][le] = h["buckets"].get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                h["sum"] += sample.value
            elif sample.name.endswith("_count"):
                h["count"] += sample.value
    return out


def histogram_delta(after: Histogram, before: Histogram | None) -> Histogram:
    """What was observed between two scrapes."""
    before = before or {"buckets": {}, "sum": 0.0, "count": 0.0}
    return {
        "buckets": {le: c - before["buckets"].get(le, 0.0) for le, c in after["buckets"].items()},
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """The ``q`` quantile, linear within its bucket (Prometheus' rule); None when empty."""
    total = h["count"]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(h["buckets"]):
        count = h["buckets"][le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (
                (rank - below) / (count - below) if count > below else 1.0
            )
        lower, below = le, count
    return lower


def server_clock_figures(
    before_text: str | None, after_text: str | None
) -> dict[str, float | None]:
    """Mean and P95 TTFT/TPOT in ms over the run by the server's clock (None: not exposed)."""
    out: dict[str, float | None] = {}
    if not after_text:
        return out
    after, before = read_histograms(after_text), read_histograms(before_text or "")
    for metric, names in (("ttft", TTFT_HISTOGRAMS), ("tpot", TPOT_HISTOGRAMS)):
        name = next((n for n in names if n in after), None)
        if name is None:
            continue
        h = histogram_delta(after[name], before.get(name))
        p95 = histogram_quantile(0.95, h)
        out[f"server_mean_{metric}_ms"] = h["sum"] / h["count"] * 1000 if h["count"] > 0 else None
        out[f"server_p95_{metric}_ms"] = p95 * 1000 if p95 is not None else None
    return out


def clock_disagreements(result: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """Where the client's mean TTFT/TPOT and the server's differ by more than ``DISAGREEMENT``."""
    notes = []
    for metric in ("ttft", "tpot"):
        client, own = result.get(f"mean_{metric}_ms"), server.get(f"server_mean_{metric}_ms")
        if not client or not own:
            continue
        diff = abs(client - own) / own
        if diff > DISAGREEMENT:
            notes.append(
                f"mean {metric.upper()}: client {client:.1f} ms, server {own:.1f} ms ({diff:.0%} apart; "
                "the client's figure includes its own delays and the network)"
            )
    return notes
