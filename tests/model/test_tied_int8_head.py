"""A tied LM head under quantization: one int8 copy is both the head and the embedding.

The head was every token's largest read in bf16 (SmolLM2: 56 MB, Gemma 3: 335 MB); as int8
rows it is half that, its logits are written in fp32 (rounding them to bf16 made close
candidates ties), and the embedding rows are looked up from the same copy."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.model.quant import Int8Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="tokenmill's CPU kernels")


def _model(llm):
    return llm.engine.executor.driver_worker.model


def test_quantized_tied_head_is_one_int8_copy_with_fp32_logits(make_model) -> None:
    from tokenmill import LLM, SamplingParams

    folder = make_model("llama", tie_word_embeddings=True)
    llm = LLM(str(folder), quantization="int8", dtype="bfloat16", max_model_len=64)
    model = _model(llm)
    head = model.lm_head
    assert isinstance(head, Int8Linear) and head.kernel == "rows"
    assert model.embed is None  # no second copy of the table
    ids = torch.tensor([0, 5, 17, 5])
    rows = head.embedding(ids)
    want = head.dequantize(torch.float32)[ids].to(torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, want)
    hidden = torch.randn(3, head.in_features).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    ref = hidden.float() @ head.dequantize(torch.float32).t()
    err = (logits - ref).abs().max().item()
    assert err <= 0.03 * ref.abs().max().item(), err  # W8A8: x rounded to int8 per row
    # fp32 logits: not all on bf16's grid (rounded ones would be)
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_unquantized_tied_head_stays_the_embedding(make_model) -> None:
    from tokenmill import LLM

    folder = make_model("llama", tie_word_embeddings=True)
    model = _model(LLM(str(folder), dtype="bfloat16", max_model_len=64))
    assert model.embed is not None
    assert model.lm_head.weight is model.embed
