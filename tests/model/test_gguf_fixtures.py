"""GGUF files written by ``tests/gguf_fixture.py``: the writer itself round-trips (so other
tests can trust it), and tokenmill serves them as transformers' GGUF loader reads them:
the same greedy tokens in float32, the same token ids, the file's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gguf_fixture import (
    QTYPES,
    fp32_greedy,
    from_gguf_tensor,
    hf_weights,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


def _check_close(name: str, got: np.ndarray, want: np.ndarray, kind: str) -> None:
    if kind == "F32":  # exact, but for Gemma's norms: (w + 1) - 1 rounds in float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-22, err_msg=name)
    elif kind in ("F16", "BF16"):
        rtol = 2.0**-11 if kind == "F16" else 2.0**-8
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7, err_msg=name)
    else:  # within one quantization step of each block's symmetric range
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
        w = want.reshape(-1, block)
        step = 2 * np.abs(w).max(axis=1, keepdims=True) / (2 ** BITS[kind] - 1)
        err = np.abs(got.reshape(-1, block) - w)
        worst = float((err / np.maximum(step, 1e-12)).max())
        assert (err <= 1.02 * step + 1e-7).all(), f"{name}: {worst:.2f} steps off"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_written_file_dequantizes_to_the_hf_weights(gguf_file, family: str, qtype: str) -> None:
    folder, path = gguf_file(family, qtype)
    cfg = json.loads((folder / "config.json").read_text())
    want = hf_weights(folder)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    assert arch == ("llama" if family == "mistral" else family)
    assert reader.fields[f"{arch}.block_count"].contents() == cfg["num_hidden_layers"]
    assert reader.fields[f"{arch}.embedding_length"].contents() == cfg["hidden_size"]
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    hf_names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg["num_hidden_layers"]
    )
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        assert kind == (qtype if len(tensor.shape) >= 2 else "F32"), tensor.name
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        got = from_gguf_tensor(tensor.name, got.reshape(tuple(reversed(tensor.shape))), cfg, family)
        key = next(
            k
            for k in want
            if hf_names.get_name(k, try_suffixes=(".weight", ".bias")) == tensor.name
        )
        seen.add(key)
        _check_close(tensor.name, got, want[key], kind)
    tied = {"lm_head.weight"} if family.startswith("gemma") else set()
    assert seen == set(want) - tied


PROMPTS = ["the quick brown fox", "A model reads", "<|im_start|>user\nhi<|im_end|>\n"]
PARITY = [
    pytest.param(family, qtype, marks=[pytest.mark.slow] if qtype != "F32" else [])
    for family in ("llama", "qwen2", "gemma3")
    for qtype in ("F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
] + [pytest.param(family, "F32") for family in ("mistral", "qwen3", "gemma2")]
"""Phi-3 and the mixture-of-experts families: ``test_gguf_families.py``."""


def _hf_gguf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: EOS may win, not be masked
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize(("family", "qtype"), PARITY)
def test_fp32_greedy_parity_with_transformers_gguf_load(gguf_file, family, qtype) -> None:
    _, path = gguf_file(family, qtype)
    llm, prompts, got = fp32_greedy(path, PROMPTS)
    assert got == _hf_gguf_greedy(path, prompts, 8)
    # /metrics' precision labels name the file's own blocks, as vLLM's quantization=gguf
    assert llm.engine._counters.precision["quantization"] == "gguf"


TEXTS = [
    "hello world",
    "The model reads 12345 tokens, then stops.",
    "naïve café — 東京 🙂",
    "  leading\tand   trailing  \n\n spaces ",
    "<|im_start|>user\nhi<|im_end|>\n</s>",
]


@pytest.fixture(scope="module")
def served(gguf_file, tmp_path_factory):
    """tokenmill's tokenizer for a GGUF file and transformers' GGUF tokenizer for it."""
    import transformers

    from tokenmill.model.source import resolve_model_path
    from tokenmill.tokenizer import Tokenizer

    _, path = gguf_file("qwen2", "F32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "tm-cache"))
        ours = Tokenizer.from_pretrained(resolve_model_path(str(path)))
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers_gguf_tokenizer(served, text: str) -> None:
    ours, ref = served
    assert ours.encode(text) == ref(text)["input_ids"]
    assert (
        ours.encode(text, add_special_tokens=False)
        == ref(text, add_special_tokens=False)["input_ids"]
    )


def test_chat_template_from_the_file_renders_chatml(served) -> None:
    ours, ref = served
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = ours.apply_chat_template(conversation, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
