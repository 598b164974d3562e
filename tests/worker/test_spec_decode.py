"""Speculative decoding's proposer seam (``worker/spec_decode``).

A toy method registered here, with no change to engine, scheduler or worker code, runs end
to end: its guesses reach the verifier, greedy output stays exactly the target's, and only
counts ever cross to the engine. The n-gram proposer keeps its index in step with the
request and proposes what the scan of the whole history proposes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from tokenmill.core.messages import StepOutput, VerifiedTokens
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.core.speculative import BUDGETED_METHODS, METHODS, ngram_propose
from tokenmill.entrypoints.llm import LLM
from tokenmill.worker.spec_decode import PROPOSERS, Proposer, ProposerContext, register_proposer
from tokenmill.worker.spec_decode.ngram import NgramProposer


class RepeatLastProposer(Proposer):
    """Guesses that the last token repeats: a toy, right sometimes on a looping model."""

    instances: list[RepeatLastProposer] = []

    def __init__(self) -> None:
        self.proposed = 0
        self.asked: list[int] = []
        self.dropped: set[str] = set()
        self._last: dict[str, int] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> RepeatLastProposer:
        proposer = cls()
        cls.instances.append(proposer)
        return proposer

    def propose(self, batch: ScheduledBatch) -> None:
        for request, _ in batch.scheduled:
            if request.num_spec_tokens:
                last = self._last[request.request_id]
                request.spec_token_ids = [last] * request.num_spec_tokens
                self.proposed += request.num_spec_tokens

    def num_proposable(
        self, batch: ScheduledBatch, output: StepOutput, limit: int
    ) -> dict[str, int]:
        self.asked.append(limit)
        counts = {}
        for request, _ in batch.scheduled:
            rid = request.request_id
            if rid in output.sampled:
                verified = output.verified.get(rid)
                self._last[rid] = verified.token_ids[-1] if verified else output.sampled[rid]
                counts[rid] = limit
        return counts

    def drop(self, request_ids: Iterable[str]) -> None:
        self.dropped.update(request_ids)


@pytest.fixture
def toy_method():
    register_proposer("repeat_last", RepeatLastProposer)
    RepeatLastProposer.instances.clear()
    yield "repeat_last"
    PROPOSERS.pop("repeat_last")
    METHODS.discard("repeat_last")
    BUDGETED_METHODS.discard("repeat_last")


def test_a_registered_toy_proposer_runs_end_to_end(make_model, toy_method: str) -> None:
    folder = make_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 400) for _ in range(rng.randint(5, 20))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, enforce_eager=True)
    plain = LLM(str(folder), **kwargs).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        str(folder),
        speculative_config={"method": toy_method, "num_speculative_tokens": 2},
        **kwargs,
    )
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    (proposer,) = RepeatLastProposer.instances
    stats = spec.engine.stats
    assert proposer.proposed > 0 and stats.spec_num_draft_tokens == proposer.proposed
    assert set(proposer.asked) <= {0, 2} and 2 in proposer.asked  # the policy's k
    # Finished requests are dropped with the next step's plan (the last one's comes next).
    spec.generate(prompts[:1], params, use_tqdm=False)
    assert {o.request_id for o in got} <= proposer.dropped


def _mirror(rid: str, prompt: list[int], output: list[int]) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=100))
    request.output_token_ids = list(output)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_ngram_proposer_follows_the_scan_through_steps_and_verification() -> None:
    """After each step, the proposal equals the scan over the request's tokens and the
    step's new ones (one sampled, or a verified run); the next step takes its prefix."""
    proposer = NgramProposer(1, 3)
    rng = random.Random(7)
    prompt = [rng.randrange(5) for _ in range(12)]
    output: list[int] = []
    for step in range(30):
        request = _mirror("a", prompt, output)
        new = [rng.randrange(5) for _ in range(rng.choice([1, 1, 3]))]
        out = StepOutput(sampled={"a": new[0]})
        if len(new) > 1:
            out.verified["a"] = VerifiedTokens(new, [None] * len(new), len(new) - 1)
        batch = ScheduledBatch(scheduled=[(request, 1)])
        counts = proposer.num_proposable(batch, out, limit=3)
        want = ngram_propose(prompt + output + new, 3, 1, 3)
        assert counts.get("a", 0) == len(want), step
        output += new
        if want:
            request = _mirror("a", prompt, output)
            request.num_spec_tokens = len(want) - 1 if len(want) > 1 else len(want)
            proposer.propose(ScheduledBatch(scheduled=[(request, 1 + request.num_spec_tokens)]))
            assert request.spec_token_ids == want[: request.num_spec_tokens]
    # a request whose tokens were replaced (taken again) starts its index again
    request = _mirror("a", [9, 8, 9], [])
    counts = proposer.num_proposable(
        ScheduledBatch(scheduled=[(request, 1)]), StepOutput(sampled={"a": 8}), limit=3
    )
    assert counts == {"a": len(ngram_propose([9, 8, 9, 8], 3, 1, 3))}
    proposer.drop(["a"])
    assert not proposer._indexes and not proposer._proposals


def test_beams_and_unsampled_requests_get_no_proposal() -> None:
    proposer = NgramProposer(1, 2)
    beam = _mirror("b", [1, 2, 1, 2], [])
    beam.is_beam = True
    mid_prefill = _mirror("p", [1, 2, 1, 2], [])
    batch = ScheduledBatch(scheduled=[(beam, 1), (mid_prefill, 3)])
    assert proposer.num_proposable(batch, StepOutput(sampled={"b": 1}), limit=2) == {}
