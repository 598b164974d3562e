"""Greedy outputs are token-identical to transformers for every supported family (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAMILIES, random_prompts
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

MAX_NEW = 10
LOGPROB_ATOL = 1e-4  # fp32: different matmul shapes and op order than transformers


def _greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_request_matches_transformers(make_model, reference_greedy, family: str) -> None:
    folder = make_model(family)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompts = random_prompts(llm.tokenizer.vocab_size, 2, seed=1)
    expected, ref_logprobs = reference_greedy(folder, prompts, MAX_NEW)
    for prompt, want, ref_lp in zip(prompts, expected, ref_logprobs, strict=True):
        out = llm.generate([prompt], _greedy(logprobs=3), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        got = torch.tensor(
            [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        ref = ref_lp[torch.arange(len(want)), torch.tensor(want)]
        assert torch.allclose(got, ref, atol=LOGPROB_ATOL), (got - ref).abs().max()
        # top-3 alternatives agree with the reference distribution too
        for step, entry in enumerate(out.logprobs):
            for token_id, lp in entry.items():
                assert abs(lp.logprob - ref_lp[step, token_id].item()) < LOGPROB_ATOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
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
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4},
    ],
    ids=["rope-llama3", "rope-linear", "tied", "mqa", "mha"],
)
def test_llama_variants(make_model, reference_greedy, overrides: dict) -> None:
    folder = make_model("llama", **overrides)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompts = random_prompts(llm.tokenizer.vocab_size, 4, seed=3, max_len=100)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_mistral_sliding_window_beyond_window(make_model, reference_greedy) -> None:
    """Prompts far longer than the window: only the last `sliding_window` keys count."""
    folder = make_model("mistral", sliding_window=8)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompts = random_prompts(llm.tokenizer.vocab_size, 3, seed=4, max_len=80)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_kv_matches_transformers(
    make_model, reference_greedy, family: str, compiled: bool
) -> None:
    """static (compiled or eager) == transformers; paged == transformers is tested above."""
    folder = make_model(family)
    prompts = random_prompts(500, 5, seed=2)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    # One small bucket keeps CPU compile time in check; batches of 1 and 2 exercise padding.
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        kv_cache="static",
        enforce_eager=not compiled,
        compile_batch_sizes=(2,),
    )
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert (llm.engine.runner.num_compiled_steps > 0) == compiled
    assert (llm.engine.stats.compile_time_s > 0) == compiled


def test_paged_kv_with_compile_batch_sizes_compiles_its_decode_steps(
    make_model, reference_greedy
) -> None:
    """paged + --compile-batch-sizes: decode-only steps take the compiled step (the
    lowest-latency path without static's slots), over real block tables of 8-token blocks
    and shared prefixes, and the tokens equal transformers'."""
    folder = make_model("llama")
    shared = [4 + (i * 37) % 490 for i in range(20)]  # two and a half blocks
    prompts = [shared + p for p in random_prompts(500, 4, seed=6)]
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        block_size=8,
        compile_batch_sizes=(2,),
    )
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.runner.num_compiled_steps > 0
    assert llm.engine.kv_manager.stats.num_hit_tokens > 0
