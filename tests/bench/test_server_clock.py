"""Server-clock TTFT/TPOT from /metrics histograms, and the client/server disagreement flag."""

from __future__ import annotations

import pytest

from tokenmill.bench.server_clock import (
    clock_disagreements,
    histogram_quantile,
    read_histograms,
    server_clock_figures,
)


def _exposition(prefix: str, ttft_counts: tuple[int, int, int], ttft_sum: float) -> str:
    a, b, c = ttft_counts
    return f"""# HELP {prefix}:time_to_first_token_seconds TTFT
# TYPE {prefix}:time_to_first_token_seconds histogram
{prefix}:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {a}
{prefix}:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {b}
{prefix}:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {c}
{prefix}:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
{prefix}:time_to_first_token_seconds_count{{model_name="m"}} {c}
"""


@pytest.mark.parametrize("prefix", ["tokenmill", "vllm"])
def test_figures_are_deltas_over_the_run(prefix: str) -> None:
    before = _exposition(prefix, (5, 5, 5), 0.25)  # earlier traffic: not this run's
    after = _exposition(prefix, (5, 15, 15), 2.25)  # 10 requests in (0.1, 0.5], 2.0 s total
    figures = server_clock_figures(before, after)
    assert figures["server_mean_ttft_ms"] == pytest.approx(200.0)
    assert figures["server_p95_ttft_ms"] == pytest.approx(100 + 400 * 0.95)
    assert "server_mean_tpot_ms" not in figures


def test_quantile_follows_prometheus_interpolation() -> None:
    h = read_histograms(_exposition("vllm", (2, 4, 4), 1.0))["vllm:time_to_first_token_seconds"]
    assert histogram_quantile(0.5, h) == pytest.approx(0.1)
    assert histogram_quantile(0.75, h) == pytest.approx(0.3)


def test_disagreement_over_five_percent_is_flagged() -> None:
    server = {"server_mean_ttft_ms": 100.0, "server_mean_tpot_ms": 20.0}
    notes = clock_disagreements({"mean_ttft_ms": 130.0, "mean_tpot_ms": 20.5}, server)
    assert len(notes) == 1 and notes[0].startswith("mean TTFT: client 130.0 ms, server 100.0 ms")
    assert clock_disagreements({"mean_ttft_ms": 104.0}, server) == []
