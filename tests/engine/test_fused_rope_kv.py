"""The fused RoPE + KV-cache write (CPU kernels, bf16) is exact: every dense family's greedy
tokens equal those of the unfused path (RoPE, then ``write_kv``), with a bf16 and an fp8
cache, in a batch that mixes prefill chunks and decodes."""

from __future__ import annotations

import pytest

from tests.conftest import DENSE_FAMILIES, random_prompts
from tokenmill import kernels
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.model import attention_backend


@pytest.mark.parametrize(
    ("family", "kv_cache_dtype"), [(f, "auto") for f in DENSE_FAMILIES] + [("llama_bias", "fp8")]
)
def test_fused_rope_kv_write_gives_the_unfused_tokens(
    make_model, monkeypatch, family: str, kv_cache_dtype: str
) -> None:
    if not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")
    folder = make_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    calls = []
    fused = attention_backend._fused_rope_applies

    def counted(*args):
        ok = fused(*args)
        calls.append(ok)
        return ok

    def run() -> list[list[int]]:
        llm = LLM(
            str(folder),
            dtype="bfloat16",
            max_model_len=256,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=48,  # prompts split into chunks after a prefix
        )
        prompts = random_prompts(llm.tokenizer.vocab_size, 4, seed=2)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    monkeypatch.setattr(attention_backend, "_fused_rope_applies", counted)
    got = run()
    assert any(calls), "the fused op never ran"
    monkeypatch.setattr(attention_backend, "_fused_rope_applies", lambda *a: False)
    assert got == run()
