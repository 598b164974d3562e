"""Phi-3 and the mixture-of-experts families from GGUF files as llama.cpp writes them
(``tests/gguf_fixture.py``): Phi-3's fused ``attn_qkv`` and ``ffn_up`` ([gate|up]), the
experts of Qwen2-MoE and Qwen3-MoE stacked per layer (``ffn_{gate,up,down}_exps``, read one
expert at a time), Qwen2-MoE's shared expert and its ``[hidden]`` gate. Each greedy run
matches transformers' GGUF load of the same file in float32, and the quantized blocks run
on the int kernels as they are. What transformers cannot read from a GGUF file (OLMo 2,
Mixtral, LongRoPE Phi-3, other expert widths) is refused at start-up in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gguf_fixture import hf_weights, model_overrides, to_gguf_tensors, write_gguf
from tests.model.test_gguf_fixtures import PROMPTS, _hf_gguf_greedy
from tests.model.test_gguf_native import _weight
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_checks import check_gguf_file
from tokenmill.model.quant import Int4Linear, Int8Linear, QuantizedLinear

gguf = pytest.importorskip("gguf")

FAMILIES = ["phi3", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "tm-cache"))


@pytest.fixture(scope="module")
def gguf_file(make_model, tmp_path_factory):
    """``gguf_file(family, qtype) -> (hf folder, gguf path)``, written once per module."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}
    out = tmp_path_factory.mktemp("gguf-families")

    def get(family: str, qtype: str) -> tuple[Path, Path]:
        if (family, qtype) not in cache:
            folder = make_model(family, **model_overrides(family, qtype))
            path = write_gguf(folder, out / f"{family}-{qtype}.gguf", family, qtype)
            cache[family, qtype] = (folder, path)
        return cache[family, qtype]

    return get


def test_experts_are_stacked_per_layer_as_llama_cpp_writes_them(gguf_file) -> None:
    folder, path = gguf_file("qwen2_moe", "F32")
    hf = hf_weights(folder)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert [int(d) for d in reversed(gate.shape.tolist())] == [4, 1408, 64]
    assert [int(d) for d in reversed(tensors["blk.1.ffn_down_exps.weight"].shape)] == [4, 64, 1408]
    np.testing.assert_array_equal(
        np.asarray(gate.data)[2], hf["model.layers.1.mlp.experts.2.gate_proj.weight"]
    )
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == [64]  # [1, 64] in HF
    phi3 = to_gguf_tensors(gguf_file("phi3", "F32")[0], "phi3")
    assert phi3["blk.0.attn_qkv.weight"].shape == (64 + 2 * 32, 64)
    assert phi3["blk.0.ffn_up.weight"].shape == (2 * 128, 64)  # [gate|up], one tensor
    assert not any(".ffn_gate." in name for name in phi3)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_parity_with_transformers_gguf_load(gguf_file, family: str) -> None:
    from tokenmill import LLM, SamplingParams

    _, path = gguf_file(family, "F32")
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == _hf_gguf_greedy(path, prompts, 8)


CASES = [
    ("phi3", "Q4_0", Int4Linear),
    ("phi3", "Q8_0", Int8Linear),
    ("qwen2_moe", "Q4_0", Int4Linear),
    ("qwen3_moe", "Q8_0", Int8Linear),
]


def _projections(llm) -> dict[str, torch.nn.Module]:
    """Every projection of the layers but the routers (kept in float, as llama.cpp does)."""
    model = llm.engine.executor.driver_worker.model
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith("layers.")
        and hasattr(module, "out_features")
        and not name.endswith(("router", "shared_expert_gate"))
    }


@pytest.mark.parametrize(("family", "qtype", "kind"), CASES)
def test_quantized_blocks_run_as_they_are(gguf_file, family, qtype, kind) -> None:
    from tokenmill import LLM, SamplingParams

    _, path = gguf_file(family, qtype)
    native = LLM(str(path), max_model_len=64)
    reference = LLM(str(path), dtype="float32", max_model_len=64)
    ours, theirs = _projections(native), _projections(reference)
    assert ours.keys() == theirs.keys() and ours
    if family != "phi3":
        assert any(".experts.3." in name for name in ours)
    for name, module in ours.items():
        assert isinstance(module, kind), (name, type(module))
        assert not isinstance(theirs[name], QuantizedLinear), name
        want = _weight(theirs[name], module.in_features)
        got = module.dequantize(torch.float32)
        if kind is Int4Linear:  # the file's own codes, scales and offsets
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        else:  # one scale per channel: within half a step of it
            step = module.scales[:, None]
            assert ((got - want).abs() <= step / 2 + 1e-6).all(), name
    out = native.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def _refused(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_gguf_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def test_olmo2_is_refused_for_want_of_a_reference(make_model, tmp_path) -> None:
    path = write_gguf(make_model("olmo2"), tmp_path / "olmo2.gguf", "olmo2")
    assert _refused(path).startswith(
        "architecture 'olmo2' is not supported (transformers' GGUF reader has no olmo2 mapping)"
    )


def test_mixtral_is_refused_for_want_of_a_reference(make_model, tmp_path) -> None:
    path = write_gguf(make_model("mixtral"), tmp_path / "mixtral.gguf", "mixtral")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.0.ffn_gate_inp.weight" in names
    assert _refused(path) == (
        "a llama file with 4 experts (Mixtral) is not supported: transformers' GGUF reader "
        "loads llama files as a dense Llama, so there is no reference load"
    )


def test_expert_widths_transformers_does_not_read_are_refused(make_model, tmp_path) -> None:
    folder = make_model("qwen3_moe")  # moe_intermediate_size 32
    path = write_gguf(folder, tmp_path / "q3moe.gguf", "qwen3_moe")
    assert _refused(path) == (
        "qwen3moe.expert_feed_forward_length is 32, but transformers' GGUF reader does not "
        "read it and assumes 768; only qwen3moe files of those widths are supported"
    )


def test_longrope_phi3_is_refused(make_model, tmp_path) -> None:
    path = write_gguf(make_model("phi3"), tmp_path / "phi3-long.gguf", "phi3")  # LongRoPE
    assert _refused(path) == (
        "a phi3 file with LongRoPE factors (rope_factors_long.weight, "
        "rope_factors_short.weight) is not supported: transformers' GGUF reader drops them "
        "and would run plain RoPE"
    )


def test_partial_rotary_phi3_is_refused(make_model, tmp_path) -> None:
    over = model_overrides("phi3")
    over["rope_parameters"] = {**over["rope_parameters"], "partial_rotary_factor": 0.5}
    path = write_gguf(make_model("phi3", **over), tmp_path / "phi3-partial.gguf", "phi3")
    assert _refused(path) == (
        "phi3.rope.dimension_count is 8, not the head size 16: transformers' GGUF reader "
        "does not read it and would rotate whole heads"
    )
