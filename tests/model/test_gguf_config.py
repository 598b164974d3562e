"""OLMo 2 and Mixtral from GGUF files as llama.cpp writes them (``tests/gguf_fixture.py``):
the architectures transformers' GGUF reader has no config mapping for, so tokenmill maps the
metadata itself (``model/gguf_config.py``). transformers cannot read these files, so the
reference is transformers on the Hugging Face folder the file was written from: the same
greedy tokens in float32, the same config, weights and token ids. The quantized blocks run on
the int kernels as they are, and what the mapping does not read is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import hf_greedy
from tests.gguf_fixture import (
    fp32_greedy,
    hf_weights,
    refusal,
    write_gguf,
)
from tests.model.test_gguf_fixtures import PROMPTS, TEXTS

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""

FAMILIES = ["olmo2", "mixtral"]
CONFIG_FIELDS = [
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
]


def _converted_folder(path: Path) -> Path:
    from tokenmill.model.source import resolve_model_path

    return Path(resolve_model_path(str(path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_the_source_models(gguf_file, family: str) -> None:
    source, path = gguf_file(family, "F32")
    want = json.loads((source / "config.json").read_text())
    got = json.loads((_converted_folder(path) / "config.json").read_text())
    assert {k: got.get(k) for k in CONFIG_FIELDS} == {k: want.get(k) for k in CONFIG_FIELDS}
    assert got["rope_parameters"]["rope_theta"] == want["rope_parameters"]["rope_theta"]
    if family == "mixtral":
        assert (got["num_local_experts"], got["num_experts_per_tok"]) == (4, 2)
        assert got["intermediate_size"] == 32  # each expert's width


@pytest.mark.parametrize("family", FAMILIES)
def test_float_copy_holds_the_source_weights(gguf_file, family: str) -> None:
    """The folder's float32 copy (what ``check --parity`` hands transformers) is the source
    model: llama.cpp's Q/K permutation undone, each expert cut from its stacked tensor."""
    source, path = gguf_file(family, "F32")
    want, got = hf_weights(source), hf_weights(_converted_folder(path))
    assert got.keys() == want.keys()
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_parity_with_transformers_on_the_source_folder(gguf_file, family) -> None:
    source, path = gguf_file(family, "F32")
    llm, prompts, got = fp32_greedy(path, PROMPTS)
    want, _ = hf_greedy(source, prompts, 8)
    assert got == want
    assert llm.engine._counters.precision["quantization"] == "gguf"


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_ids_match_the_source_tokenizer(gguf_file, family: str) -> None:
    from tokenmill.tokenizer import Tokenizer

    source, path = gguf_file(family, "F32")
    ours, ref = (
        Tokenizer.from_pretrained(_converted_folder(path)),
        Tokenizer.from_pretrained(source),
    )
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text


# ---- what the mapping does not read: refused in one line ------------------------------------
def _bare_llama_file(path: Path, fill: Callable[[Any], None]) -> Path:
    """A ``llama`` GGUF file of only what ``fill(writer)`` writes: a header to refuse."""
    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_per_expert_mixtral_layout_isrefusal(tmp_path) -> None:
    def fill(writer) -> None:  # just what the refusal reads: experts, one tensor of them
        writer.add_expert_count(4)
        writer.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((32, 64), np.float32))

    path = _bare_llama_file(tmp_path / "old-mixtral.gguf", fill)
    assert refusal(path) == (
        "tensor 'blk.0.ffn_gate.0.weight' holds one expert on its own, llama.cpp's older "
        "Mixtral layout; tokenmill reads the stacked ffn_gate_exps, ffn_up_exps and "
        "ffn_down_exps that convert_hf_to_gguf.py writes (convert the model again)"
    )


def test_olmo3_sliding_window_isrefusal(make_model, tmp_path) -> None:
    path = write_gguf(
        make_model("olmo2"),
        tmp_path / "olmo3.gguf",
        "olmo2",
        metadata=lambda writer: writer.add_sliding_window(4096),
    )
    assert refusal(path) == (
        "an olmo2 file with olmo2.attention.sliding_window 4096 (OLMo 3) is not supported: "
        "tokenmill has no OLMo 3 family"
    )


def test_rope_scaling_the_mapping_does_not_read_isrefusal(make_model, tmp_path) -> None:
    path = write_gguf(
        make_model("mixtral"),
        tmp_path / "mixtral-yarn.gguf",
        "mixtral",
        metadata=lambda writer: writer.add_rope_scaling_type(gguf.RopeScalingType.YARN),
    )
    assert refusal(path) == (
        "llama.rope.scaling.type is 'yarn', but mixtral files are read with plain RoPE only"
    )


def test_experts_of_the_wrong_width_arerefusal(make_model, tmp_path) -> None:
    def edit(name: str, w: np.ndarray) -> np.ndarray:
        return w[:, :-8] if name == "blk.1.ffn_up_exps.weight" else w

    path = write_gguf(make_model("mixtral"), tmp_path / "mixtral.gguf", "mixtral", edit=edit)
    message = refusal(path)
    assert message.startswith("tensor 'blk.1.ffn_up_exps.weight' has shape [4, 24, 64] but ")
    assert message.endswith("expert_count 4, expert width 32 (llama metadata) need [4, 32, 64]")


def test_a_missing_metadata_key_is_named(tmp_path) -> None:
    from tokenmill.model.gguf_config import hf_config

    path = _bare_llama_file(tmp_path / "bare.gguf", lambda writer: writer.add_expert_count(4))
    with pytest.raises(ValueError, match=r"^the file has no llama\.embedding_length$"):
        hf_config(gguf.GGUFReader(path))
