"""A tied LM head is one copy, both the head and the embedding: int8 under quantization (AMX
tiles on AVX-512, rows on AVX2), the GEMV's blocks otherwise.

The head was every token's largest read in bf16 (SmolLM2: 56 MB, Gemma 3: 335 MB); in int8
it is half that, its logits are written in fp32 (rounding them to bf16 made close
candidates ties), and the embedding rows are looked up from the same copy."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.model.quant import Int8Linear, kernel_layout

pytestmark = pytest.mark.skipif(not kernels.available(), reason="tokenmill's CPU kernels")


def _model(llm):
    return llm.engine.executor.driver_worker.model


def test_quantized_tied_head_is_one_int8_copy_with_fp32_logits(make_model) -> None:
    from tokenmill import LLM, SamplingParams

    folder = make_model("llama", tie_word_embeddings=True)
    llm = LLM(str(folder), quantization="int8", dtype="bfloat16", max_model_len=64)
    model = _model(llm)
    head = model.lm_head
    assert isinstance(head, Int8Linear) and head.kernel == kernel_layout("int8", 128)
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


@pytest.mark.parametrize("shape", [(37, 70), (300, 640)])
def test_int8_tiles_give_the_rows_and_logits_of_the_row_layout(shape) -> None:
    """In the tile layout the embedding rows are gathered from the tiles (partial last
    16-channel block, inputs padded to 64): the same codes and values as the row layout's,
    and fp32 logits within the sum order of the row layout's (the same integer sums)."""
    weight = torch.randn(*shape).to(torch.bfloat16)
    tiles, rows = Int8Linear(weight, None), Int8Linear(weight, None, tiles_ok=False)
    if tiles.kernel not in ("amx", "vnni"):
        pytest.skip("the tile layout is AVX-512's")
    ids = torch.tensor([[0, shape[0] - 1, 16], [5, 17, 5]])
    assert torch.equal(tiles.embedding(ids), rows.embedding(ids))
    assert torch.equal(tiles.int_weight(), rows.int_weight())
    for m in (1, 3, 17):
        x = torch.randn(m, shape[1]).to(torch.bfloat16)
        got = tiles.forward_float32(x)  # AMX where granted, else VNNI
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, rows.forward_float32(x), rtol=1e-5, atol=1e-5)
        if kernels.amx_active():  # the VNNI tiles give AMX's bits
            kernels.set_isa("avx512")
            try:
                assert torch.equal(tiles.forward_float32(x), got)
            finally:
                kernels.set_isa("auto")


def test_unquantized_tied_head_is_one_copy_in_gemv_blocks(make_model, monkeypatch) -> None:
    """bf16 and fp32: the tied head is packed for the GEMV (its rows were read a few side
    by side from the embedding's row-major table, the slowest read of a token on Gemma 3),
    the embedding rows are gathered from those blocks, and no second copy is kept. With
    the GEMV layout off, the head reads the embedding in place as before."""
    from safetensors.torch import load_file

    from tokenmill import LLM, SamplingParams

    folder = make_model("llama", tie_word_embeddings=True)
    table = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    for dtype in (torch.bfloat16, torch.float32):
        llm = LLM(str(folder), dtype=str(dtype).removeprefix("torch."), max_model_len=64)
        model = _model(llm)
        head = model.lm_head
        assert model.embed is None and head.weight is None
        assert head.gemv is not None and head.gemv.dtype == dtype
        ids = torch.tensor([0, 5, 17, 5])
        assert torch.equal(head.embedding(ids), table[ids].to(dtype))  # exact rows
        hidden = torch.randn(3, head.in_features).to(dtype)
        logits = model.compute_logits(hidden)
        want = hidden.float() @ table.to(dtype).float().t()
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    monkeypatch.setenv("TOKENMILL_BF16_GEMV", "0")
    model = _model(LLM(str(folder), dtype="bfloat16", max_model_len=64))
    assert model.embed is not None
    assert model.lm_head.weight is model.embed


def test_chunked_reads_give_the_whole_tensors(make_model, monkeypatch) -> None:
    """The loader converts a float32 checkpoint to bf16 a chunk at a time (here 25 values,
    not a whole row) and quantizes a tied embedding into its int8 head a chunk of rows at a
    time (here 7): the tables are those of the whole tensors, exactly. (Both keep the load's
    peak near the served size: Gemma 3 held 1.5 GB at load for 0.7-0.9 GB served.)"""
    from safetensors.torch import load_file

    from tokenmill import LLM
    from tokenmill.model import loader

    folder = make_model("llama", tie_word_embeddings=True)
    table = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert table.dtype == torch.float32  # so that bf16 converts
    monkeypatch.setattr(loader, "CONVERT_CHUNK_BYTES", 100)
    monkeypatch.setattr(loader, "EMBED_CHUNK_ROWS", 7)
    head = _model(LLM(str(folder), quantization="int8", dtype="bfloat16", max_model_len=64)).lm_head
    want = Int8Linear(table.to(torch.bfloat16), None, tiles_ok=False)
    assert torch.equal(head.int_weight(), want.int_weight())
    assert torch.equal(head.scales, want.scales)
    head = _model(LLM(str(folder), dtype="bfloat16", max_model_len=64)).lm_head
    ids = torch.arange(table.shape[0])
    assert torch.equal(head.embedding(ids), table.to(torch.bfloat16))  # packed over itself
