"""Beam search: the best beam equals transformers' ``generate(num_beams=k)`` (fp32), beams
share their prefix KV (prefill once, copy-on-write) and free it when pruned or finished."""

from __future__ import annotations

import functools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from tokenmill.core.beam_search_params import BeamSearchParams
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError

MAX_NEW = 12


def _prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 30))] for _ in range(num)]


@functools.cache
def _hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_beam_search(
    folder: Path,
    prompt: list[int],
    width: int,
    eos_token_ids: list[int],
    length_penalty: float,
    early_stopping: bool | str,
    num_return: int = 1,
) -> list[list[int]]:
    model = _hf_model(folder)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            num_beams=width,
            num_return_sequences=num_return,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos_token_ids,
            pad_token_id=-1,
        )
    return [[t for t in row[len(prompt) :].tolist() if t != -1] for row in out]


@pytest.fixture(scope="module")
def llama(make_model) -> tuple[Path, LLM]:
    folder = make_model("llama")
    return folder, LLM(str(folder), dtype="float32", max_model_len=128, block_size=4)


def _stop_token(llm: LLM, prompt: list[int]) -> int:
    """A token greedy decoding emits early: as an extra stop token, beams end at different lengths."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids[2]


def _check_kv_accounting(engine: LLMEngine) -> None:
    """Every block's ref count is the number of live requests whose table holds it."""
    kv = engine.kv_manager
    holders: Counter[int] = Counter()
    for rid in engine.scheduler.requests:
        holders.update(kv.block_table(rid))
    for block in kv.pool.blocks:  # type: ignore[attr-defined]
        assert block.ref_count == holders[block.block_id]


def _run_checked(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list, dict]:
    """Step the engine by hand, checking the KV accounting after every step."""
    engine = llm.engine
    seen = {"max_shared": 0, "copies": 0, "decode_only_after_prefill": True}
    take = engine.kv_manager.take_block_copies

    def counting_take() -> list[tuple[int, int]]:
        copies = take()
        seen["copies"] += len(copies)
        return copies

    engine.kv_manager.take_block_copies = counting_take  # type: ignore[method-assign]
    schedule = engine.scheduler.schedule
    num_steps = 0

    def checking_schedule():
        nonlocal num_steps
        out = schedule()
        if num_steps > 0 and any(n != 1 for _, n in out.scheduled):
            seen["decode_only_after_prefill"] = False  # something was recomputed
        num_steps += 1
        return out

    engine.scheduler.schedule = checking_schedule  # type: ignore[method-assign]
    try:
        engine.add_request("beam", prompt, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            _check_kv_accounting(engine)
            pool = engine.kv_manager.pool  # type: ignore[attr-defined]
            seen["max_shared"] = max(seen["max_shared"], max(b.ref_count for b in pool.blocks))
    finally:
        del engine.kv_manager.take_block_copies
        del engine.scheduler.schedule
    pool = engine.kv_manager.pool  # type: ignore[attr-defined]
    assert pool.num_free_blocks == engine.kv_manager.num_blocks  # nothing leaked
    assert not engine.scheduler.requests
    return outputs, seen


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_best_beam_matches_transformers(llama, width: int, length_penalty: float) -> None:
    folder, llm = llama
    for prompt in _prompts(llm.tokenizer.vocab_size, 2, seed=width):
        stop = _stop_token(llm, prompt)
        params = SamplingParams(
            n=1,
            best_of=width,
            use_beam_search=True,
            max_tokens=MAX_NEW,
            stop_token_ids=[stop],
            length_penalty=length_penalty,
        )
        outputs, seen = _run_checked(llm, prompt, params)
        eos = sorted(llm.engine.eos_token_ids | {stop})
        (want,) = hf_beam_search(folder, prompt, width, eos, length_penalty, False)
        (out,) = outputs
        assert out.finished and len(out.outputs) == 1
        assert out.outputs[0].token_ids == want
        assert seen["decode_only_after_prefill"]  # the prompt was prefilled once, for all beams
        if width > 1:
            assert seen["max_shared"] > 1  # beams shared blocks


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_early_stopping_and_n_best_match_transformers(llama, early_stopping: bool | str) -> None:
    folder, llm = llama
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=7)[0]
    stop = _stop_token(llm, prompt)
    params = SamplingParams(
        n=3,
        best_of=4,
        use_beam_search=True,
        max_tokens=MAX_NEW,
        stop_token_ids=[stop],
        length_penalty=1.5,
        early_stopping=early_stopping,
    )
    outputs, seen = _run_checked(llm, prompt, params)
    eos = sorted(llm.engine.eos_token_ids | {stop})
    want = hf_beam_search(folder, prompt, 4, eos, 1.5, early_stopping, num_return=3)
    assert [c.token_ids for c in outputs[0].outputs] == want
    assert seen["copies"] > 0 or seen["max_shared"] > 1


def test_width_one_is_greedy(llama) -> None:
    _, llm = llama
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=3)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, max_tokens=MAX_NEW, ignore_eos=True)
    (g,), (b,) = llm.generate([prompt], greedy), llm.generate([prompt], beam)
    assert b.outputs[0].token_ids == g.outputs[0].token_ids
    assert b.outputs[0].text == g.outputs[0].text


def test_offline_beam_search_api(llama) -> None:
    _, llm = llama
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=5)
    results = llm.beam_search(
        prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    )
    assert len(results) == 3
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.sequences) == 3
        scores = [s.cum_logprob for s in result.sequences]
        assert scores == sorted(scores, reverse=True)  # same length: ranked by log-probability
        for seq in result.sequences:
            assert seq.tokens[: len(prompt)] == prompt and len(seq.output_token_ids) == 6
            assert seq.finish_reason == "length"
    assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.kv_manager.num_blocks  # type: ignore[attr-defined]


def test_abort_frees_every_beam(llama) -> None:
    _, llm = llama
    engine = llm.engine
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=9)[0]
    engine.add_request("a", prompt, SamplingParams(best_of=4, use_beam_search=True, max_tokens=30))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.requests) == 4
    engine.abort_request("a")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks  # type: ignore[attr-defined]


def test_beam_search_requests_wait_in_their_own_queue(make_model) -> None:
    llm = LLM(
        str(make_model("llama")), dtype="float32", max_model_len=128, max_beam_search_requests=1
    )
    engine = llm.engine
    beam = SamplingParams(best_of=2, use_beam_search=True, max_tokens=8, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"b{i}", [5, 6, 7, 8 + i], beam)
    engine.add_request(
        "s", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    engine.step()
    # One search runs (its prompt), the other two wait outside the scheduler; the standard
    # request was scheduled in the same first step.
    assert engine.beam_search.num_queued == 2 and engine.stats.num_waiting == 2
    assert {r.parent_id for r in engine.scheduler.running} == {"b0", "s"}
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        assert engine.beam_search.num_active <= 1
    assert finished[0] == "s" and sorted(finished) == ["b0", "b1", "b2", "s"]


def test_running_beams_take_no_standard_place_in_the_batch(make_model) -> None:
    """Beams filled --max-num-seqs, so standard requests waited for a whole
    search. Beams are counted apart: standard requests start in the next step."""
    llm = LLM(str(make_model("llama")), dtype="float32", max_model_len=128, max_num_seqs=2)
    engine = llm.engine
    beam = SamplingParams(best_of=2, use_beam_search=True, max_tokens=40, ignore_eos=True)
    engine.add_request("b", [5, 6, 7, 8], beam)
    for _ in range(3):
        engine.step()
    assert sum(r.is_beam for r in engine.scheduler.running) == 2  # the batch bound, in beams
    std = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("s1", [9, 10, 11], std)
    engine.add_request("s2", [12, 13], std)
    engine.step()
    running = {r.parent_id for r in engine.scheduler.running}
    assert {"s1", "s2", "b"} <= running, running
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[:2] == ["s1", "s2"] or finished[:2] == ["s2", "s1"]


def test_static_kv_refuses_beam_search(make_model) -> None:
    llm = LLM(
        str(make_model("llama")),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        kv_cache="static",
        enforce_eager=True,
    )
    with pytest.raises(InvalidRequestError, match="paged") as err:
        llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, best_of=2))
    assert err.value.param == "use_beam_search"


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"best_of": 300}, "best_of"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_unsupported_beam_options_are_refused(llama, changes: dict, param: str) -> None:
    _, llm = llama
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[5, 6, 7]], SamplingParams(**{"use_beam_search": True, **changes}))
    assert err.value.param == param


def test_preempted_beams_recompute_and_still_match(make_model, llama) -> None:
    """A KV pool too small for every beam: beams are preempted and recomputed, the result
    is unchanged and nothing leaks."""
    _, roomy = llama
    folder = make_model("llama")
    tight = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        kv_cache_memory=10
        * 4
        * roomy.engine.kv_cache_bytes
        // roomy.engine.kv_manager.num_blocks
        // 4,
    )
    assert tight.engine.kv_manager.num_blocks == 10
    prompt = _prompts(tight.tokenizer.vocab_size, 1, seed=11)[0][:10]
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=14, ignore_eos=True)
    standard = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = roomy.generate([prompt], params)[0]
    got = tight.generate([prompt, prompt[:5]], [params, standard])[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert tight.engine.stats.num_preemptions > 0
    assert tight.engine.beam_search.num_parked_beams > 0  # siblings stepped aside for it
    kv = tight.engine.kv_manager
    assert kv.pool.num_free_blocks == kv.num_blocks  # type: ignore[attr-defined]


def test_concurrent_searches_equal_solo_runs(llama) -> None:
    """Beams of two searches and standard requests in one batch: each search's result is
    the one it gets alone, and an aborted queued search ends at once."""
    _, llm = llama
    engine = llm.engine
    prompts = _prompts(llm.tokenizer.vocab_size, 2, seed=13)
    params = [
        SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=9, ignore_eos=True),
        SamplingParams(n=1, best_of=2, use_beam_search=True, max_tokens=7, length_penalty=0.0),
    ]
    solo = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    together = llm.generate(prompts + prompts, params + [greedy, greedy])
    for alone, mixed in zip(solo, together[:2], strict=True):
        assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    engine.add_request("q1", prompts[0], params[0])
    engine.add_request("q2", prompts[1], params[1])
    engine.abort_request("q2")
    done = {o.request_id: o for o in engine.step()}
    assert done["q2"].outputs[0].finish_reason == "abort"
    engine.abort_request("q1")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks  # type: ignore[attr-defined]


def test_qwen3_best_beam_matches_transformers(make_model) -> None:
    folder = make_model("qwen3")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, block_size=4)
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=17)[0]
    stop = _stop_token(llm, prompt)
    params = SamplingParams(
        best_of=4, use_beam_search=True, max_tokens=MAX_NEW, stop_token_ids=[stop]
    )
    (want,) = hf_beam_search(
        folder, prompt, 4, sorted(llm.engine.eos_token_ids | {stop}), 1.0, False
    )
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == want
