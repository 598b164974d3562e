"""The engine's error boundary: what raises while sampling or post-processing one request
fails that request alone; the batch it ran in and the engine go on."""

from __future__ import annotations

import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import RequestFailedError
from tokenmill.sampling.sampler import Sampler

BAD_SEED = 666
"""The seed that marks the request whose sampling the tests make raise."""


class _FlakySampler(Sampler):
    """Raises for any batch that holds a request seeded with ``BAD_SEED``."""

    def __call__(self, logits, requests, token_bitmask=None):  # type: ignore[no-untyped-def]
        if any(r.sampling_params.seed == BAD_SEED for r in requests):
            raise RuntimeError("injected sampling failure")
        return super().__call__(logits, requests, token_bitmask)


@pytest.fixture(scope="module")
def llm(make_model) -> LLM:
    return LLM(str(make_model("llama")), dtype="float32", max_model_len=256)


GOOD = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1)
BAD = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=BAD_SEED)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _run_all(llm: LLM, batch: list[tuple[str, list[int], SamplingParams]]) -> dict:
    engine = llm.engine
    for rid, prompt, params in batch:
        engine.add_request(rid, prompt, params)
    finished, failed = {}, {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        failed.update(engine.take_failures())
    assert not engine.has_unfinished_requests()
    return {"finished": finished, "failed": failed}


def test_a_failing_sampler_row_fails_its_request_only(llm: LLM) -> None:
    want = {
        f"ok{i}": out.outputs[0].token_ids
        for i, out in enumerate(llm.generate(PROMPTS, GOOD, use_tqdm=False))
    }
    sampler = llm.engine.runner.sampler
    sampler.__class__ = _FlakySampler
    try:
        got = _run_all(
            llm,
            [(f"ok{i}", p, GOOD) for i, p in enumerate(PROMPTS)] + [("bad", [20, 21, 22], BAD)],
        )
    finally:
        sampler.__class__ = Sampler
    assert got["finished"] == want  # same tokens as without the failing neighbour
    assert set(got["failed"]) == {"bad"}
    assert isinstance(got["failed"]["bad"], RequestFailedError)
    assert llm.engine.kv_manager.usage == 0.0  # the failed request's KV was freed
    # The engine is intact: the same prompt serves normally afterwards.
    assert llm.generate([[20, 21, 22]], GOOD, use_tqdm=False)[0].outputs[0].token_ids


def test_a_failing_post_processing_fails_its_request_only(llm: LLM, monkeypatch) -> None:
    processor = llm.engine.output_processor
    real_on_token = processor.on_token

    def on_token(child_id, token_id, logprobs):  # type: ignore[no-untyped-def]
        if child_id.startswith("bad"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_on_token(child_id, token_id, logprobs)

    monkeypatch.setattr(processor, "on_token", on_token)
    n2 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    got = _run_all(llm, [("ok", PROMPTS[0], GOOD), ("bad", PROMPTS[1], n2)])
    assert set(got["finished"]) == {"ok"} and len(got["finished"]["ok"]) == 8
    assert set(got["failed"]) == {"bad"}


def test_a_failing_beam_search_step_fails_that_search_only(llm: LLM, monkeypatch) -> None:
    from tokenmill.core.beam_search import BeamSearch

    real_step = BeamSearch.step

    def step(self, top_logprobs):  # type: ignore[no-untyped-def]
        if self.max_tokens == 7:  # the marked search
            raise OverflowError("injected")
        return real_step(self, top_logprobs)

    monkeypatch.setattr(BeamSearch, "step", step)
    beam = SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True)
    bad_beam = beam.clone(max_tokens=7)
    got = _run_all(
        llm, [("beam", PROMPTS[0], beam), ("bad", PROMPTS[1], bad_beam), ("ok", PROMPTS[2], GOOD)]
    )
    assert set(got["finished"]) == {"beam", "ok"}
    assert set(got["failed"]) == {"bad"}
    assert llm.engine.kv_manager.usage == 0.0


def test_offline_generate_raises_the_failure_and_the_engine_serves_on(llm: LLM) -> None:
    sampler = llm.engine.runner.sampler
    sampler.__class__ = _FlakySampler
    try:
        with pytest.raises(RequestFailedError):
            llm.generate([PROMPTS[0], PROMPTS[1]], [GOOD, BAD], use_tqdm=False)
    finally:
        sampler.__class__ = Sampler
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], GOOD, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_extreme_finite_length_penalty_runs_a_beam_search(llm: LLM) -> None:
    """``length_penalty=1000`` raised OverflowError inside the step and killed the engine."""
    for penalty in (1000.0, -1000.0, 1e308):
        params = SamplingParams(
            n=2, use_beam_search=True, max_tokens=6, ignore_eos=True, length_penalty=penalty
        )
        (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
        assert len(out.outputs) == 2 and all(o.token_ids for o in out.outputs)
