"""``bench offline --compare`` and ``verify`` on a tiny fp32 model, in-process.

These drive tokenmill's engine and transformers for real, on the session's tiny Llama
(peaked logits, so greedy parity tests the engine rather than fp32 near-ties).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.bench.cli import register
from tokenmill.bench.datasets import build_random_requests
from tokenmill.bench.offline import OfflineConfig
from tokenmill.bench.offline_backends import TokenmillBackend
from tokenmill.bench.tokenization import load_tokenizer
from tokenmill.bench.verify import run_verify, served_dtype

pytestmark = pytest.mark.slow


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_offline_compare_gives_a_row_per_backend(make_model, tmp_path: Path, capsys) -> None:
    folder = make_model("llama")
    out = tmp_path / "offline.json"
    args = _parser().parse_args(
        [
            "bench",
            "offline",
            "--model",
            str(folder),
            "--compare",
            "--num-rounds",
            "2",
            "--num-warmups",
            "1",
            "--backends",
            "tokenmill,transformers,transformers-cb",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--save-result",
            str(out),
            "--kv-cache",
            "paged,static",
            "--engine-arg",
            "kv_cache_memory=16777216",
            "--engine-arg",
            "max_num_seqs=4",
            "--engine-arg",
            "max_model_len=64",
            "--engine-arg",
            "enforce_eager=true",
        ]
    )
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    rows = {row["label"]: row for row in result["backends"]}
    assert list(rows) == [
        "tokenmill[paged]",
        "tokenmill[static]",
        "transformers[bs=2]",
        "transformers-cb",
    ]
    for name in ("tokenmill[paged]", "tokenmill[static]", "transformers[bs=2]"):
        row = rows[name]
        assert (
            not row["skipped"] and row["completed"] == 8 and row["failed"] == 0
        )  # 4 prompts x 2 rounds
        assert row["total_output_tokens"] == 32  # ignore_eos: every request gives its 4 tokens
        assert (
            row["output_throughput"] > 0 and row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
        )
        assert row["peak_memory_bytes"] >= 0 and len(row["round_output_throughputs"]) == 2
    cb = rows["transformers-cb"]
    assert (cb["skipped"] and cb["note"]) or cb["completed"] == 8
    assert rows["tokenmill[paged]"]["throughput_ratio_vs_baseline"] == pytest.approx(1.0)
    assert rows["tokenmill[static]"]["throughput_ratio_vs_baseline"] > 0
    for label in ("tokenmill[paged]", "tokenmill[static]"):
        assert (
            rows[label]["load_s"] > 0 and rows[label]["compile_time_s"] == 0.0
        )  # enforce_eager: nothing compiled
        # --dtype auto: what `serve` would run here (the dtype rule), not float32 by fiat.
        assert rows[label]["precision"]["dtype"] == served_dtype("demo")
        assert rows[label]["precision"]["quantization"] == "none"
        startup = rows[label]["startup"]
        assert rows[label]["compile_cache"] == "none" and startup["model_load_s"] > 0
        assert startup["kv_allocation_s"] >= 0 and startup["compile_s_by_bucket"] == {}
    # KV reserved vs holding tokens, per step: 4 requests of 8 prompt tokens hold 8, 9, 10, 11
    # tokens over their 4 steps (mean 9.5) in one 16-token block (paged) or a 64-token slot (static).
    paged, static = rows["tokenmill[paged]"], rows["tokenmill[static]"]
    assert paged["kv_used_tokens_mean"] == pytest.approx(4 * 9.5) == static["kv_used_tokens_mean"]
    assert paged["kv_reserved_tokens_mean"] == pytest.approx(4 * 16)
    assert static["kv_reserved_tokens_mean"] == pytest.approx(4 * 64)
    assert paged["kv_waste"] == pytest.approx(1 - 9.5 / 16) and static["kv_waste"] == pytest.approx(
        1 - 9.5 / 64
    )
    assert static["kv_pool_tokens"] == 4 * 64 and paged["kv_pool_tokens"] > 0
    assert "kv_waste" not in rows["transformers[bs=2]"]
    table = capsys.readouterr().out
    assert "tokenmill[static]" in table and "transformers[bs=2]" in table
    assert "40.6%" in table and "85.2%" in table  # the KV waste column


def test_tokenmill_runs_start_with_an_empty_prefix_cache(make_model) -> None:
    folder = make_model("llama")
    config = OfflineConfig(
        model=str(folder), device="cpu", engine_kwargs={"kv_cache_memory": 16 * 2**20}
    )
    backend = TokenmillBackend(config, "paged")
    requests = build_random_requests(
        2, input_len=40, output_len=2, seed=0, tokenizer=load_tokenizer(folder)
    )
    kv_stats = backend.engine.kv_manager.stats
    for _ in range(2):
        records, _ = backend.run(requests)
        assert all(r.success for r in records)
    assert kv_stats.num_hit_tokens == 0  # the second run found nothing cached from the first
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine import batch

    prompts = [r.prompt_token_ids for r in requests]
    batch.generate(backend.engine, ["a", "b"], prompts, [SamplingParams(max_tokens=1)] * 2)
    assert kv_stats.num_hit_tokens > 0  # without the reset these prompts do hit
    backend.close()


def test_verify_passes_on_a_tiny_fp32_model(make_model) -> None:
    report = run_verify(str(make_model("llama")), max_tokens=8, num_prompts=3)
    assert report.passed and report.match_rate == 1.0
    assert report.max_logprob_diff is not None and report.max_logprob_diff < 1e-3


def test_verify_fails_when_the_engine_diverges_on_purpose(make_model, capsys) -> None:
    args = _parser().parse_args(
        [
            "verify",
            "--model",
            str(make_model("llama")),
            "--max-tokens",
            "8",
            "--num-prompts",
            "3",
            "--engine-arg",
            "rope_theta_override=1.0",
            "--dtype",
            "float32",  # token-for-token: the check this test breaks on purpose
        ]
    )
    assert args.func(args) == 1
    printed = capsys.readouterr().out
    assert "diverges at token" in printed and printed.rstrip().endswith("FAIL")
    assert "    transformers: '" in printed and "    tokenmill:    '" in printed  # the text
