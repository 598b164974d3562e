"""A GGUF file's quantized blocks on tokenmill's int kernels (``model/gguf_weights.py``).

Q4_0, Q4_1 and Q4_K blocks are int4 groups of 32 as they are: the projection they become
must hold exactly the weights gguf's own dequantizer gives (the ``--dtype float32`` load
of the same file). The 5- to 8-bit types are requantized per channel: within half a step.
``--dtype float32`` keeps every projection in float."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_fixture import (
    assert_blocks_as_in_the_file,
    model_overrides,
    write_gguf,
)
from tokenmill.model.quant import Int4Linear, Int8Linear

pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""

CASES = [
    ("llama", "Q4_0", Int4Linear),
    ("llama", "Q4_1", Int4Linear),
    ("llama", "Q4_K", Int4Linear),
    ("qwen2", "Q4_1", Int4Linear),  # q/k/v biases beside the blocks
    ("gemma3", "Q4_K", Int4Linear),
    ("llama", "Q8_0", Int8Linear),
    ("gemma3", "Q5_0", Int8Linear),
    ("llama", "Q6_K", Int8Linear),
]


@pytest.mark.parametrize(("family", "qtype", "kind"), CASES)
def test_quantized_blocks_run_as_they_are(make_model, tmp_path, family, qtype, kind) -> None:
    from tokenmill import LLM, SamplingParams

    folder = make_model(family, **model_overrides(family, qtype))
    path = write_gguf(folder, tmp_path / f"{family}-{qtype}.gguf", family, qtype)
    native = LLM(str(path), max_model_len=64)
    reference = LLM(str(path), dtype="float32", max_model_len=64)
    for module, float_module in assert_blocks_as_in_the_file(native, reference, kind).values():
        if module.bias is not None:
            bias = float_module.bias.float()  # ours is in the model dtype (bf16 here)
            torch.testing.assert_close(module.bias.float(), bias, rtol=2**-8, atol=1e-6)
    out = native.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_get_tokenizer_is_vllms_name_for_the_tokenizer() -> None:
    from tokenmill import LLM

    llm = LLM("demo")
    assert llm.get_tokenizer() is llm.tokenizer
