"""GrammarMasks and the sampler: packed masks, EOS only where the grammar can end, replay."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams as S
from tokenmill.model.demo import demo_model_path
from tokenmill.sampling.sampler import Sampler
from tokenmill.structured.bitmask import GrammarMasks, apply_token_bitmask
from tokenmill.structured.grammar import GrammarCompiler

VOCAB = 2048
EOS = 3


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    text = (demo_model_path() / "tokenizer.json").read_text()
    return GrammarCompiler(text, vocab_size=VOCAB, eos_token_ids=[1, EOS])


def _request(rid: str, grammar: object | None, output: list[int] | None = None) -> Request:
    r = Request(rid, [5, 6, 7], SamplingParams(temperature=0.0), frozenset({1, EOS}))
    r.grammar = grammar
    r.output_token_ids = list(output or [])
    return r


def test_apply_token_bitmask_unpacks_every_bit_including_the_sign_bit() -> None:
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # only token 31
    bitmask[1, 1] = 1  # only token 32
    logits = torch.zeros(2, 64)
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [32]


def test_unconstrained_batches_build_no_mask_and_rows_without_grammar_allow_everything(
    compiler: GrammarCompiler,
) -> None:
    masks = GrammarMasks(VOCAB)
    assert masks.bitmask([_request("a", None)]) is None
    grammar = compiler.compile(S(choice=["yes", "no"]))
    bitmask = masks.bitmask([_request("a", None), _request("b", grammar)])
    assert bitmask is not None
    assert (bitmask[0] == -1).all()
    logits = torch.zeros(2, VOCAB)
    apply_token_bitmask(logits, bitmask)
    allowed = {
        compiler.tokenizer.decode_str([t])
        for t in torch.isfinite(logits[1]).nonzero().flatten().tolist()
    }
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)


def test_eos_only_where_the_grammar_can_end_and_completion_is_reported(
    compiler: GrammarCompiler,
) -> None:
    grammar = compiler.compile(S(regex="[0-9]{2,3}"))
    masks = GrammarMasks(VOCAB)
    digit = compiler.tokenizer.tokenize_str("7")
    assert len(digit) == 1
    request = _request("r", grammar)
    seen_eos = []
    for _ in range(3):
        bitmask = masks.bitmask([request])
        assert bitmask is not None
        seen_eos.append(bool(bitmask[0, EOS // 32] >> EOS & 1))
        ended = masks.accept([request], digit)
        request.output_token_ids.append(digit[0])
    assert seen_eos == [False, False, True]
    assert ended == {"r"}  # three digits: nothing more can follow


def test_a_dropped_matcher_is_rebuilt_by_replaying_the_output(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    prefix = compiler.tokenizer.tokenize_str('{"a":1')
    masks = GrammarMasks(VOCAB)
    fresh = masks.bitmask([_request("r", grammar, prefix)])
    masks.drop(["r"])  # preempted
    replayed = masks.bitmask([_request("r", grammar, prefix)])
    assert fresh is not None and replayed is not None and torch.equal(fresh, replayed)
    closing = compiler.tokenizer.tokenize_str("}")
    assert all(bool(replayed[0, t // 32] >> (t % 32) & 1) for t in closing)


def test_sampler_never_picks_a_masked_token_greedy_or_sampled(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(S(choice=["yes", "no"]))
    masks = GrammarMasks(VOCAB)
    sampler = Sampler(torch.device("cpu"))
    for temperature in (0.0, 1.0):
        r = _request(f"t{temperature}", grammar)
        r.sampling_params = SamplingParams(temperature=temperature, seed=1)
        logits = torch.randn(1, VOCAB)
        token = sampler(logits, [r], masks.bitmask([r])).token_ids[0]
        assert compiler.tokenizer.decode_str([token]) in ("y", "ye", "yes", "n", "no")
