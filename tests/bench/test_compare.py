"""The decision report: SLA parsing, verdicts, ratios, HTML and PNGs that open."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib.image
import pytest

from tokenmill.bench.cli import _named_results_from_files, register
from tokenmill.bench.compare import build_comparison, format_comparison, table_rows
from tokenmill.bench.metrics import RequestRecord, summarize
from tokenmill.bench.report import (
    PLOT_FILES,
    build_latency_vs_throughput_figure,
    build_throughput_figure,
    write_report,
)
from tokenmill.bench.results import name_by_config
from tokenmill.bench.sla import check_sla, parse_sla

NUM_REQUESTS, NUM_TOKENS = 10, 11


def make_result(
    label: str, concurrency: int | None, ttft_ms: float, tpot_ms: float, output_tps: float
) -> dict:
    """A serve result whose every request has this TTFT and TPOT, at this throughput."""
    records = [
        RequestRecord(
            i,
            send_time_s=0.0,
            success=True,
            prompt_tokens=20,
            output_tokens=NUM_TOKENS,
            ttft_s=ttft_ms / 1000,
            itl_s=[tpot_ms / 1000] * (NUM_TOKENS - 1),
            e2e_s=(ttft_ms + tpot_ms * (NUM_TOKENS - 1)) / 1000,
        )
        for i in range(NUM_REQUESTS)
    ]
    result = summarize(records, duration_s=NUM_REQUESTS * NUM_TOKENS / output_tps)
    result.update(
        label=label,
        max_concurrency=concurrency,
        request_rate="inf",
        endpoint="/v1/completions",
        workload={"dataset": "random", "input_len": 20},
        requests=[r.to_dict() for r in records],
    )
    return result


FAST = [(1, 100, 20, 50), (4, 200, 30, 150), (16, 900, 60, 300)]
SLOW = [(1, 300, 40, 25), (4, 700, 70, 60), (16, 2000, 120, 90)]


def _sweeps() -> list[tuple[str, dict]]:
    named = [("slow", make_result("slow", c, t, p, x)) for c, t, p, x in SLOW]
    return named + [("fast", make_result("fast", c, t, p, x)) for c, t, p, x in FAST]


def test_parse_sla_spellings() -> None:
    assert parse_sla("ttft_p95_ms=800,tpot_p95_ms=50") == {
        "p95_ttft_ms": 800.0,
        "p95_tpot_ms": 50.0,
    }
    assert parse_sla("p99_e2el_ms=5000 e2e_median_ms=100") == {
        "p99_e2el_ms": 5000.0,
        "median_e2el_ms": 100.0,
    }
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
    comparison = build_comparison(
        _sweeps(), baseline="slow", sla=parse_sla("ttft_p95_ms=800,tpot_p95_ms=50")
    )
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
    slow_cell, fast_cell = rows["output_throughput"]
    assert slow_cell.value == pytest.approx(90) and fast_cell.value == pytest.approx(
        300
    )  # concurrency 16
    assert (
        slow_cell.ratio is None
        and fast_cell.ratio == pytest.approx(300 / 90)
        and fast_cell.is_clear
    )
    assert rows["p95_ttft_ms"][1].ratio == pytest.approx(900 / 2000)
    with pytest.raises(ValueError, match="baseline"):
        build_comparison(_sweeps(), baseline="nope")


def _assert_png(path: Path) -> None:
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def test_report_writes_self_contained_html_and_readable_pngs(tmp_path: Path) -> None:
    comparison = build_comparison(
        _sweeps(), baseline="slow", sla=parse_sla("ttft_p95_ms=800,tpot_p95_ms=50")
    )
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


def test_cli_compare_on_two_saved_result_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for name, (c, t, p, x) in (("one", FAST[1]), ("two", SLOW[1])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(make_result(name, c, t, p, x)))
        paths.append(str(path))
    out_dir = tmp_path / "cmp"
    args = _parser().parse_args(
        [
            "bench",
            "compare",
            *paths,
            "--baseline",
            "two",
            "--sla",
            "ttft_p95_ms=800",
            "--output-dir",
            str(out_dir),
        ]
    )
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
    assert (
        "Warning: the results ran different workloads (input_len: a=20, b=40)"
        in format_comparison(comparison)
    )
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
    monkeypatch.delitem(
        sys.modules, "tokenmill.bench.report", raising=False
    )  # imported afresh, then restored
    args = _parser().parse_args(
        ["bench", "compare", str(path), "--output-dir", str(tmp_path / "cmp")]
    )
    assert args.func(args) == 2
    assert (
        "matplotlib is not installed; the bench tools need it: pip install 'tokenmill[bench]'"
        in capsys.readouterr().err
    )


def _with_rounds(result: dict, throughputs: list[float]) -> dict:
    result["rounds"] = [{"output_throughput": x} for x in throughputs]
    result["num_rounds"] = len(throughputs)
    return result


def test_single_runs_within_noise_are_a_tie_and_are_not_coloured(tmp_path: Path) -> None:
    # 2758 vs 2744 tok/s, one run each, was called a win; 3-6% apart were coloured.
    a = make_result("a", 16, 100, 20, 2758)
    b = make_result("b", 16, 100, 20, 2744)
    comparison = build_comparison([("a", a), ("b", b)])
    assert comparison.pick is None
    assert comparison.verdict.startswith("Output throughput is a tie: a 2758.0, b 2744.0 tok/s")
    assert (
        "cannot be told from noise" in comparison.verdict
        and "No target is clearly better" in comparison.verdict
    )
    text = format_comparison(comparison)
    assert "(~0.99x)" in text and "~ marks a ratio within noise" in text
    c = make_result("c", 16, 100, 20, 2758 * 1.06)  # 6% faster: still within single-run noise
    rows = {spec.key: cells for spec, cells in table_rows(build_comparison([("a", a), ("c", c)]))}
    assert not rows["output_throughput"][1].is_clear
    html = write_report(build_comparison([("a", a), ("c", c)]), tmp_path)["html"].read_text()
    assert (
        'class="better"' not in html
        and 'class="worse"' not in html
        and 'class="noise">(~1.06x)' in html
    )
    assert 'class="verdict tie"' in html


def test_a_large_single_run_difference_is_still_called() -> None:
    a = make_result("a", 16, 100, 20, 2000)
    b = make_result("b", 16, 100, 20, 2300)  # 15% faster
    comparison = build_comparison([("a", a), ("b", b)])
    assert comparison.pick == "b" and "so pick b" in comparison.verdict


def test_rounds_decide_by_their_spread(tmp_path: Path) -> None:
    a = _with_rounds(make_result("a", 16, 100, 20, 2750), [2700, 2750, 2800])
    b = _with_rounds(make_result("b", 16, 100, 20, 2770), [2740, 2770, 2790])
    tie = build_comparison([("a", a), ("b", b)])
    assert tie.pick is None and "their ranges over 3 rounds overlap" in tie.verdict
    c = _with_rounds(
        make_result("c", 16, 100, 20, 2900), [2850, 2900, 2950]
    )  # 5%, but every round above a's
    win = build_comparison([("a", a), ("c", c)])
    assert win.pick == "c" and win.verdict.startswith("Highest throughput: c")
    text = format_comparison(win)
    assert "2900.00 [2850.00-2950.00] (1.05x)" in text and "2750.00 [2700.00-2800.00]" in text
    assert "Rounds" in text
    html = write_report(win, tmp_path)["html"].read_text()
    assert 'class="better">(1.05x)' in html and 'class="verdict"' in html


def test_sla_verdict_calls_a_tie_between_targets_within_noise() -> None:
    a = make_result("a", 4, 100, 20, 1000)
    b = make_result("b", 4, 100, 20, 1030)
    comparison = build_comparison([("a", a), ("b", b)], sla=parse_sla("ttft_p95_ms=800"))
    assert comparison.pick is None
    assert comparison.verdict.startswith(
        "b, a meet the SLA, and their best output throughput within it is a tie"
    )


def test_unlabelled_results_are_named_by_what_differs(tmp_path: Path) -> None:
    paths = []
    for kv_cache in ("paged", "static"):
        for concurrency in (1, 4):
            result = make_result("demo", concurrency, 100, 20, 50 * concurrency)
            result["metadata"] = {"kv_cache": kv_cache}
            path = tmp_path / f"{kv_cache}_{concurrency}.json"
            path.write_text(json.dumps(result))
            paths.append(str(path))
    named = _named_results_from_files(paths)
    assert [name for name, _ in named] == ["demo[paged]"] * 2 + ["demo[static]"] * 2
    assert [t.name for t in build_comparison(named).targets] == ["demo[paged]", "demo[static]"]
    assert [name for name, _ in _named_results_from_files([f"mine={paths[0]}", paths[2]])] == [
        "mine",
        "demo",
    ]
    two = [
        (
            "demo",
            {
                **make_result("demo", 1, 1, 1, 1),
                "base_url": f"http://127.0.0.1:{port}",
                "endpoint": e,
            },
        )
        for port, e in ((8000, "/v1/completions"), (8001, "/v1/chat/completions"))
    ]
    assert [n for n, _ in name_by_config(two)] == [
        "demo[base_url=127.0.0.1:8000,endpoint=/v1/completions]",
        "demo[base_url=127.0.0.1:8001,endpoint=/v1/chat/completions]",
    ]


def test_plots_of_one_point_per_target_say_so_and_start_at_zero() -> None:
    a = _with_rounds(make_result("a", 16, 100, 20, 2758), [2740, 2758, 2770])
    b = make_result("b", 16, 100, 20, 2744)
    comparison = build_comparison([("a", a), ("b", b)])
    ax = build_throughput_figure(comparison).axes[0]
    assert "one load per target: bars, not a curve" in ax.get_title() and len(ax.patches) == 2
    assert ax.get_ylim()[0] == 0 and "error bars: min-max over 1/3 rounds" in ax.get_title()
    for ax in build_latency_vs_throughput_figure(comparison).axes:
        assert (
            "one point per target" in ax.get_title()
            and ax.get_ylim()[0] == 0
            and ax.get_xlim()[0] == 0
        )
    sweep = build_throughput_figure(build_comparison(_sweeps())).axes[0]
    assert "against load" in sweep.get_title() and sweep.get_ylim()[0] == 0 and not sweep.patches


def test_a_cold_run_gets_no_verdict_unless_allowed() -> None:
    """A result measured without warm-ups timed start-up costs: compare names it and picks
    nothing, unless told to accept cold runs (then it warns)."""
    named = _sweeps()
    warm = build_comparison(named, sla=parse_sla("ttft_p95_ms=1000"))
    assert warm.pick == "fast"
    cold_named = [(n, {**r, "num_warmups": 0 if n == "fast" else 4}) for n, r in named]
    cold = build_comparison(cold_named, sla=parse_sla("ttft_p95_ms=1000"))
    assert cold.pick is None
    assert cold.verdict.startswith("No verdict: fast measured a cold server")
    allowed = build_comparison(cold_named, sla=parse_sla("ttft_p95_ms=1000"), allow_cold=True)
    assert allowed.pick == "fast"
    assert any("cold server" in w for w in allowed.warnings)
