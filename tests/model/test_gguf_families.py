"""Phi-3 and the mixture-of-experts families from GGUF files as llama.cpp writes them
(``tests/gguf_fixture.py``): Phi-3's fused ``attn_qkv`` and ``ffn_up`` ([gate|up]), the
experts of Qwen2-MoE and Qwen3-MoE stacked per layer (``ffn_{gate,up,down}_exps``, read one
expert at a time), Qwen2-MoE's shared expert and its ``[hidden]`` gate. Each greedy run
matches transformers' GGUF load of the same file in float32, and the quantized blocks run
on the int kernels as they are. What transformers' GGUF reader would load as another model
(LongRoPE Phi-3, other expert widths) is refused at start-up in one line. OLMo 2 and Mixtral,
whose config tokenmill maps itself: ``test_gguf_config.py``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import MOE_FAMILIES
from tests.gguf_fixture import (
    assert_blocks_as_in_the_file,
    fp32_greedy,
    hf_weights,
    model_overrides,
    refusal,
    to_gguf_tensors,
    write_gguf,
)
from tests.model.test_gguf_fixtures import PROMPTS, _hf_gguf_greedy
from tokenmill.model.quant import Int4Linear, Int8Linear

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""

FAMILIES = ["phi3", "qwen2_moe", "qwen3_moe"]


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
    _, path = gguf_file(family, "F32")
    _, prompts, got = fp32_greedy(path, PROMPTS)
    assert got == _hf_gguf_greedy(path, prompts, 8)


CASES = [
    ("phi3", "Q4_0", Int4Linear),
    ("phi3", "Q8_0", Int8Linear),
    ("qwen2_moe", "Q4_0", Int4Linear),
    ("qwen3_moe", "Q8_0", Int8Linear),
    ("olmo2", "Q4_K", Int4Linear),
    ("olmo2", "Q6_K", Int8Linear),
    ("mixtral", "Q4_1", Int4Linear),  # no K type: the fixture's experts are 32 wide
    ("mixtral", "Q8_0", Int8Linear),
]


@pytest.mark.parametrize(("family", "qtype", "kind"), CASES)
def test_quantized_blocks_run_as_they_are(gguf_file, family, qtype, kind) -> None:
    from tokenmill import LLM, SamplingParams

    _, path = gguf_file(family, qtype)
    native = LLM(str(path), max_model_len=64)
    reference = LLM(str(path), dtype="float32", max_model_len=64)
    pairs = assert_blocks_as_in_the_file(native, reference, kind)
    if family in MOE_FAMILIES:
        assert any(".experts.3." in name for name in pairs)
    out = native.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_expert_widths_transformers_does_not_read_arerefusal(make_model, tmp_path) -> None:
    folder = make_model("qwen3_moe")  # moe_intermediate_size 32
    path = write_gguf(folder, tmp_path / "q3moe.gguf", "qwen3_moe")
    assert refusal(path) == (
        "qwen3moe.expert_feed_forward_length is 32, but transformers' GGUF reader does not "
        "read it and assumes 768; only qwen3moe files of those widths are supported"
    )


def test_longrope_phi3_isrefusal(make_model, tmp_path) -> None:
    path = write_gguf(make_model("phi3"), tmp_path / "phi3-long.gguf", "phi3")  # LongRoPE
    assert refusal(path) == (
        "a phi3 file with LongRoPE factors (rope_factors_long.weight, "
        "rope_factors_short.weight) is not supported: transformers' GGUF reader drops them "
        "and would run plain RoPE"
    )


def test_partial_rotary_phi3_isrefusal(make_model, tmp_path) -> None:
    over = model_overrides("phi3")
    over["rope_parameters"] = {**over["rope_parameters"], "partial_rotary_factor": 0.5}
    path = write_gguf(make_model("phi3", **over), tmp_path / "phi3-partial.gguf", "phi3")
    assert refusal(path) == (
        "phi3.rope.dimension_count is 8, not the head size 16: transformers' GGUF reader "
        "does not read it and would rotate whole heads"
    )
