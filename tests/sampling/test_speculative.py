"""Verification of speculative tokens: sampled output follows the target distribution at
every position (chi-square on a tiny vocabulary), greedy keeps exactly the argmax run, and
each position gets its own penalties and min_tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.sampling.sampler import Sampler
from tokenmill.sampling.speculative import verify

VOCAB = 8
LOGITS = torch.tensor(
    [
        [1.5, 0.2, 1.0, -0.5, 0.8, 0.0, -1.0, 0.3],
        [0.1, 1.2, -0.3, 0.9, 0.4, 1.1, -0.8, 0.0],
        [0.6, -0.2, 0.7, 0.0, 1.3, -1.0, 0.5, 0.9],
    ]
)
DRAFTS = [0, 1]  # the most likely tokens, accepted often enough to test every position
NUM_TRIALS = 3000
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _request(params: SamplingParams, output: tuple[int, ...] = ()) -> Request:
    req = Request("r", [3, 3, 6], params, eos_token_ids=frozenset({7}))
    req.output_token_ids = list(output)
    return req


def _target(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor) -> torch.Tensor:
    """Reference probabilities of one position, written out independently of the sampler."""
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    logits = logits / params.temperature
    order = logits.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    k = params.top_k if params.top_k > 0 else VOCAB
    probs = logits[order[:k]].softmax(-1)
    cum = 0.0
    for rank, token in enumerate(order[:k].tolist()):
        keep[token] = True
        cum += float(probs[rank])
        if cum >= params.top_p:
            break
    return logits.masked_fill(~keep, float("-inf")).softmax(-1)


def _chi2(observed: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    total = float(observed.sum())
    support = expected_p > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    exp = expected_p[support] * total
    obs = observed[support]
    return float(((obs - exp) ** 2 / exp).sum()), int(support.sum()) - 1


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, frequency_penalty=0.8),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p", "top_k_p_penalty"])
def test_every_position_follows_the_target_distribution(params: SamplingParams) -> None:
    sampler = Sampler(torch.device("cpu"), seed=7)
    request = _request(params)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)  # given the first draft was accepted
    third = torch.zeros(VOCAB)  # given both were
    for _ in range(NUM_TRIALS):
        tokens = verify(sampler, LOGITS, request, DRAFTS).token_ids
        first[tokens[0]] += 1
        if len(tokens) > 1:
            assert tokens[0] == DRAFTS[0]
            second[tokens[1]] += 1
        if len(tokens) > 2:
            assert tokens[1] == DRAFTS[1]
            third[tokens[2]] += 1
    counts = torch.zeros(VOCAB)
    expected = [_target(LOGITS[0], params, counts)]
    counts[DRAFTS[0]] += 1  # penalties at position 1 see the accepted draft
    expected.append(_target(LOGITS[1], params, counts.clone()))
    counts[DRAFTS[1]] += 1
    expected.append(_target(LOGITS[2], params, counts.clone()))
    for observed, want in zip((first, second, third), expected, strict=True):
        assert observed.sum() > 200, "too few samples reached this position to test it"
        stat, dof = _chi2(observed, want)
        assert stat < CHI2_CRIT[dof], (stat, dof, observed / observed.sum(), want)


def test_greedy_keeps_the_argmax_run_and_adds_the_next_argmax() -> None:
    sampler = Sampler(torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0)
    assert verify(sampler, LOGITS, _request(greedy), [0, 1]).token_ids == [0, 1, 4]
    assert verify(sampler, LOGITS, _request(greedy), [0, 3]).token_ids == [0, 1]
    assert verify(sampler, LOGITS, _request(greedy), [2, 1]).token_ids == [0]
    out = verify(sampler, LOGITS, _request(SamplingParams(temperature=0.0, logprobs=1)), [0, 1])
    raw = LOGITS.log_softmax(-1)
    assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)] == (
        pytest.approx([raw[0, 0].item(), raw[1, 1].item(), raw[2, 4].item()])
    )
    assert (out.num_draft_tokens, out.num_accepted) == (2, 2)


def test_penalties_and_min_tokens_apply_per_position() -> None:
    sampler = Sampler(torch.device("cpu"))
    # token 1 is the argmax at positions 0 and 1; accepted at 0, it is penalised at 1
    logits = LOGITS.clone()
    logits[0, 1] = 3.0
    penalised = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert verify(sampler, logits, _request(penalised), [1, 1]).token_ids == [1, 5]
    assert verify(sampler, logits, _request(penalised), [1, 5]).token_ids == [1, 5, 4]
    plain = SamplingParams(temperature=0.0)
    assert verify(sampler, logits, _request(plain), [1, 1]).token_ids == [1, 1, 4]
    # EOS (7) is banned while output < min_tokens: only at the first position here
    logits = LOGITS.clone()
    logits[:, 7] = 5.0
    min_tokens = SamplingParams(temperature=0.0, min_tokens=2)
    assert verify(sampler, logits, _request(min_tokens, output=(4,)), [7, 7]).token_ids == [0]
    # after one more token EOS is allowed (the engine then cuts the run at it)
    out = verify(sampler, logits, _request(min_tokens, output=(4,)), [0, 7])
    assert out.token_ids == [0, 7, 7]


def test_a_seeded_request_is_deterministic() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for global_seed in (1, 2):
        sampler = Sampler(torch.device("cpu"), seed=global_seed)
        runs.append(
            [verify(sampler, LOGITS, _request(params), DRAFTS).token_ids for _ in range(20)]
        )
    assert runs[0] == runs[1]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    drafts=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=4),
)
def test_greedy_fast_path_keeps_what_the_per_position_path_keeps(
    seed: int, drafts: list[int]
) -> None:
    """A greedy request that nothing processes skips the per-position views and the
    sampler's processing (spied on), and keeps exactly the tokens the general path keeps
    (the same request asking logprobs takes the general path)."""
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=torch.Generator().manual_seed(seed))
    # Drafts that follow the argmax run for a while, so long accepted runs are covered.
    argmax = logits.argmax(dim=-1).tolist()
    cut = seed % (len(drafts) + 1)
    drafts = argmax[:cut] + drafts[cut:]
    sampler = Sampler(torch.device("cpu"))
    calls: list[int] = []
    process = sampler.process
    sampler.process = lambda *a, **kw: calls.append(1) or process(*a, **kw)  # type: ignore[method-assign]
    fast = verify(sampler, logits, _request(SamplingParams(temperature=0.0)), drafts)
    assert calls == []
    general = verify(sampler, logits, _request(SamplingParams(temperature=0.0, logprobs=1)), drafts)
    assert calls == [1]
    assert fast.token_ids == general.token_ids
    assert fast.num_draft_tokens == general.num_draft_tokens == len(drafts)
    assert fast.logprobs == [None] * len(fast.token_ids)
