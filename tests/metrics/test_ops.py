"""``metrics/ops.py``: start-up costs and the engine-dead flag as Prometheus gauges."""

from __future__ import annotations

from tokenmill.core.stats import EngineStats, StartupCosts
from tokenmill.metrics import ServerMetrics
from tokenmill.metrics.ops import install_ops_metrics


def test_start_up_costs_carry_the_compile_cache_state() -> None:
    metrics = ServerMetrics("m", 1024, lambda: EngineStats())
    costs = StartupCosts(
        model_load_s=1.5,
        kv_allocation_s=0.25,
        compile_s_by_bucket={1: 10.0, 2: 3.0},
        compile_cache_by_bucket={1: "cold", 2: "warm"},
        total_s=15.0,
    )
    install_ops_metrics(metrics, is_dead=lambda: True, read_startup=lambda: costs)
    sample = metrics.registry.get_sample_value
    cold = {"model_name": "m", "compile_cache": "cold"}
    assert sample("tokenmill:startup_seconds", cold) == 15.0
    assert sample("tokenmill:startup_model_load_seconds", cold) == 1.5
    assert sample("tokenmill:startup_kv_allocation_seconds", cold) == 0.25
    by_bucket = {"model_name": "m", "bucket": "1", "cache": "cold"}
    assert sample("tokenmill:startup_compile_seconds", by_bucket) == 10.0
    assert (
        sample("tokenmill:startup_compile_seconds", {**by_bucket, "bucket": "2", "cache": "warm"})
        == 3.0
    )
    assert sample("tokenmill:engine_dead", {"model_name": "m"}) == 1.0
    assert costs.as_dict()["compile_cache"] == "cold" and costs.compile_s == 13.0


def test_nothing_about_start_up_while_loading() -> None:
    metrics = ServerMetrics("m", 1024, lambda: EngineStats())
    install_ops_metrics(metrics, is_dead=lambda: False, read_startup=lambda: None)
    text = metrics.render().decode()
    assert 'tokenmill:engine_dead{model_name="m"} 0.0' in text
    assert "tokenmill:startup_seconds{" not in text
