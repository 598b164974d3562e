"""Sampler: each parameter reshapes the distribution exactly as a reference computation says."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling.sampler import Sampler, apply_penalties

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, 0.7])
NUM_SAMPLES = 40_000
TOL = 0.012  # ~4 sigma for p=0.5 at 40k samples


def _requests(params: SamplingParams, num: int, prompt=(1, 2, 3), output=()) -> list[Request]:
    reqs = []
    for i in range(num):
        r = Request(f"r{i}", list(prompt), params, eos_token_ids=frozenset({11}))
        r.output_token_ids = list(output)
        reqs.append(r)
    return reqs


def _empirical(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=123)
    tokens = sampler(logits.repeat(NUM_SAMPLES, 1), _requests(params, NUM_SAMPLES)).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / NUM_SAMPLES


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=TOL), f"\n got {got}\nwant {want}"


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature(temperature: float) -> None:
    _assert_close(
        _empirical(SamplingParams(temperature=temperature)), (LOGITS / temperature).softmax(-1)
    )


def test_top_k_keeps_k_most_likely() -> None:
    want = torch.zeros(VOCAB)
    top = LOGITS.topk(3).indices
    want[top] = LOGITS[top].softmax(-1)
    _assert_close(_empirical(SamplingParams(top_k=3)), want)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = LOGITS.softmax(-1)
    order = probs.argsort(descending=True)
    keep = order[: int((probs[order].cumsum(0) < 0.8).sum()) + 1]  # smallest set with mass >= 0.8
    want = torch.zeros(VOCAB)
    want[keep] = probs[keep] / probs[keep].sum()
    _assert_close(_empirical(SamplingParams(top_p=0.8)), want)


def test_min_p_drops_unlikely_tokens() -> None:
    probs = LOGITS.softmax(-1)
    keep = probs >= 0.2 * probs.max()
    want = torch.where(keep, probs, 0.0)
    _assert_close(_empirical(SamplingParams(min_p=0.2)), want / want.sum())


def test_greedy_is_argmax_and_ignores_seed_noise() -> None:
    sampler = Sampler(torch.device("cpu"))
    out = sampler(LOGITS.repeat(5, 1), _requests(SamplingParams(temperature=0.0), 5))
    assert out.token_ids == [0] * 5


def test_penalties_match_reference() -> None:
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    req = _requests(params, 1, prompt=(0, 4), output=(1, 1, 6))[0]
    got = apply_penalties(LOGITS.clone().unsqueeze(0), [req])[0]
    want = LOGITS.clone()
    for t in {0, 4, 1, 6}:  # repetition: prompt and output tokens
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, count in {1: 2, 6: 1}.items():  # frequency and presence: output tokens only
        want[t] -= 0.4 * count + 0.25
    assert torch.allclose(got, want)


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 11] = 10.0  # EOS is by far the most likely
    logits[0, 5] = 9.0  # then a stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    req = _requests(params, 1)[0]
    assert Sampler(torch.device("cpu"))(logits, [req]).token_ids != [11]
    assert Sampler(torch.device("cpu"))(logits, [req]).token_ids != [5]
    req.output_token_ids = [3, 3]
    assert Sampler(torch.device("cpu"))(logits, [req]).token_ids == [11]


def test_seed_reproduces_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(torch.device("cpu"), seed=0)
    crowd = Sampler(torch.device("cpu"), seed=99)
    req_a = _requests(seeded, 1)[0]
    req_b = _requests(seeded, 1)[0]
    others = _requests(SamplingParams(temperature=1.0), 7)
    seq_a, seq_b = [], []
    for _ in range(30):
        seq_a.append(alone(LOGITS.unsqueeze(0), [req_a]).token_ids[0])
        batch = others[:3] + [req_b] + others[3:]
        seq_b.append(crowd(LOGITS.repeat(8, 1), batch).token_ids[3])
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1  # it is really sampling


def test_logprobs_are_raw_with_rank() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0)
    out = Sampler(torch.device("cpu"))(LOGITS.unsqueeze(0), _requests(params, 1))
    entry = out.logprobs[0]
    raw = LOGITS.log_softmax(-1)
    token = out.token_ids[0]
    assert abs(entry[token].logprob - raw[token].item()) < 1e-6
    assert entry[0].rank == 1 and entry[1].rank == 2
    assert entry[token].rank == int((raw > raw[token]).sum()) + 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", -1),
        ("n", 10**9),
        ("n", "5"),
        ("n", 1.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("seed", 2**63),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 2**63),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop", ["x"] * 100_000),
        ("stop_token_ids", [-1]),
        ("min_tokens", -1),
        ("spaces_between_special_tokens", False),
    ],
)
def test_invalid_params_name_the_field(field: str, value) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize("temperature", [0.0, 1e-5 + 1e-9, 0.5])
@pytest.mark.parametrize("repetition_penalty", [1e-300, 1e-40])
def test_extreme_finite_repetition_penalty_never_makes_nan_logits(
    temperature: float, repetition_penalty: float
) -> None:
    """A penalty that underflows float32 made logits/0 = inf and -inf * 0 = NaN: every
    row then sampled token 0 (NaN's argmax). Seen tokens with positive logits must win."""
    logits = torch.tensor([[-1.0, 1.0, 2.0, -float("inf"), 0.5]])
    params = SamplingParams(temperature=temperature, repetition_penalty=repetition_penalty, seed=7)
    (request,) = _requests(params, 1, prompt=(1, 2, 3))
    sampler = Sampler(torch.device("cpu"), seed=1)
    for _ in range(20):
        (token,) = sampler(logits, [request]).token_ids
        assert token in (1, 2)
