"""vLLM's prompt forms in ``LLM.generate``, ``LLM.embed`` and ``LLM.encode``.

Each accepted form gives the tokens of the equivalent plain call; each refused form raises,
naming what was given, before the engine sees any request.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_cache: str) -> LLM:
    return LLM("demo", dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def embedder(make_model) -> LLM:
    return LLM(str(make_model("qwen3")), dtype="float32", max_model_len=64, runner="pooling")


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_every_vllm_prompt_form_gives_the_tokens_of_the_plain_call(llm: LLM) -> None:
    text = "The sea is"
    ids = llm.tokenizer.encode(text)
    plain = _tokens(llm.generate(text, GREEDY))
    assert _tokens(llm.generate([text], GREEDY)) == plain
    assert _tokens(llm.generate({"prompt": text}, GREEDY)) == plain
    assert _tokens(llm.generate([{"prompt": text}], GREEDY)) == plain
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain
    assert _tokens(llm.generate([{"prompt_token_ids": ids}], GREEDY)) == plain
    assert _tokens(llm.generate(ids, GREEDY)) == plain
    assert _tokens(llm.generate([ids], GREEDY)) == plain
    mixed = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], GREEDY)
    assert _tokens(mixed) == plain * 4
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert out.prompt_token_ids == ids


REFUSED: list[tuple[Any, type[Exception], str]] = [
    ({"prompt": "hi", "extra": 1}, ValueError, "unknown keys ['extra']"),
    ({"promt": "hi"}, ValueError, "unknown keys ['promt']"),
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, ValueError, "'multi_modal_data'"),
    ([{"prompt_token_ids": [1, 2]}, 3], TypeError, "mixing token ids"),
    ([1, 2, "three"], TypeError, "mixing token ids"),
    ({"prompt": ["hi"]}, TypeError, "'prompt' must be a string, got list"),
    ({"prompt_token_ids": "1 2 3"}, TypeError, "must be a list of ints (token ids), got '1 2 3'"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, ValueError, "exactly one of"),
    ({}, ValueError, "exactly one of"),
    (42, TypeError, "got int"),
    ([b"bytes"], TypeError, "prompt 0 is a bytes"),
    ([{"prompt_token_ids": [1, True]}], TypeError, "must be a list of ints"),
    ({"prompt": "hi", "cache_salt": ""}, ValueError, "'cache_salt' must be a non-empty string"),
    ({"prompt": "hi", "cache_salt": 7}, TypeError, "'cache_salt' must be a non-empty string"),
    ({"cache_salt": "s"}, ValueError, "exactly one of"),
]


@pytest.mark.parametrize(("prompts", "error", "words"), REFUSED)
def test_other_forms_raise_naming_them_before_any_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, prompts: Any, error: type[Exception], words: str
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: seen.append("add"))
    with pytest.raises(error) as info:
        llm.generate(prompts, GREEDY)
    assert words in str(info.value) and "LLM.generate" in str(info.value)
    assert seen == [] and not llm.engine.has_unfinished_requests()


def test_cache_salt_keeps_prefix_cache_blocks_to_prompts_with_the_same_salt(llm: LLM) -> None:
    """vLLM's ``{"prompt": ..., "cache_salt": ...}``: the same salt hits, another salt or none
    misses. Each miss is checked while the blocks it must not see are cached (a later request
    may evict them: freed blocks are reused before fresh ones)."""
    text = "A salted prompt, long enough to fill more than one block of the cache. " * 2
    ids = llm.tokenizer.encode(text)

    def cached(prompt: Any) -> int:
        return llm.generate(prompt, GREEDY)[0].num_cached_tokens

    assert cached({"prompt": text, "cache_salt": "tenant-a"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "tenant-a"}) >= 16
    assert cached({"prompt": text, "cache_salt": "tenant-b"}) == 0
    assert cached({"prompt": text}) == 0
    assert cached(text) >= 16


def test_embed_and_encode_take_the_same_forms(
    embedder: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = embedder.tokenizer.encode("hello there")
    plain = embedder.embed("hello there")
    assert embedder.embed({"prompt": "hello there"}) == plain
    assert embedder.embed([{"prompt_token_ids": ids}]) == plain
    assert embedder.embed(ids) == plain
    encoded = embedder.encode([{"prompt_token_ids": ids}, "hello there"])
    # Two prompts run as one batch: torch's fp32 GEMM may sum in another order for another
    # row count (oneDNN on AVX-512 does, by ~1e-7), so the batch is equal within rounding.
    torch.testing.assert_close(
        torch.tensor([out.pooled for out in encoded]), torch.tensor(plain * 2), rtol=1e-5, atol=1e-6
    )
    assert encoded[0].prompt_token_ids == ids
    seen: list[str] = []
    monkeypatch.setattr(embedder.engine, "add_processed", lambda *a, **k: seen.append("add"))
    for api in (embedder.embed, embedder.encode):
        with pytest.raises(ValueError, match="multi_modal_data"):
            api({"prompt": "hi", "multi_modal_data": {}})
        with pytest.raises(TypeError, match="mixing token ids"):
            api([{"prompt": "hi"}, 5])
    assert seen == [] and not embedder.engine.has_unfinished_requests()
