"""The tune report's charts compare candidates only where they were replayed on the same
requests: successive halving leaves most on a short sample, whose goodput is not the whole
trace's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.tune.report import fronts_by_replay, pareto_front, render_html, write_charts


def test_pareto_front_keeps_the_undominated() -> None:
    assert pareto_front([(10.0, 1.0), (12.0, 2.0), (11.0, 0.5), (12.0, 1.5)]) == [0, 1]


def test_a_short_samples_point_does_not_dominate_the_whole_trace() -> None:
    # (replay size, p95 TPOT ms, goodput): the 16-request samples run at more goodput and
    # lower TPOT than the 300-request finalists, as on the chat trace of 2026-12-07.
    points = [
        (16.0, 10.4, 1.99),
        (16.0, 17.8, 2.04),
        (16.0, 20.1, 1.10),
        (300.0, 12.1, 1.507),
        (300.0, 11.6, 1.505),
    ]
    fronts = fronts_by_replay(points)
    assert fronts == {16.0: [0, 1], 300.0: [3, 4]}
    one_front = pareto_front([(x, y) for _, x, y in points])
    assert 3 not in one_front and 4 not in one_front  # what one front over all said


def _candidate(key: str, status: str, runs: dict[str, float]) -> dict[str, Any]:
    return {
        "key": key,
        "status": status,
        "reason": "",
        "memory_bytes": 2**30,
        "runs": {
            k: {"request_goodput": g, "p95_ttft_ms": 90.0, "p95_tpot_ms": 12.0}
            for k, g in runs.items()
        },
    }


def test_report_names_each_candidates_replay_size(tmp_path: Path) -> None:
    result = {
        "model": "m",
        "sla": {"p95_ttft_ms": 500.0, "p95_tpot_ms": 19.2},
        "num_trace_requests": 300,
        "decision": {"winner": "quantization=int4"},
        "candidates": [
            _candidate("default", "eliminated", {"16/0": 1.1}),
            _candidate("quantization=int8", "lost", {"16/0": 2.27, "300/0": 1.505, "300/1": 1.505}),
            _candidate(
                "quantization=int4", "winner", {"16/0": 2.34, "300/0": 1.507, "300/1": 1.507}
            ),
        ],
    }
    charts = write_charts(result, tmp_path)
    assert {"goodput_vs_ttft", "goodput_vs_tpot", "goodput_vs_memory", "finalists_spread"} <= set(
        charts
    )
    assert all(path.stat().st_size > 0 for path in charts.values())
    page = render_html(result, charts, "tokenmill serve m", "")
    assert "<th>largest replay (requests)</th>" in page
    assert "<td>default</td><td>eliminated</td><td>16</td>" in page
    assert "<td>quantization=int4</td><td>winner</td><td>300</td>" in page


def test_report_marks_refined_candidates_and_says_why_they_were_tried(tmp_path: Path) -> None:
    refined = {**_candidate("max_num_seqs=16", "winner", {"256/0": 1.9}), "origin": "refined"}
    result = {
        "model": "m",
        "sla": {"p95_ttft_ms": 30000.0, "p95_tpot_ms": 136.5},
        "num_trace_requests": 256,
        "decision": {"winner": "max_num_seqs=16"},
        "refinement": "max_num_seqs=16 between max_num_seqs=4 (short on p95_ttft_ms) and ...",
        "candidates": [_candidate("default", "lost", {"256/0": 1.8}), refined],
    }
    page = render_html(result, write_charts(result, tmp_path), "tokenmill serve m", "")
    assert "<td>max_num_seqs=16 (refined)</td><td>winner</td>" in page
    assert "<td>default</td><td>lost</td>" in page
    assert (
        "Refinement (candidates added between two measured values): max_num_seqs=16 between" in page
    )


def test_report_shows_the_peak_rss_measured_and_the_plan_only_where_none_was() -> None:
    measured = _candidate("default", "winner", {"256/0": 1.9, "256/1": 1.9})
    for i, figures in enumerate(measured["runs"].values()):
        figures["peak_resident_memory_bytes"] = (900 + 10 * i) * 2**20
    planned = _candidate("quantization=int8", "lost", {"256/0": 1.8})
    result = {"decision": {"winner": "default"}, "candidates": [measured, planned]}
    page = render_html(result, {}, "tokenmill serve m", "")
    assert "<td>910</td>" in page  # the highest peak of its rounds, not the plan's 1,024
    assert "<td>1,024</td>" in page  # no RSS reported: the plan
    # goodput beside what was served: on a batch trace the two can part (every request served,
    # fewer within the SLA)
    assert "<th>goodput req/s</th><th>served req/s</th>" in page
