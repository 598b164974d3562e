"""logit_bias (OpenAI's field, vLLM's SamplingParams.logit_bias): added to the logits before
anything else, per row, per verified position under speculation; refused with beam search."""

from __future__ import annotations

import pytest

from tokenmill.core.messages import decode_any, encode, params_from_wire, params_to_wire
from tokenmill.core.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError

PROMPTS = [[5, 9, 14, 3, 22, 7, 5, 9, 14], [30, 31, 32, 30, 31], [11, 12, 13, 14, 15, 16]]


def _greedy(max_tokens: int = 16, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def folder(make_model):
    return make_model("llama")


@pytest.fixture(scope="module")
def plain(folder) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=128)


def test_params_validate_and_normalise_the_bias() -> None:
    params = SamplingParams(logit_bias={"7": 100, 3: -2.5})
    assert params.logit_bias == {7: 100.0, 3: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None  # nothing to apply
    wire = decode_any(encode(params_to_wire(params)))  # as it crosses to worker processes
    assert params_from_wire(wire).logit_bias == params.logit_bias
    too_many = {t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    for bias in ({"x": 1}, {-1: 1}, {True: 1}, {1: 100.5}, {1: float("nan")}, {1: "1"}, too_many):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(logit_bias=bias)
        assert info.value.param == "logit_bias", bias


def test_bias_forces_and_bans_tokens_greedy_row_by_row(plain: LLM) -> None:
    base = _tokens(plain.generate(PROMPTS, _greedy(), use_tqdm=False))
    forced = next(t for t in range(4, 40) if t not in base[0])
    banned = base[1][0]
    params = [_greedy(logit_bias={forced: 100}), _greedy(logit_bias={banned: -100}), _greedy()]
    got = _tokens(plain.generate(PROMPTS, params, use_tqdm=False))
    assert got[0] == [forced] * 16
    assert banned not in got[1] and got[1] != base[1]
    assert got[2] == base[2]  # a row without a bias is untouched by its neighbours'
    with pytest.raises(InvalidRequestError) as info:  # outside the vocabulary
        plain.generate(PROMPTS[:1], _greedy(logit_bias={plain.tokenizer.vocab_size: 1}))
    assert info.value.param == "logit_bias"


def test_bias_comes_before_min_tokens_and_the_logprobs_stay_raw(plain: LLM) -> None:
    """A +100 bias on an EOS token cannot end a request before min_tokens, and reported
    logprobs are the model's own (the bias shapes the choice, not the distribution shown)."""
    eos = sorted(plain.engine.model_config.eos_token_ids)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=3, logit_bias={eos: 100}, logprobs=0
    )
    out = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3]
    raw = plain.generate(PROMPTS[:1], _greedy(4, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and raw.logprobs is not None
    first = out.token_ids[0]
    assert out.logprobs[0][first].logprob == pytest.approx(raw.logprobs[0][first].logprob)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_applies_the_bias_at_every_verified_position(
    folder, plain: LLM, method
) -> None:
    """Greedy with a bias is the same with and without speculation, and drafts were
    accepted (the bias was applied to each of the k + 1 verified rows, not only the first;
    the draft model drafts under the request's bias too)."""
    base = _tokens(plain.generate(PROMPTS, _greedy(24), use_tqdm=False))
    bias = {base[0][2]: -100.0, base[1][1]: -100.0, 17: 4.0, 23: 2.0}
    params = _greedy(24, logit_bias=bias)
    want = _tokens(plain.generate(PROMPTS, params, use_tqdm=False))
    assert want != base
    spec_config = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(folder), "num_speculative_tokens": 3}
    )
    spec = LLM(str(folder), dtype="float32", max_model_len=128, speculative_config=spec_config)
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == want
    stats = spec.engine.stats
    assert stats.spec_num_accepted_tokens > 0
    if method == "draft_model":  # the target as its own draft, biased alike: all accepted
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_beam_search_refuses_a_bias(plain: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        plain.generate(
            PROMPTS[:1],
            SamplingParams(use_beam_search=True, n=2, max_tokens=4, logit_bias={5: 1.0}),
            use_tqdm=False,
        )
    assert info.value.param == "logit_bias"
