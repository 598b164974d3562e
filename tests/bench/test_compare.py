"""The decision report: SLA parsing, verdicts, ratios, HTML and PNGs that open."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib.image
import pytest

from tokenmill.bench.cli import register
from tokenmill.bench.compare import (
    build_comparison,
    check_sla,
    format_comparison,
    parse_sla,
    table_rows,
)
from tokenmill.bench.metrics import RequestRecord, summarize
from tokenmill.bench.report import PLOT_FILES, write_report

NUM_REQUESTS, NUM_TOKENS = 10, 11


def make_result(label: str, concurrency: int | None, ttft_ms: float, tpot_ms: float, output_tps: float) -> dict:
    """A serve result whose every request has this TTFT and TPOT, at this throughput."""
    records = [
        RequestRecord(i, send_time_s=0.0, success=True, prompt_tokens=20, output_tokens=NUM_TOKENS,
                      ttft_s=ttft_ms / 1000, itl_s=[tpot_ms / 1000] * (NUM_TOKENS - 1),
                      e2e_s=(ttft_ms + tpot_ms * (NUM_TOKENS - 1)) / 1000)
        for i in range(NUM_REQUESTS)
    ]
    result = summarize(records, duration_s=NUM_REQUESTS * NUM_TOKENS / output_tps)
    result.update(label=label, max_concurrency=concurrency, request_rate="inf", endpoint="/v1/completions",
                  workload={"dataset": "random", "input_len": 20}, requests=[r.to_dict() for r in records])
    return result


FAST = [(1, 100, 20, 50), (4, 200, 30, 150), (16, 900, 60, 300)]
SLOW = [(1, 300, 40, 25), (4, 700, 70, 60), (16, 2000, 120, 90)]


def _sweeps() -> list[tuple[str, dict]]:
    named = [("slow", make_result("slow", c, t, p, x)) for c, t, p, x in SLOW]
    return named + [("fast", make_result("fast", c, t, p, x)) for c, t, p, x in FAST]


def test_parse_sla_spellings() -> None:
    assert parse_sla("ttft_p95_ms=800,tpot_p95_ms=50") == {"p95_ttft_ms": 800.0, "p95_tpot_ms": 50.0}
    assert parse_sla("p99_e2el_ms=5000 e2e_median_ms=100") == {"p99_e2el_ms": 5000.0, "median_e2el_ms": 100.0}
    assert parse_sla(None) == {}
    for bad in ("ttft_p95=800", "ttft_p42_ms=1", "foo_p95_ms=1", "ttft_p95_ms=abc", "ttft_p95_ms"):
        with pytest.raises(ValueError, match="SLA"):
            parse_sla(bad)


def test_check_sla_names_each_miss() -> None:
    result = make_result("x", 1, 900, 20, 10)
    assert check_sla(result, {"p95_ttft_ms": 1000}) == []
    assert check_sla(result, {"p95_ttft_ms": 800}) == ["p95_ttft_ms 900.0 > 800"]
    result["failed"] = 2
    assert "2 failed requests" in check_sla(result, {})


def test_sla_verdict_names_the_pick_and_the_highest_load_within_it() -> None:
    comparison = build_comparison(_sweeps(), baseline="slow", sla=parse_sla("ttft_p95_ms=800,tpot_p95_ms=50"))
    fast, slow = comparison.target("fast"), comparison.target("slow")
    assert fast.max_load_within_sla == 4 and slow.max_load_within_sla == 1
    assert fast.best_within_sla["output_throughput"] == pytest.approx(150)
    assert comparison.verdict.startswith("Pick fast: it meets the SLA up to concurrency 4")
    assert "6.00x slow's best within SLA" in comparison.verdict
    text = format_comparison(comparison)
    assert "fast: meets it up to concurrency 4" in text and "slow (baseline)" in text


def test_no_target_meeting_the_sla_is_said_plainly() -> None:
    comparison = build_comparison(_sweeps(), sla=parse_sla("ttft_p95_ms=10"))
    assert comparison.verdict.startswith("No target meets the SLA")


def test_without_sla_the_verdict_weighs_throughput_and_latency() -> None:
    comparison = build_comparison(_sweeps())
    assert comparison.baseline == "slow"  # the first target by default
    assert "Highest throughput: fast" in comparison.verdict and "pick fast" in comparison.verdict


def test_table_ratios_are_against_the_baseline_at_the_shared_highest_load() -> None:
    comparison = build_comparison(_sweeps(), baseline="slow")
    rows = {spec.key: cells for spec, cells in table_rows(comparison)}
    (slow_tps, slow_ratio), (fast_tps, fast_ratio) = rows["output_throughput"]
    assert slow_tps == pytest.approx(90) and fast_tps == pytest.approx(300)  # concurrency 16
    assert slow_ratio is None and fast_ratio == pytest.approx(300 / 90)
    assert rows["p95_ttft_ms"][1][1] == pytest.approx(900 / 2000)
    with pytest.raises(ValueError, match="baseline"):
        build_comparison(_sweeps(), baseline="nope")


def _assert_png(path: Path) -> None:
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def test_report_writes_self_contained_html_and_readable_pngs(tmp_path: Path) -> None:
    comparison = build_comparison(_sweeps(), baseline="slow", sla=parse_sla("ttft_p95_ms=800,tpot_p95_ms=50"))
    files = write_report(comparison, tmp_path / "report")
    assert set(files) == {*PLOT_FILES, "html"}
    for name, file_name in PLOT_FILES.items():
        assert files[name].name == file_name
        _assert_png(files[name])
    html = files["html"].read_text()
    assert html.count('src="data:image/png;base64,') == 3
    assert "Pick fast" in html and "<table>" in html
    assert 'src="http' not in html and "<script" not in html  # nothing fetched when opened


def test_report_for_single_points_without_load(tmp_path: Path) -> None:
    a = make_result("a", None, 100, 20, 50)
    b = make_result("b", None, 150, 10, 80)
    files = write_report(build_comparison([("a", a), ("b", b)]), tmp_path)
    for name in PLOT_FILES:
        _assert_png(files[name])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_compare_on_two_saved_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for name, (c, t, p, x) in (("one", FAST[1]), ("two", SLOW[1])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(make_result(name, c, t, p, x)))
        paths.append(str(path))
    out_dir = tmp_path / "cmp"
    args = _parser().parse_args(["bench", "compare", *paths, "--baseline", "two", "--sla", "ttft_p95_ms=800",
                                 "--output-dir", str(out_dir)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Verdict: Pick one" in printed and "two (baseline)" in printed
    assert (out_dir / "report.html").is_file()
    for file_name in PLOT_FILES.values():
        _assert_png(out_dir / file_name)


def test_cli_compare_reports_bad_input_with_exit_code_2(tmp_path: Path) -> None:
    args = _parser().parse_args(["bench", "compare", str(tmp_path / "missing.json")])
    assert args.func(args) == 2
    args = _parser().parse_args(["bench", "compare"])
    assert args.func(args) == 2


def test_different_workloads_are_warned_about_in_text_and_html(tmp_path: Path) -> None:
    assert build_comparison(_sweeps()).warnings == []  # one workload for every point
    a = make_result("a", 4, 100, 20, 50)
    b = make_result("b", 4, 150, 10, 80)
    b["workload"] = {**b["workload"], "input_len": 40}
    comparison = build_comparison([("a", a), ("b", b)])
    assert comparison.warnings == [
        "the results ran different workloads (input_len: a=20, b=40), so their figures compare unlike work"
    ]
    assert "Warning: the results ran different workloads (input_len: a=20, b=40)" in format_comparison(comparison)
    html = write_report(comparison, tmp_path)["html"].read_text()
    assert 'class="warning">Warning: the results ran different workloads' in html
    del b["workload"]  # e.g. a vLLM result file
    (warning,) = build_comparison([("a", a), ("b", b)]).warnings
    assert warning.startswith("no workload recorded in the results of b")


def test_cli_compare_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.json"
    path.write_text(json.dumps(make_result("one", 4, 100, 20, 50)))
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "tokenmill.bench.report", raising=False)  # imported afresh, then restored
    args = _parser().parse_args(["bench", "compare", str(path), "--output-dir", str(tmp_path / "cmp")])
    assert args.func(args) == 2
    assert "matplotlib is not installed; the bench tools need it: pip install 'tokenmill[bench]'" in capsys.readouterr().err
