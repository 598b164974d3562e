"""Greedy fp32 parity with transformers for the dense and mixture-of-experts families.

Each family is a registry entry on the shared decoder (``model/registry.py``); the tiny
random fixtures (tests/conftest.py) exercise what distinguishes it: biases (Llama),
post-norms and full q/k norm (OLMo 2), fused checkpoint projections and longrope with
prompts that decode past the original context (Phi-3), soft-capping, sandwich norms,
scaled embeddings and alternating sliding/global layers with per-layer RoPE bases
(Gemma 2/3), and top-2 routing over 4 experts with and without a shared expert (MoE).
"""

from __future__ import annotations

import random

import pytest

from tests.conftest import DENSE_FAMILIES, MOE_FAMILIES, random_prompts
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

ALL = DENSE_FAMILIES + MOE_FAMILIES
MAX_NEW = 10
LOGPROB_ATOL = 1e-4


def _greedy(logprobs: int | None = None, max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ALL)
def test_single_request_matches_transformers(make_model, reference_greedy, family: str) -> None:
    folder = make_model(family)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompts = random_prompts(llm.tokenizer.vocab_size, 2, seed=1)
    expected, ref_logprobs = reference_greedy(folder, prompts, MAX_NEW)
    for prompt, want, ref_lp in zip(prompts, expected, ref_logprobs, strict=True):
        out = llm.generate([prompt], _greedy(logprobs=3), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        for step, entry in enumerate(out.logprobs):
            for token_id, lp in entry.items():
                assert abs(lp.logprob - ref_lp[step, token_id].item()) < LOGPROB_ATOL


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["batched", "chunked"])
def test_batch_of_16_mixed_lengths(
    make_model, reference_greedy, family: str, max_num_batched_tokens: int
) -> None:
    folder = make_model(family)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    prompts = random_prompts(llm.tokenizer.vocab_size, 16, seed=2)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected


@pytest.mark.parametrize("family", ALL)
def test_prefix_caching_and_preemption_match_transformers(
    make_model, reference_greedy, family: str
) -> None:
    """Paged KV far too small for the batch (preemption, recompute) with prefix caching on:
    shared-prefix prompts reuse cached blocks, and every output still matches."""
    folder = make_model(family)
    shared = list(range(10, 42))  # two full blocks of 16
    rng = random.Random(7)
    prompts = [
        shared + [rng.randrange(4, 400) for _ in range(rng.randint(1, 20))] for _ in range(8)
    ]
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    probe = LLM(str(folder), dtype="float32", max_model_len=128)
    per_block = probe.engine.kv_cache_bytes // probe.engine.kv_manager.num_blocks
    tight = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=10 * per_block)
    assert tight.engine.kv_manager.num_blocks == 10
    assert _tokens(tight.generate(prompts, _greedy(), use_tqdm=False)) == expected
    assert tight.engine.stats.num_preemptions > 0
    assert tight.engine.stats.num_prefix_hit_tokens > 0


@pytest.mark.parametrize("family", ALL)
def test_static_kv_matches_transformers(make_model, reference_greedy, family: str) -> None:
    """static KV, compiled decode where the model allows it (MoE runs it eagerly)."""
    folder = make_model(family)
    prompts = random_prompts(500, 5, seed=2)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        kv_cache="static",
        compile_batch_sizes=(2,),
    )
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected
    is_moe = family in MOE_FAMILIES
    assert (llm.engine.runner.num_compiled_steps > 0) == (not is_moe)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("phi3", {"partial_rotary_factor": 0.5}),
        ("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
        ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3}),
        ("qwen2_moe", {"mlp_only_layers": [1], "norm_topk_prob": True}),
        ("qwen3_moe", {"decoder_sparse_step": 2}),
    ],
    ids=[
        "phi3-partial-rotary",
        "gemma2-tight-softcap",
        "mixtral-8x-top3",
        "qwen2moe-dense-layer",
        "qwen3moe-sparse-step",
    ],
)
def test_family_variants(make_model, reference_greedy, family: str, overrides: dict) -> None:
    folder = make_model(family, **overrides)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompts = random_prompts(llm.tokenizer.vocab_size, 4, seed=3, max_len=80)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected


def test_moe_router_stats_count_every_routed_token(make_model) -> None:
    folder = make_model("mixtral")
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    before = model.debug_stats()["moe_tokens_per_expert"]
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    llm.generate(prompts, _greedy(max_tokens=4), use_tqdm=False)
    after = model.debug_stats()["moe_tokens_per_expert"]
    # each layer routed every computed token to top-2 experts: (5 + 3 prompt + 2 * 3 decode) * 2
    num_tokens = 5 + 3 + 2 * 3
    for layer_before, layer_after in zip(before, after, strict=True):
        assert sum(layer_after) - sum(layer_before) == 2 * num_tokens
    assert len(after) == llm.engine.model_config.num_layers
    assert len(after[0]) == 4
