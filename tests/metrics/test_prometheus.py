"""``/metrics`` exporter: router statistics of a mixture-of-experts engine."""

from __future__ import annotations

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.metrics import ServerMetrics


def test_moe_routed_tokens_per_layer_and_expert_are_exported(make_model) -> None:
    llm = LLM(str(make_model("qwen3_moe")), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    stats = llm.engine.stats
    metrics = ServerMetrics("moe", 64, lambda: stats)
    sample = metrics.registry.get_sample_value
    total = 0.0
    for layer in range(2):
        for expert in range(4):
            labels = {"model_name": "moe", "layer": str(layer), "expert": str(expert)}
            value = sample("tokenmill:moe_routed_tokens_total", labels)
            assert value == stats.moe_tokens_per_expert[layer][expert]
            total += value or 0.0
    assert total == 2 * 2 * (4 + 2)  # 2 layers, top-2, 4 prompt tokens + 2 decode steps


def test_dense_models_export_no_router_series(make_model) -> None:
    llm = LLM(str(make_model("llama")), dtype="float32", max_model_len=64)
    stats = llm.engine.stats
    text = ServerMetrics("dense", 64, lambda: stats).render().decode()
    assert "moe_routed_tokens" not in text
