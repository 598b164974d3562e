"""``tokenmill plan``: its figures are the ones the engine allocates for the same load."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.plan import PlanInputs, build_plan
from tokenmill.model import sizing
from tokenmill.model.config import ModelConfig
from tokenmill.model.demo import demo_model_path
from tokenmill.model.layers import Linear


def engine_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every parameter, buffer and prepacked weight (oneDNN or GEMV) the model holds."""
    model = engine.runner.model
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:  # a tied LM head shares the embedding
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    for linear in model.modules():
        if isinstance(linear, Linear):
            for packed in (linear.packed, linear.gemv):
                if packed is not None:
                    total += packed.numel() * packed.element_size()
    return total


@pytest.mark.parametrize(
    ("dtype", "kv_cache", "max_num_seqs", "precision"),
    [
        ("float32", "paged", 8, {}),
        ("bfloat16", "paged", 8, {}),
        ("float32", "static", 2, {}),
        ("bfloat16", "paged", 8, {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3"}),
        ("float32", "paged", 8, {"quantization": "int4", "quantization_group_size": 32}),
    ],
)
def test_plan_equals_what_the_engine_allocates(
    dtype: str, kv_cache: str, max_num_seqs: int, precision: dict
) -> None:
    kv_bytes, max_model_len = 2**20, 256
    engine = LLMEngine(
        EngineConfig(
            dtype=dtype,  # type: ignore[arg-type]
            kv_cache=kv_cache,  # type: ignore[arg-type]
            kv_cache_memory=kv_bytes,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            **precision,
        )
    )
    plan = build_plan(
        PlanInputs(
            "demo",
            max_model_len,
            max_num_seqs,
            dtype=dtype,
            kv_cache=kv_cache,
            kv_cache_memory=kv_bytes,
            **precision,
        )
    )
    allocated_kv = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    assert plan.weight_bytes == engine_weight_bytes(engine)
    assert plan.num_blocks == engine.kv_manager.num_blocks
    assert plan.kv_pool_bytes == allocated_kv
    assert plan.kv_bytes_per_token * plan.num_blocks * 16 == engine.kv_cache_bytes
    assert plan.max_concurrency == kv_bytes // (plan.kv_bytes_per_token * max_model_len)


def test_static_that_cannot_start_says_so_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--max-model-len", "256", "--concurrency", "64", "--kv-cache", "static"]
    assert main([*argv, "--kv-cache-memory", "1MiB", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "fits             no" in out and "lower --max-num-seqs" in out
    assert "largest concurrency at 256 tokens: 2" in out


def test_paged_reports_expected_and_worst_case_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--max-model-len", "256", "--concurrency", "4", "--json", "--dtype", "float32"]
    assert main([*argv, "--kv-cache-memory", "4MiB", "--mean-seq-len", "64"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["worst_case_bytes"] == 4 * 256 * plan["kv_bytes_per_token"]
    assert plan["expected_bytes"] == 4 * 64 * plan["kv_bytes_per_token"]
    assert plan["fits"] and plan["max_context"] == 512  # the demo model's own limit


def test_kv_dtype_and_quantization_bytes() -> None:
    assert sizing.kv_cache_dtype_bytes("auto", "bfloat16") == 2
    assert sizing.kv_cache_dtype_bytes("fp8_e4m3", "bfloat16") == 1
    assert sizing.kv_cache_dtype_bytes("fp8_e5m2", "float32") == 1
    assert sizing.kv_cache_dtype_bytes("float16", "float32") == 2
    assert sizing.projection_weight_bytes(64, 256, 2) == 64 * 256 * 2
    assert sizing.projection_weight_bytes(64, 256, 2, "int8") == 64 * 256 + 64 * (4 + 2)
    # int4, groups of 128: packed codes, then bf16 scale + zero and an fp32 offset per group
    assert sizing.projection_weight_bytes(64, 256, 2, "int4", 128) == 64 * 128 + 64 * 2 * (4 + 4)
    # the default, groups of 32: four times the groups
    assert sizing.projection_weight_bytes(64, 256, 2, "int4") == 64 * 128 + 64 * 8 * (4 + 4)
    # tokenmill's kernels: rows (fp32 scales, int32 sums) or AMX tiles (padded, blocked by 16)
    assert sizing.projection_weight_bytes(40, 70, 2, "int8", layout="rows") == 40 * 70 + 40 * 8
    assert sizing.projection_weight_bytes(40, 70, 2, "int8", layout="amx") == (
        48 * 128 + 40 * 4 + 48 * 8
    )
    assert sizing.projection_weight_bytes(40, 70, 2, "int4", 64, layout="amx") == (
        48 * 128 // 2 + 40 * 2 * 8 + 3 * 48 * 2 * 4
    )
    for method, group in (("int8", 128), ("int4", 64)):  # VNNI reads the same tiles
        assert sizing.projection_weight_bytes(
            40, 70, 2, method, group, layout="vnni"
        ) == sizing.projection_weight_bytes(40, 70, 2, method, group, layout="amx")
    cfg = ModelConfig.from_folder(demo_model_path())
    per_token = sizing.kv_bytes_per_token(cfg, 1)
    assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    full = sizing.weight_bytes(cfg, "bfloat16", 256)
    assert (
        sizing.weight_bytes(cfg, "bfloat16", 256, "int4")
        < sizing.weight_bytes(cfg, "bfloat16", 256, "int8")
        < full
    )
    assert torch.float8_e4m3fn.itemsize == sizing.DTYPE_BYTES["fp8_e4m3"]


def test_gpu_budget_formula_the_engine_and_planner_share() -> None:
    gib = 2**30
    # Default: 90% of 80 GiB, less what is used (16 GiB of weights) and 1 GiB of headroom.
    assert sizing.kv_budget_from_memory(None, 80 * gib, 64 * gib, 0.9) == int(72 * gib) - 17 * gib
    assert sizing.kv_budget_from_memory(0.5, 80 * gib, 64 * gib, 0.9) == 32 * gib  # of free
    assert sizing.kv_budget_from_memory(4 * gib, 80 * gib, 64 * gib, 0.9) == 4 * gib
    assert sizing.kv_budget_from_memory(None, 8 * gib, 0, 0.9) == 0
    plan = build_plan(
        PlanInputs("demo", 256, 4, dtype="float32", memory_bytes=80 * gib, device="cuda")
    )
    weights = plan.weight_bytes
    assert plan.kv_budget_bytes == int(72 * gib) - weights - gib


@pytest.mark.parametrize(
    ("family", "dtype", "quantization"),
    [
        ("qwen2_moe", "float32", None),
        ("mixtral", "bfloat16", "int8"),
        ("qwen3_moe", "float32", "int4"),
        ("gemma3", "bfloat16", None),
        ("phi3", "float32", "int8"),
    ],
)
def test_weight_bytes_of_new_families_are_what_the_engine_holds(
    make_model, family: str, dtype: str, quantization: str | None
) -> None:
    """Sizing derives from the registry's layout: experts, shared experts, per-layer RoPE."""
    folder = make_model(family)
    kwargs = {} if quantization is None else {"quantization": quantization}
    if quantization == "int4":
        kwargs["quantization_group_size"] = 32
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype=dtype, max_model_len=128, **kwargs)  # type: ignore[arg-type]
    )
    cfg = ModelConfig.from_folder(folder)
    group_size = kwargs.get("quantization_group_size", 32)
    layouts = {}
    if quantization is not None:  # stored as the kernel that serves them reads them
        from tokenmill.model.quant import kernel_layout

        layouts = {
            "layout": kernel_layout(quantization, group_size),
            "head_layout": kernel_layout("int8", group_size),
        }
    want = sizing.weight_bytes(cfg, dtype, 128, quantization, group_size, **layouts)
    assert engine_weight_bytes(engine) == want


def test_by_default_the_plan_is_for_this_machine_and_what_serve_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --memory: this machine's memory (a CPU here: no nvidia-smi), the dtype serve's
    --dtype auto picks on it, and the CPU KV budget the engine computes; stdout is the table."""
    import psutil

    from tokenmill.entrypoints import plan as plan_module
    from tokenmill.model.loader import resolve_dtype

    monkeypatch.setattr(plan_module, "_gpu_memory_bytes", lambda: None)
    monkeypatch.setattr(plan_module, "_cgroup_memory_limit", lambda: None)
    plan = build_plan(PlanInputs("demo", 256, 4))
    assert plan.device == "cpu" and "available memory" in plan.memory_source
    assert abs(plan.memory_bytes - psutil.virtual_memory().available) < 2**30
    served = resolve_dtype("auto", ModelConfig.from_folder(demo_model_path()), torch.device("cpu"))
    assert plan.dtype == str(served).removeprefix("torch.")
    free = plan.memory_bytes - plan.weight_bytes
    assert plan.kv_budget_bytes == sizing.cpu_kv_budget(None, free) <= 4 * 2**30
    assert main(["plan", "--max-model-len", "256", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model            demo (" + plan.dtype)
    assert out[1].startswith("memory ") and "on cpu: this machine's available memory" in out[1]
    assert all(len(line) > 17 and line[:17].rstrip() for line in out)  # table rows only


def test_a_cgroup_limit_below_available_memory_is_the_plans_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenmill.entrypoints import plan as plan_module

    monkeypatch.setattr(plan_module, "_gpu_memory_bytes", lambda: None)
    monkeypatch.setattr(plan_module, "_cgroup_memory_limit", lambda: 3 * 2**30)
    machine = plan_module.this_machine()
    assert (machine.device, machine.memory_bytes) == ("cpu", 3 * 2**30)
    assert "cgroup" in machine.source
    monkeypatch.setattr(plan_module, "_gpu_memory_bytes", lambda: 80 * 2**30)
    assert plan_module.this_machine().device == "cuda"
    assert plan_module.this_machine("cpu").device == "cpu"
