"""Offline bench plumbing that needs no engine: config, memory meter, table, ratios, warm-ups."""

from __future__ import annotations

import mmap
from typing import Any

import pytest

from tokenmill.bench import offline
from tokenmill.bench.datasets import BenchRequest, build_random_requests
from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.offline import (
    BackendResult,
    MemoryMeter,
    OfflineConfig,
    _build_result,
    format_offline_table,
    run_offline_benchmark,
)


def _round(tokens_per_request: int, duration_s: float) -> tuple[list[RequestRecord], float]:
    records = [
        RequestRecord(
            i,
            success=True,
            prompt_tokens=8,
            output_tokens=tokens_per_request,
            ttft_s=0.1,
            e2e_s=0.1 + 0.01 * (tokens_per_request - 1),
        )
        for i in range(4)
    ]
    return records, duration_s


def test_config_rejects_unknown_backends() -> None:
    with pytest.raises(ValueError, match="unknown backends"):
        OfflineConfig(backends=("tokenmill", "llama.cpp"))
    assert OfflineConfig(device="cpu").resolved_device == "cpu"


def test_config_gives_a_tokenmill_row_per_kv_strategy() -> None:
    config = OfflineConfig(backends=("tokenmill", "transformers"), kv_caches=("paged", "static"))
    assert config.rows == [("tokenmill", "paged"), ("tokenmill", "static"), ("transformers", None)]
    for bad in ((), ("paged", "paged"), ("ring",)):
        with pytest.raises(ValueError, match="kv_caches"):
            OfflineConfig(kv_caches=bad)
    with pytest.raises(ValueError, match="may not set kv_cache"):
        OfflineConfig(engine_kwargs={"kv_cache": "static"})


def test_memory_meter_sees_rss_growth() -> None:
    meter = MemoryMeter("cpu")
    with meter.peak_growth() as box:
        # A fresh anonymous mapping: malloc could hand back already-resident heap pages.
        blob = mmap.mmap(-1, 64 * 2**20)
        for offset in range(0, len(blob), mmap.PAGESIZE):
            blob[offset] = 1  # touch every page so it is resident
    blob.close()
    assert meter.kind == "rss"
    assert box["growth_bytes"] >= 32 * 2**20


def test_result_rows_and_median_ratio_per_round() -> None:
    fast = BackendResult(
        "tokenmill", label="tokenmill[paged]", load_memory_bytes=2**20, run_memory_bytes=2**20
    )
    slow = BackendResult("transformers", label="transformers[bs=8]")
    skipped = BackendResult(
        "transformers-cb", skipped_reason="transformers 4.0 has no continuous batching"
    )
    for d_fast, d_slow in ((1.0, 2.0), (1.0, 4.0), (1.0, 3.0)):
        fast.rounds.append(_round(10, d_fast))
        slow.rounds.append(_round(10, d_slow))
    result = _build_result(
        OfflineConfig(device="cpu", compare=True), [fast, slow, skipped], "rss", {"x": 1}
    )
    rows = {row["backend"]: row for row in result["backends"]}
    assert rows["tokenmill"]["output_throughput"] == pytest.approx(120 / 3.0)
    assert rows["tokenmill"]["throughput_ratio_vs_baseline"] == pytest.approx(1.0)
    assert rows["transformers"]["throughput_ratio_vs_baseline"] == pytest.approx(
        1 / 3
    )  # median of 1/2, 1/4, 1/3
    assert rows["tokenmill"]["median_itl_ms"] is None  # no per-token times offline
    assert rows["tokenmill"]["peak_memory_bytes"] == 2 * 2**20
    assert (
        rows["transformers-cb"]["skipped"]
        and "no continuous batching" in rows["transformers-cb"]["note"]
    )
    table = format_offline_table(result)
    assert "tokenmill[paged]" in table and "0.33x" in table and "skipped: transformers 4.0" in table
    assert "interleaved, 3 rounds" in table


class _RecordingBackend:
    """Completes every request instantly and remembers which prompts each run got."""

    def __init__(self, label: str, compile_time_s: float | None) -> None:
        self.label = label
        self.compile_time_s = compile_time_s
        self.runs: list[list[tuple[int, ...]]] = []

    def unavailable_reason(self) -> str | None:
        return None

    def load_figures(self) -> dict[str, Any]:
        return {} if self.compile_time_s is None else {"compile_time_s": self.compile_time_s}

    def run_figures(self) -> dict[str, Any]:
        return {"runs_so_far": len(self.runs)}

    def prepare(self, requests: list[BenchRequest]) -> None:
        return None

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        self.runs.append([tuple(r.prompt_token_ids) for r in requests])
        records = [
            RequestRecord(
                i,
                success=True,
                prompt_tokens=r.prompt_len,
                output_tokens=r.output_len,
                ttft_s=0.01,
                e2e_s=0.02,
            )
            for i, r in enumerate(requests)
        ]
        return records, 0.1

    def close(self) -> None:
        return None


@pytest.mark.parametrize("compare", [False, True])
def test_warmups_never_reuse_measured_prompts(
    monkeypatch: pytest.MonkeyPatch, compare: bool
) -> None:
    made: dict[str, _RecordingBackend] = {}

    def make_backend(
        name: str, config: OfflineConfig, kv_cache: str | None = None
    ) -> _RecordingBackend:
        label = f"{name}[{kv_cache}]" if kv_cache else f"{name}[bs={config.batch_size}]"
        made[label] = _RecordingBackend(
            label, 1.5 if kv_cache == "static" else (0.0 if kv_cache else None)
        )
        return made[label]

    monkeypatch.setattr(offline, "make_backend", make_backend)
    requests = build_random_requests(
        4, input_len=16, output_len=3, range_ratio=0.5, vocab_size=100, seed=0
    )
    config = OfflineConfig(
        backends=("tokenmill", "transformers"),
        kv_caches=("paged", "static"),
        device="cpu",
        compare=compare,
        num_rounds=2,
        num_warmups=3,
    )
    result = run_offline_benchmark(config, requests, log=lambda _: None)
    measured = [tuple(r.prompt_token_ids) for r in requests]
    assert list(made) == ["tokenmill[paged]", "tokenmill[static]", "transformers[bs=8]"]
    for backend in made.values():
        warmup, *rounds = backend.runs
        assert len(rounds) == 2 and all(
            run == measured for run in rounds
        )  # back to back without compare
        assert len(warmup) == 3 and not set(warmup) & set(measured)
        assert [len(p) for p in warmup] == [len(p) for p in measured[:3]]  # same shapes
    rows = {row["label"]: row for row in result["backends"]}
    assert (
        rows["tokenmill[static]"]["compile_time_s"] == 1.5
        and rows["tokenmill[static]"]["kv_cache"] == "static"
    )
    assert (
        rows["tokenmill[paged]"]["compile_time_s"] == 0.0
        and "compile_time_s" not in rows["transformers[bs=8]"]
    )
    assert all(row["load_s"] >= 0 for row in rows.values())
    # Run figures are averaged over measured rounds only: the warm-up was run 1.
    assert all(row["runs_so_far"] == 2.5 for row in rows.values())
    assert result["num_rounds"] == 2 and all(len(row["rounds"]) == 2 for row in rows.values())
    assert rows["tokenmill[static]"]["throughput_ratio_vs_baseline"] == pytest.approx(
        1.0
    )  # keyed by row, not backend
    table = format_offline_table(result)
    assert "compile s" in table and "tokenmill[static]" in table
