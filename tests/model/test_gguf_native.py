"""A GGUF file's quantized blocks on tokenmill's int kernels (``model/gguf_weights.py``).

Q4_0, Q4_1 and Q4_K blocks are int4 groups of 32 as they are: the projection they become
must hold exactly the weights gguf's own dequantizer gives (the ``--dtype float32`` load
of the same file). The 5- to 8-bit types are requantized per channel: within half a step.
``--dtype float32`` keeps every projection in float."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_fixture import model_overrides, write_gguf
from tokenmill.model.quant import Int4Linear, Int8Linear, QuantizedLinear

pytest.importorskip("gguf")

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


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "tm-cache"))


def _projections(llm) -> dict[str, torch.nn.Module]:
    model = llm.engine.executor.driver_worker.model
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith("layers.") and hasattr(module, "out_features")
    }


def _weight(linear: torch.nn.Module, in_features: int) -> torch.Tensor:
    """A float projection's weight [out, in] from its forward (the loader packs it away):
    identity rows in, W^T (+ bias) out, exact in float32."""
    eye = torch.eye(in_features)
    out = linear(eye)
    if linear.bias is not None:
        out = out - linear.bias
    return out.t().float()


@pytest.mark.parametrize(("family", "qtype", "kind"), CASES)
def test_quantized_blocks_run_as_they_are(make_model, tmp_path, family, qtype, kind) -> None:
    from tokenmill import LLM, SamplingParams

    folder = make_model(family, **model_overrides(family, qtype))
    path = write_gguf(folder, tmp_path / f"{family}-{qtype}.gguf", family, qtype)
    native = LLM(str(path), max_model_len=64)
    reference = LLM(str(path), dtype="float32", max_model_len=64)
    ours, theirs = _projections(native), _projections(reference)
    assert ours.keys() == theirs.keys() and ours
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
        if module.bias is not None:
            bias = theirs[name].bias.float()  # ours is in the model dtype (bf16 here)
            torch.testing.assert_close(module.bias.float(), bias, rtol=2**-8, atol=1e-6)
    out = native.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_get_tokenizer_is_vllms_name_for_the_tokenizer() -> None:
    from tokenmill import LLM

    llm = LLM("demo")
    assert llm.get_tokenizer() is llm.tokenizer
