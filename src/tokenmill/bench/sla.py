"""Latency SLAs for ``bench compare``: parsing ``--sla`` and checking one result against it.

Each bound is an upper limit on a latency statistic of the summary; failed requests always
miss.
"""

from __future__ import annotations

from typing import Any

from tokenmill.bench.metrics import LATENCY_METRICS, STATS, parse_latency_limits


def parse_sla(text: str | None) -> dict[str, float]:
    """``"ttft_p95_ms=800,tpot_p95_ms=50"`` into ``{"p95_ttft_ms": 800, "p95_tpot_ms": 50}``.

    Each bound is an upper limit on a latency statistic; the result keys are the summary
    keys. ``p95_ttft_ms`` (summary spelling) and ``e2e`` for ``e2el`` are accepted too.
    """
    return parse_latency_limits(
        text,
        "=",
        _sla_key,
        "SLA term",
        f"METRIC_STAT_ms=LIMIT, e.g. ttft_p95_ms=800 (metrics {', '.join(LATENCY_METRICS)}; stats {', '.join(STATS)})",
    )


def _sla_key(name: str) -> str | None:
    """Summary key of an SLA term name in either order (``ttft_p95_ms`` or ``p95_ttft_ms``)."""
    if not name.endswith("_ms"):
        return None
    words = ["e2el" if w == "e2e" else w for w in name[: -len("_ms")].split("_")]
    if len(words) != 2:
        return None
    for metric, stat in (words, words[::-1]):
        if metric in LATENCY_METRICS and stat in STATS:
            return f"{stat}_{metric}_ms"
    return None


def check_sla(result: dict[str, Any], sla: dict[str, float]) -> list[str]:
    """Why ``result`` misses the SLA (empty when it meets it); failed requests always miss."""
    misses = []
    if result.get("failed"):
        misses.append(f"{result['failed']} failed requests")
    for key, limit in sla.items():
        value = result.get(key)
        if value is None:
            misses.append(f"{key} not measured")
        elif value > limit:
            misses.append(f"{key} {value:.1f} > {limit:g}")
    return misses
