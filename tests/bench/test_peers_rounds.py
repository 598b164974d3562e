"""The verdicts of ``benchmarks/peers_rounds.py`` on recorded rounds: a target is met only
where it holds in every round, ratios are paired within a round, and the report says so."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers_rounds
from peers_plan import FULL_WORKLOADS, Context


def run(r: int, workload: str, server: str, tok_s: float, ttft: float) -> dict[str, Any]:
    return {
        "round": r,
        "workload": workload,
        "server": server,
        "wall_s": 10.0,
        "others_cpu_s": {"x": 0.1},
        "output_throughput": tok_s,
        "mean_ttft_ms": ttft,
    }


def test_a_target_is_met_only_where_it_holds_in_every_round() -> None:
    # The baseline drifts 300 -> 360 over the rounds; tokenmill stays 1.25x ahead of it in
    # each round, though its own slowest round (375) is below vLLM's fastest times 1.2 (432).
    runs = [
        run(0, "many", "vllm-bf16", 300.0, 600.0),
        run(0, "many", "tm-bf16", 375.0, 500.0),
        run(1, "many", "tm-bf16", 450.0, 550.0),
        run(1, "many", "vllm-bf16", 360.0, 650.0),
    ]
    summary = peers_rounds.summarize_rounds(runs)["many"]
    (c,) = summary["comparisons"]
    assert (c["server"], c["baseline"]) == ("tm-bf16", "vllm-bf16")
    assert c["ratios"] == pytest.approx([1.25, 1.25])
    assert c["verdict"] == "met" and c["rounds_met"] == 2
    assert summary["servers"]["vllm-bf16"]["median_throughput"] == pytest.approx(330.0)
    assert summary["servers"]["vllm-bf16"]["spread"] == pytest.approx(60 / 330)


@pytest.mark.parametrize(
    ("tm", "ttft", "expected"),
    [
        ((380.0, 330.0, 390.0), (500.0, 500.0, 500.0), "split (2 of 3)"),  # one round 1.1x
        ((380.0, 380.0, 380.0), (500.0, 700.0, 500.0), "split (2 of 3)"),  # one TTFT above
        ((310.0, 320.0, 330.0), (500.0, 500.0, 500.0), "missed"),
    ],
)
def test_one_round_short_of_the_target_splits_the_verdict(
    tm: tuple[float, ...], ttft: tuple[float, ...], expected: str
) -> None:
    runs = []
    for r in range(3):
        runs.append(run(r, "long", "vllm-bf16", 300.0, 600.0))
        runs.append(run(r, "long", "tm-bf16", tm[r], ttft[r]))
    (c,) = peers_rounds.summarize_rounds(runs)["long"]["comparisons"]
    assert c["verdict"] == expected


def test_each_comparison_needs_both_servers_in_the_same_round() -> None:
    runs = [
        run(0, "many", "tm-bf16", 400.0, 500.0),
        run(0, "many", "tm-int8", 380.0, 450.0),
        run(1, "many", "tm-bf16", 400.0, 500.0),
        run(1, "many", "vllm-bf16", 300.0, 600.0),  # round 1 only
    ]
    comps = {
        (c["server"], c["baseline"]): c
        for c in peers_rounds.summarize_rounds(runs)["many"]["comparisons"]
    }
    assert set(comps) == {("tm-bf16", "vllm-bf16"), ("tm-int8", "tm-bf16")}
    assert comps[("tm-bf16", "vllm-bf16")]["ratios"] == pytest.approx([400 / 300])
    assert comps[("tm-int8", "tm-bf16")]["verdict"] == "missed"  # int8 >= bf16 is the target


def test_the_report_gives_every_round_and_the_verdict() -> None:
    runs = [
        run(r, "many", s, v, 500.0)
        for r in range(2)
        for s, v in (("vllm-bf16", 300.0), ("tm-bf16", 330.0))
    ]
    data = {
        "servers": ["vllm-bf16", "tm-bf16"],
        "workloads": {"many": FULL_WORKLOADS["many"].describe()},
        "runs": runs,
        "summary": peers_rounds.summarize_rounds(runs),
        "peak_rss_serving_gib": {"tm-bf16": 0.7},
    }
    verified = {"bf16": {"top1_agreement": 0.984, "mean_kl": 0.00055}}
    text = "\n".join(peers_rounds.render_rounds(data, verified))
    assert (
        "| many | tm-bf16 | 330.0 / 330.0 | 330.0 | 0% | 500 / 500 | 0.7 | 98.4% / 0.0006 |" in text
    )
    assert "| many | vllm-bf16 | 300.0 / 300.0 | 300.0 | 0% | 500 / 500 | — |  |" in text
    assert "| many | tm-bf16 / vllm-bf16 | 1.10 / 1.10 | **1.10x** |" in text
    assert "≥ 1.2x, TTFT ≤ | missed |" in text
    assert "32 x (128 -> 64) at 16 streams" in text
    assert "at most 1.0% of one core" in text  # 0.1 s of 10 s
    assert peers_rounds.render_rounds(None) == []


def test_contenders_and_their_order() -> None:
    args = argparse.Namespace(port=8600, round_servers=None)
    ctx = Context(
        args=args,
        out=Path("/nonexistent"),
        workloads=FULL_WORKLOADS,
        dense=Path("/m"),
        moe=Path("/moe"),
        gguf_name="g",
    )
    assert peers_rounds.round_servers(ctx) == ["vllm-bf16", "tm-bf16"]
    ctx.ref_src = Path("/ref/src")
    assert peers_rounds.round_servers(ctx) == ["vllm-bf16", "tm-bf16", "ref-bf16"]
    ref = peers_rounds.contender_command(ctx, "ref-bf16", 8602)
    assert ref[:2] == ["env", "PYTHONPATH=/ref/src"] and "8602" in ref
    assert "8601" in peers_rounds.contender_command(ctx, "tm-int4", 8601)
    assert "8600" in peers_rounds.contender_command(ctx, "vllm-bf16", 8600)
    with pytest.raises(ValueError, match="unknown round server 'llama-f16'"):
        peers_rounds.contender_command(ctx, "llama-f16", 8600)
    assert [peers_rounds.rotated(["a", "b", "c"], r)[0] for r in range(4)] == ["a", "b", "c", "a"]
