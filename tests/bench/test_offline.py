"""Offline bench plumbing that needs no engine: config, memory meter, table, ratios."""

from __future__ import annotations

import pytest

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.offline import (
    BackendResult,
    MemoryMeter,
    OfflineConfig,
    _build_result,
    format_offline_table,
)


def _round(tokens_per_request: int, duration_s: float) -> tuple[list[RequestRecord], float]:
    records = [RequestRecord(i, success=True, prompt_tokens=8, output_tokens=tokens_per_request, ttft_s=0.1,
                             e2e_s=0.1 + 0.01 * (tokens_per_request - 1)) for i in range(4)]
    return records, duration_s


def test_config_rejects_unknown_backends() -> None:
    with pytest.raises(ValueError, match="unknown backends"):
        OfflineConfig(backends=("tokenmill", "llama.cpp"))
    assert OfflineConfig(device="cpu").resolved_device == "cpu"


def test_memory_meter_sees_rss_growth() -> None:
    meter = MemoryMeter("cpu")
    with meter.peak_growth() as box:
        blob = bytearray(64 * 2**20)
        blob[::4096] = b"x" * len(blob[::4096])  # touch every page so it is resident
    del blob
    assert meter.kind == "rss"
    assert box["growth_bytes"] >= 32 * 2**20


def test_result_rows_and_median_ratio_per_round() -> None:
    fast = BackendResult("tokenmill", label="tokenmill[paged]", load_memory_bytes=2**20, run_memory_bytes=2**20)
    slow = BackendResult("transformers", label="transformers[bs=8]")
    skipped = BackendResult("transformers-cb", skipped_reason="transformers 4.0 has no continuous batching")
    for d_fast, d_slow in ((1.0, 2.0), (1.0, 4.0), (1.0, 3.0)):
        fast.rounds.append(_round(10, d_fast))
        slow.rounds.append(_round(10, d_slow))
    result = _build_result(OfflineConfig(device="cpu", compare=True), [fast, slow, skipped], "rss", {"x": 1})
    rows = {row["backend"]: row for row in result["backends"]}
    assert rows["tokenmill"]["output_throughput"] == pytest.approx(120 / 3.0)
    assert rows["tokenmill"]["throughput_ratio_vs_baseline"] == pytest.approx(1.0)
    assert rows["transformers"]["throughput_ratio_vs_baseline"] == pytest.approx(1 / 3)  # median of 1/2, 1/4, 1/3
    assert rows["tokenmill"]["median_itl_ms"] is None  # no per-token times offline
    assert rows["tokenmill"]["peak_memory_bytes"] == 2 * 2**20
    assert rows["transformers-cb"]["skipped"] and "no continuous batching" in rows["transformers-cb"]["note"]
    table = format_offline_table(result)
    assert "tokenmill[paged]" in table and "0.33x" in table and "skipped: transformers 4.0" in table
    assert "interleaved, 3 rounds" in table
