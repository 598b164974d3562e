"""The paged prefill kernel in the whole engine: bf16 greedy tokens equal torch's paths on
a workload of chunked prefills (prompts longer than a step's token budget) and prefix hits.

The two paths round differently in bf16 (as torch's own flash and mask paths do), so a
greedy pick may flip where the top two logprobs are tied to within bf16 noise; from there
on the continuations differ legitimately (the tiny random model's logits tie often). So:
the prompt logprobs (computed by the prefill chunks under test) agree within bf16 noise,
and generated tokens agree up to a pick at a near tie."""

from __future__ import annotations

import random

import pytest

from tokenmill import kernels
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.model import attention


def test_bf16_greedy_tokens_match_the_torch_prefill_paths(make_model, monkeypatch) -> None:
    if not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")
    folder = make_model("llama", dtype="bfloat16")
    rng = random.Random(11)
    system = [rng.randrange(4, 500) for _ in range(37)]  # a shared prefix: later prompts hit it
    prompts = [
        system + [rng.randrange(4, 500) for _ in range(rng.randint(5, 50))] for _ in range(5)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)  # no prefix hits: every logit
    results = {}
    for use_kernel in (True, False):
        monkeypatch.setattr(attention, "PREFILL_KERNEL", use_kernel)
        llm = LLM(
            str(folder),
            dtype="bfloat16",
            max_model_len=256,
            block_size=8,
            max_num_batched_tokens=24,
        )
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert rest[0].num_cached_tokens >= 32  # the shared prefix's full blocks were reused
        results[use_kernel] = (first + rest, llm.generate(prompts, scored, use_tqdm=False))
    for got_req, want_req in zip(results[True][1], results[False][1], strict=True):
        tokens = want_req.prompt_token_ids
        for i in range(1, len(tokens)):
            got_lp = got_req.prompt_logprobs[i][tokens[i]].logprob
            # measured: at most 0.017 apart; a 1.3x error in the scale moves them 0.12
            assert abs(got_lp - want_req.prompt_logprobs[i][tokens[i]].logprob) < 0.04
    for got_req, want_req in zip(results[True][0], results[False][0], strict=True):
        got, want = got_req.outputs[0], want_req.outputs[0]
        if got.token_ids == want.token_ids:
            continue
        i = next(
            i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b
        )
        top = sorted((lp.logprob for lp in want.logprobs[i].values()), reverse=True)
        assert top[0] - top[1] < 0.05, (i, got.token_ids, want.token_ids, top)
