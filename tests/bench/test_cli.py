"""The bench and verify parsers register with the flags the docs promise."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tokenmill.bench.cli import _comma_list, _offline_engine_kwargs, register
from tokenmill.bench.server_metrics import DEFAULT_INTERVAL_S


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_serve_flags_and_defaults() -> None:
    args = _parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--endpoint",
            "/v1/chat/completions",
            "--dataset",
            "sharegpt",
            "--dataset-path",
            "x.json",
            "--request-rate",
            "4",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "8",
            "--goodput",
            "ttft:500",
            "tpot:50",
            "--ignore-eos",
            "--save-result",
            "r.json",
        ]
    )
    assert (
        args.endpoint == "/v1/chat/completions"
        and args.request_rate == 4.0
        and args.burstiness == 0.5
    )
    assert args.goodput == ["ttft:500", "tpot:50"] and args.ignore_eos and callable(args.func)
    default = _parser().parse_args(["bench", "serve"])
    assert default.request_rate == math.inf and default.dataset == "random" and default.seed == 0
    # Each /metrics poll costs the target CPU time (server_metrics' docstring): the CLI's
    # default interval is the library's, not the 0.5 s that added 12% to one-stream TPOT.
    assert default.metrics_interval_s == DEFAULT_INTERVAL_S >= 5.0


def test_offline_compare_and_verify_parsers() -> None:
    offline = _parser().parse_args(
        ["bench", "offline", "--compare", "--backends", "tokenmill,transformers-cb"]
    )
    assert offline.compare and offline.ignore_eos and offline.kv_cache == "paged"
    compare = _parser().parse_args(
        [
            "bench",
            "compare",
            "a=x.json",
            "--target",
            "t=http://127.0.0.1:1",
            "--concurrency",
            "1,4,16,64",
            "--sla",
            "ttft_p95_ms=800",
        ]
    )
    assert compare.results == ["a=x.json"] and compare.target == ["t=http://127.0.0.1:1"]
    verify = _parser().parse_args(["verify", "--engine-arg", "rope_theta_override=5000"])
    assert verify.model is None and verify.min_match is None and callable(verify.func)
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench"])


def test_offline_kv_cache_list_and_compile_batch_sizes() -> None:
    args = _parser().parse_args(
        [
            "bench",
            "offline",
            "--kv-cache",
            "paged, static",
            "--compile-batch-sizes",
            "1,2,4,8",
            "--engine-arg",
            "max_num_seqs=8",
        ]
    )
    assert _comma_list(args.kv_cache) == ("paged", "static")
    assert _offline_engine_kwargs(args) == {"max_num_seqs": 8, "compile_batch_sizes": (1, 2, 4, 8)}
    assert _offline_engine_kwargs(_parser().parse_args(["bench", "offline"])) == {}
    with pytest.raises(ValueError, match="compile-batch-sizes"):
        _offline_engine_kwargs(
            _parser().parse_args(["bench", "offline", "--compile-batch-sizes", "1,x"])
        )


def test_serve_cli_runs_against_the_fake_server(fake_server, tmp_path, capsys) -> None:
    fake_server.behavior.ttft_delay_s = fake_server.behavior.itl_delay_s = 0.0
    out = tmp_path / "r.json"
    args = _parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server.base_url,
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--vocab-size",
            "50",
            "--no-progress",
            "--save-result",
            str(out),
            "--goodput",
            "ttft:1000",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and out.is_file()
    assert "Peak requests in flight:" in printed and "Peak concurrent requests" not in printed


def test_compare_targets_sweeps_concurrency_and_writes_the_report(
    fake_server, tmp_path, capsys
) -> None:
    import matplotlib.image

    b = fake_server.behavior
    b.ttft_delay_s, b.itl_delay_s = 0.01, 0.005
    out_dir = tmp_path / "cmp"
    args = _parser().parse_args(
        [
            "bench",
            "compare",
            "--target",
            f"a={fake_server.base_url}",
            "--target",
            f"b={fake_server.base_url}/v1",
            "--concurrency",
            "1,2",
            "--num-prompts",
            "4",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--vocab-size",
            "50",
            "--no-progress",
            "--sla",
            "ttft_p95_ms=5000",
            "--output-dir",
            str(out_dir),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    # Both targets are one server: a pick or a tie, whichever the timing noise says.
    assert "Verdict: " in printed and "a: meets it up to concurrency 2" in printed
    assert sorted(p.name for p in (out_dir / "results").iterdir()) == [
        "a_c1.json",
        "a_c2.json",
        "b_c1.json",
        "b_c2.json",
    ]
    assert (out_dir / "report.html").is_file()
    assert matplotlib.image.imread(str(out_dir / "throughput_vs_concurrency.png")).ndim == 3


def test_serve_num_rounds_measures_each_round_with_prompts_of_its_own(
    fake_server, tmp_path, capsys
) -> None:
    fake_server.behavior.ttft_delay_s = fake_server.behavior.itl_delay_s = 0.0
    out = tmp_path / "r.json"
    args = _parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server.base_url,
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--vocab-size",
            "50",
            "--no-progress",
            "--num-rounds",
            "2",
            "--save-result",
            str(out),
        ]
    )
    assert args.func(args) == 0
    assert "min-max over 2 rounds:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_rounds"] == 2 and result["completed"] == 6
    assert [r["completed"] for r in result["rounds"]] == [3, 3]
    assert [r["round"] for r in result["requests"]] == [0, 0, 0, 1, 1, 1]
    after_warmup = 1 + result["num_warmups"]  # the probe, then the warm-ups
    prompts = [tuple(body["prompt"]) for body in fake_server.behavior.bodies[after_warmup:]]
    assert len(prompts) == 6 and not set(prompts[:3]) & set(
        prompts[3:]
    )  # no prompt is measured twice


def test_bench_keeps_client_library_lines_out_of_its_output(
    fake_server, capsys, monkeypatch
) -> None:
    """A whole `tokenmill bench serve` run through the CLI's entry point prints no httpx
    lines, though the root logger is at INFO as the CLI sets it."""
    import logging

    from tokenmill.bench.cli import CLIENT_LIBRARY_LOGGERS
    from tokenmill.entrypoints.cli import main

    for name in CLIENT_LIBRARY_LOGGERS:  # restored after the test
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    fake_server.behavior.ttft_delay_s = fake_server.behavior.itl_delay_s = 0.0
    root = logging.getLogger()
    handler = logging.StreamHandler()  # as basicConfig would: lines go to stderr
    root.addHandler(handler)
    monkeypatch.setattr(root, "level", logging.INFO)
    try:
        code = main(
            ["bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "4",
             "--input-len", "4", "--output-len", "2", "--vocab-size", "50", "--no-progress"]
        )  # fmt: skip
    finally:
        root.removeHandler(handler)
    captured = capsys.readouterr()
    assert code == 0 and "Serving Benchmark Result" in captured.out
    assert "HTTP Request" not in captured.out + captured.err
