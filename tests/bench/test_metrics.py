"""Metric maths on synthetic timelines with answers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.bench.metrics import (
    RequestRecord,
    latency_stats_ms,
    parse_goodput,
    peak_in_flight,
    peak_output_rate,
    summarize,
    summarize_rounds,
)


def _records() -> list[RequestRecord]:
    return [
        # 4 tokens: first at 100 ms, then gaps of 20, 30, 50 ms; ends at 200 ms.
        RequestRecord(
            0,
            send_time_s=0.0,
            success=True,
            prompt_tokens=10,
            output_tokens=4,
            ttft_s=0.1,
            itl_s=[0.02, 0.03, 0.05],
            e2e_s=0.2,
        ),
        # 2 tokens: first at 300 ms, second 100 ms later.
        RequestRecord(
            1,
            send_time_s=0.5,
            success=True,
            prompt_tokens=20,
            output_tokens=2,
            ttft_s=0.3,
            itl_s=[0.1],
            e2e_s=0.4,
        ),
        RequestRecord(2, send_time_s=0.6, success=False, error="HTTP 500: boom", prompt_tokens=30),
        # 1 token: no TPOT.
        RequestRecord(
            3,
            send_time_s=1.0,
            success=True,
            prompt_tokens=5,
            output_tokens=1,
            ttft_s=0.2,
            itl_s=[],
            e2e_s=0.2,
        ),
    ]


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # vLLM: TPOT = (E2E - TTFT) / (output tokens - 1).
    r = RequestRecord(0, success=True, output_tokens=10, ttft_s=0.5, itl_s=[0.1] * 9, e2e_s=1.4)
    assert r.tpot_s == pytest.approx(0.1)
    assert RequestRecord(0, success=True, output_tokens=1, ttft_s=0.5, e2e_s=0.5).tpot_s is None
    assert RequestRecord(0, success=False, output_tokens=5).tpot_s is None


def test_summary_counts_and_throughputs() -> None:
    s = summarize(_records(), duration_s=2.0)
    assert (s["completed"], s["failed"], s["num_prompts"]) == (3, 1, 4)
    assert s["failure_reasons"] == {"HTTP 500: boom": 1}
    assert s["total_input_tokens"] == 35  # the failed request's prompt is not counted
    assert s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(21.0)
    assert s["request_goodput"] is None


def test_summary_latency_statistics() -> None:
    s = summarize(_records(), duration_s=2.0)
    # TTFT 100, 300, 200 ms.
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std, as numpy/vLLM
    assert s["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation
    assert s["p95_ttft_ms"] == pytest.approx(290.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT 33.3 and 100 ms; the 1-token request has none.
    assert s["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert s["p90_tpot_ms"] == pytest.approx(100 / 3 + 0.9 * (100 - 100 / 3))
    # ITL pooled over requests: 20, 30, 50, 100 ms.
    assert s["mean_itl_ms"] == pytest.approx(50.0)
    assert s["median_itl_ms"] == pytest.approx(40.0)
    assert s["p90_itl_ms"] == pytest.approx(85.0)
    # E2E 200, 400, 200 ms.
    assert s["mean_e2el_ms"] == pytest.approx(800 / 3)
    assert s["median_e2el_ms"] == pytest.approx(200.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = _records()
    # ttft<=250 and tpot<=50: request 0 (100 ms, 33 ms) and request 3 (200 ms, TPOT taken as 0).
    s = summarize(records, 2.0, {"ttft": 250, "tpot": 50})
    assert s["request_goodput"] == pytest.approx(1.0)
    assert s["goodput_slos_ms"] == {"ttft": 250, "tpot": 50}
    assert summarize(records, 2.0, {"e2el": 150})["request_goodput"] == 0.0
    assert summarize(records, 2.0, {"e2el": 400})["request_goodput"] == pytest.approx(1.5)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500,e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft=5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_peak_output_rate_and_concurrency_use_one_second_buckets() -> None:
    peak_tokens, peak_requests = peak_output_rate(_records())
    # Second 0 holds request 0's 4 chunks and request 1's 2; second 1 holds request 3's one.
    assert peak_tokens == 6.0
    assert peak_requests == 2
    assert peak_output_rate([]) == (0.0, 0)


def test_peak_in_flight_respects_the_concurrency_cap_where_the_one_second_figure_cannot() -> None:
    # 16 lanes, each sending 3 requests of 0.3 s back to back: 48 requests within one second,
    # never more than 16 at once.
    records = [
        RequestRecord(
            lane * 3 + k,
            send_time_s=k * 0.3,
            success=True,
            output_tokens=2,
            ttft_s=0.1,
            itl_s=[0.2],
            e2e_s=0.3,
        )
        for lane in range(16)
        for k in range(3)
    ]
    assert peak_in_flight(records) == 16
    summary = summarize(records, duration_s=0.9)
    assert summary["max_in_flight_requests"] == 16
    assert (
        summary["max_concurrent_requests"] == 48
    )  # vLLM's name: requests active in the busiest second
    assert peak_in_flight(_records()) == 1 and peak_in_flight([]) == 0


def test_empty_and_all_failed_runs_still_have_every_key() -> None:
    s = summarize([RequestRecord(0, error="timeout")], duration_s=1.0)
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["mean_ttft_ms"] == 0.0 and s["p99_e2el_ms"] == 0.0
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)


def test_record_round_trips_through_dict() -> None:
    r = _records()[0]
    data = r.to_dict()
    assert data["tpot_s"] == pytest.approx(0.1 / 3)
    assert RequestRecord.from_dict(data) == r
    assert r.chunk_times_s() == pytest.approx([0.1, 0.12, 0.15, 0.2])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=1, max_size=50)
)
def test_percentiles_match_linear_interpolation_and_are_ordered(values: list[float]) -> None:
    stats = latency_stats_ms(values, "x")
    ordered = sorted(v * 1000 for v in values)

    def linear(p: float) -> float:
        rank = p / 100 * (len(ordered) - 1)
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    for p in (90, 95, 99):
        assert stats[f"p{p}_x_ms"] == pytest.approx(linear(p), rel=1e-9, abs=1e-6)
    assert stats["median_x_ms"] == pytest.approx(linear(50), rel=1e-9, abs=1e-6)
    assert ordered[0] - 1e-6 <= stats["mean_x_ms"] <= ordered[-1] + 1e-6
    assert stats["p90_x_ms"] <= stats["p95_x_ms"] + 1e-9 <= stats["p99_x_ms"] + 2e-9
    assert stats["std_x_ms"] == pytest.approx(float(np.std(ordered)), rel=1e-9, abs=1e-6)


def test_rounds_pool_their_requests_and_keep_each_rounds_figures() -> None:
    def one_round(num_tokens: int, duration_s: float) -> tuple[list[RequestRecord], float]:
        record = RequestRecord(
            0,
            send_time_s=0.0,
            success=True,
            prompt_tokens=4,
            output_tokens=num_tokens,
            ttft_s=0.1,
            itl_s=[0.01] * (num_tokens - 1),
            e2e_s=0.1 + 0.01 * (num_tokens - 1),
        )
        return [record], duration_s

    summary = summarize_rounds([one_round(10, 1.0), one_round(30, 1.0)])
    assert summary["num_rounds"] == 2 and summary["completed"] == 2
    assert summary["output_throughput"] == pytest.approx(20.0)  # 40 tokens over 2 s
    assert [r["output_throughput"] for r in summary["rounds"]] == pytest.approx([10.0, 30.0])
    # Rounds do not overlap in time: peaks are the highest round's, not a sum over rounds.
    assert summary["max_output_tokens_per_s"] == 30 and summary["max_in_flight_requests"] == 1
    assert "failure_reasons" not in summary["rounds"][0]
    with pytest.raises(ValueError):
        summarize_rounds([])
