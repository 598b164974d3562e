"""LoRA adapters: greedy tokens identical to transformers + peft (fp32) for every family,
alone and in one batch mixing three adapters with the base model."""

from __future__ import annotations

import random

import pytest

from tests.conftest import FAMILIES, peft_greedy
from tokenmill.entrypoints.llm import LLM
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling import SamplingParams

MAX_NEW = 8

ADAPTERS = [
    {"seed": 1},  # every projection, r=8
    {"seed": 2, "r": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    {
        "seed": 3,
        "r": 16,
        "lora_alpha": 8,
        "target_modules": ["k_proj", "o_proj", "up_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"o_proj": 32},
    },
]


def _prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 40))] for _ in range(num)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_match_peft_alone_and_mixed(
    make_model, make_adapter, reference_greedy, family: str
) -> None:
    folder = make_model(family)
    adapters = [make_adapter(folder, **options) for options in ADAPTERS]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, enable_lora=True, max_loras=3)
    prompts = _prompts(llm.tokenizer.vocab_size, 4, seed=7)
    expected = {
        lora.lora_int_id: peft_greedy(folder, path, prompts, MAX_NEW)
        for lora, path in zip(loras, adapters, strict=True)
    }
    expected[0], _ = reference_greedy(folder, prompts, MAX_NEW)
    assert expected[1] != expected[0], "the adapter changes nothing: the test would prove nothing"
    # A single request, then one adapter for a whole batch.
    for lora in loras:
        out = llm.generate(prompts[0], _greedy(), use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == expected[lora.lora_int_id][0], lora
        outs = llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == expected[lora.lora_int_id], lora
    # One batch: every prompt once with each adapter and once on the base model.
    batch = [(p, i, lora) for i, p in enumerate(prompts) for lora in [None, *loras]]
    random.Random(3).shuffle(batch)
    outs = llm.generate(
        [p for p, _, _ in batch], _greedy(), use_tqdm=False, lora_request=[lo for *_, lo in batch]
    )
    for (_, i, lora), out in zip(batch, outs, strict=True):
        want = expected[lora.lora_int_id if lora else 0][i]
        assert out.outputs[0].token_ids == want, (i, lora)


def test_more_adapters_than_slots_wait_for_one(make_model, make_adapter) -> None:
    """With max_loras=2 a third adapter's requests wait for a slot; every answer is its own."""
    folder = make_model("llama")
    adapters = [make_adapter(folder, **options) for options in ADAPTERS]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_num_batched_tokens=64,
    )
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=9)
    expected = {
        lo.lora_int_id: peft_greedy(folder, p, prompts, MAX_NEW)
        for lo, p in zip(loras, adapters, strict=True)
    }
    batch = [(i, lora) for lora in loras for i in range(len(prompts))]
    outs = llm.generate(
        [prompts[i] for i, _ in batch],
        _greedy(),
        use_tqdm=False,
        lora_request=[lo for _, lo in batch],
    )
    for (i, lora), out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == expected[lora.lora_int_id][i], (i, lora)
    assert llm.engine.runner.lora is not None
    assert llm.engine.runner.lora.num_loads > 3  # the CPU cache (2) evicted and reloaded one
