"""Loader: sharded checkpoints, dtypes, and clear errors naming the file and tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import anon_rss_bytes
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu import CPUInfo
from tokenmill.model.loader import load_model, resolve_dtype

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def model_copy(make_model, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(make_model("llama"), dst)
    return dst


def _load(folder: Path):
    return load_model(folder, torch.float32, torch.device("cpu"), 64)


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_sharded_checkpoint_loads_and_matches(model_copy: Path, make_model) -> None:
    tensors = load_file(model_copy / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_copy / shard)
    (model_copy / "model.safetensors").unlink()
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [[5, 6, 7, 8]]
    sharded = LLM(str(model_copy), dtype="float32", max_model_len=64).generate(
        prompt, GREEDY, use_tqdm=False
    )
    single = LLM(str(make_model("llama")), dtype="float32", max_model_len=64).generate(
        prompt, GREEDY, use_tqdm=False
    )
    assert sharded[0].outputs[0].token_ids == single[0].outputs[0].token_ids


def test_unknown_architecture_lists_supported(model_copy: Path) -> None:
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"
    ):
        ModelConfig.from_folder(model_copy)


def test_missing_tensor_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        _load(model_copy)


def test_unexpected_tensor_is_named_with_file(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.extra\.weight'"
    ):
        _load(model_copy)


def test_shape_mismatch_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(3,\), expected \(64,\)",
    ):
        _load(model_copy)


def test_corrupt_safetensors_names_the_file(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or unreadable"):
        _load(model_copy)


def test_missing_tokenizer_is_reported(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        LLM(str(model_copy), dtype="float32", max_model_len=64)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ModelConfig.from_folder(tmp_path)


@pytest.mark.parametrize(
    ("flags", "avx2_kernels", "want", "logged"),
    [
        ({"avx512_bf16"}, False, torch.bfloat16, "bfloat16, which this CPU computes natively"),
        ({"amx_bf16"}, False, torch.bfloat16, "bfloat16, which this CPU computes natively"),
        ({"avx2"}, True, torch.bfloat16, "bfloat16, whose weights tokenmill's AVX2 kernels read"),
        ({"avx2"}, False, torch.float32, "float32, as this CPU has no bf16 dot products"),
    ],
)
def test_dtype_auto_runs_bf16_where_the_cpu_or_the_kernels_make_it_fast(
    model_copy: Path, caplog, monkeypatch: pytest.MonkeyPatch, flags, avx2_kernels, want, logged
) -> None:
    """bf16 with bf16 hardware, or on AVX2 where tokenmill's kernels read bf16 weights (and
    compute in fp32); fp32 where neither (no compiler for the kernels, another CPU)."""
    info = CPUInfo("AVX512", frozenset(flags), 2)
    monkeypatch.setattr("tokenmill.model.loader.cpu_info", lambda: info)
    monkeypatch.setattr("tokenmill.model.loader._kernels_read_bf16", lambda: avx2_kernels)
    raw = json.loads((model_copy / "config.json").read_text())
    for declared in ("bfloat16", "float16"):
        cfg = ModelConfig.from_dict({**raw, "torch_dtype": declared})
        with caplog.at_level("INFO"):
            assert resolve_dtype("auto", cfg, torch.device("cpu")) == want
        assert logged in caplog.text
        assert resolve_dtype("bfloat16", cfg, torch.device("cpu")) == torch.bfloat16
    cfg = ModelConfig.from_dict({**raw, "torch_dtype": "float32"})
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == want  # fp32 too, as vLLM does
    assert resolve_dtype("float32", cfg, torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    ("flags", "want"), [({"avx512_bf16"}, torch.bfloat16), ({"avx2"}, torch.float32)]
)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dtype_auto_runs_a_quantized_fp32_checkpoint_in_bf16_where_the_cpu_has_bf16(
    model_copy: Path, caplog, monkeypatch: pytest.MonkeyPatch, flags, want, method: str
) -> None:
    info = CPUInfo("AVX512", frozenset(flags), 2)
    monkeypatch.setattr("tokenmill.model.loader.cpu_info", lambda: info)
    monkeypatch.setattr("tokenmill.model.loader._kernels_read_bf16", lambda: False)
    raw = json.loads((model_copy / "config.json").read_text())
    cfg = ModelConfig.from_dict({**raw, "torch_dtype": "float32"})
    with caplog.at_level("INFO"):
        assert resolve_dtype("auto", cfg, torch.device("cpu"), method) == want
    if want == torch.bfloat16:
        assert "checkpoint is float32; using bfloat16" in caplog.text  # logged, with why
    assert resolve_dtype("float32", cfg, torch.device("cpu"), method) == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(make_model, dtype: str) -> None:
    llm = LLM(str(make_model("qwen2")), dtype=dtype, max_model_len=64)
    assert next(llm.engine.runner.model.parameters()).dtype == getattr(torch, dtype)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6


def test_weights_arrive_fused_and_converted(model_copy: Path) -> None:
    """bf16 checkpoint read as float16: every value is the stored one, q/k/v and gate/up in order."""
    stored = {
        k: v.to(torch.bfloat16) for k, v in load_file(model_copy / "model.safetensors").items()
    }
    save_file(stored, model_copy / "model.safetensors")
    model = load_model(model_copy, torch.float16, torch.device("cpu"), 64, prepack=False)
    layer = model.layers[1]
    p = "model.layers.1."
    expect_qkv = torch.cat([stored[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).to(
        torch.float16
    )
    expect_gate_up = torch.cat([stored[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]).to(
        torch.float16
    )
    assert torch.equal(layer.attn.qkv.weight, expect_qkv)
    assert torch.equal(layer.mlp.gate_up.weight, expect_gate_up)
    assert torch.equal(model.embed, stored["model.embed_tokens.weight"].to(torch.float16))
    assert torch.equal(
        layer.input_norm.weight, stored[p + "input_layernorm.weight"].to(torch.float16)
    )


def test_truncated_tensor_data_names_the_file(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: (corrupt or unreadable|tensor .* is truncated)"
    ):
        _load(model_copy)


def _bf16_logits(folder: Path) -> tuple[torch.Tensor, list]:
    from tokenmill.model.layers import Linear

    model = load_model(folder, torch.bfloat16, torch.device("cpu"), 64)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = model.compute_logits(hidden.to(torch.bfloat16))
    return logits, [m.gemv is not None for m in model.modules() if isinstance(m, Linear)]


def test_bf16_projections_take_the_gemv_layout_unless_told_not_to(
    make_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 projections stream tokenmill's GEMV blocks at every batch size; the env var keeps
    oneDNN's layout; both give the same products."""
    from tokenmill import kernels
    from tokenmill.model.layers import GEMV_ENV

    if not kernels.available() or not kernels.active_isa().startswith("avx512_bf16"):
        pytest.skip("the GEMV layout is used with the AVX-512 BF16 kernels only")
    monkeypatch.delenv(GEMV_ENV, raising=False)
    folder = make_model("llama", dtype="bfloat16")
    gemv, packed = _bf16_logits(folder)
    assert all(packed)
    monkeypatch.setenv(GEMV_ENV, "0")
    onednn, packed = _bf16_logits(folder)
    assert not any(packed)
    assert (gemv - onednn).abs().max() <= 2e-2 * onednn.abs().max()


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_quantizing_at_load_leaves_only_the_weights_resident(make_model) -> None:
    """The source copies freed while quantizing go back to the OS: without the loader's
    heap trim this test fails (glibc keeps freed holes resident; before quantizing in row
    blocks too, this load kept ~7x its int8 weights)."""
    from tokenmill.model.host_memory import trim_freed_heap

    folder = make_model(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    if not trim_freed_heap():
        pytest.skip("no glibc malloc_trim here")
    before = anon_rss_bytes()
    model = load_model(folder, torch.bfloat16, torch.device("cpu"), 256, quantization="int8")
    grown = anon_rss_bytes() - before
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert grown < 1.5 * held + 8 * 2**20, (grown / 2**20, held / 2**20)
