"""The multi-process executor: a worker in its own process, talked to in msgpack only.

Every answer must equal the in-process executor's (greedy and seeded sampling, structured
outputs whose grammar is compiled again in the worker, preemption, both KV strategies), and
a worker that dies is named in the error instead of leaving the engine waiting.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.executor import WorkerDiedError
from tokenmill.executor.multiproc import MultiprocExecutor


@pytest.fixture(scope="module")
def folder(make_model):
    return make_model("llama")


def _prompts(num: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(low, high))] for _ in range(num)]


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_mp_worker_answers_exactly_as_the_in_process_one(folder, kv_cache: str) -> None:
    system = list(range(10, 42))  # a shared prefix: prefix caching hits on both sides
    prompts = [system + p for p in _prompts(8, seed=3, low=20, high=50)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, repetition_penalty=1.3),
    ]
    # Tight KV (paged): 14 blocks of 8 tokens force preemption and recompute.
    kwargs = dict(
        dtype="float32",
        max_model_len=128,
        block_size=8,
        kv_cache=kv_cache,
        max_num_seqs=4,
        enforce_eager=True,
    )
    if kv_cache == "paged":
        kwargs["kv_cache_memory"] = 14 * 8 * 2 * 2 * 2 * 16 * 4
    local = LLM(str(folder), **kwargs)
    remote = LLM(str(folder), distributed_executor_backend="mp", **kwargs)
    try:
        assert isinstance(remote.engine.executor, MultiprocExecutor)
        for p in params:
            want = local.generate(prompts, p, use_tqdm=False)
            got = remote.generate(prompts, p, use_tqdm=False)
            assert _tokens(got) == _tokens(want)
            if p.logprobs:
                assert [c.logprobs for o in got for c in o.outputs] == [
                    c.logprobs for o in want for c in o.outputs
                ]
        if kv_cache == "paged":
            assert remote.engine.stats.num_preemptions > 0
            assert remote.engine.stats.num_prefix_hit_tokens > 0
        choice = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        )
        want_text = [o.outputs[0].text for o in local.generate(prompts[:2], choice, use_tqdm=False)]
        got_text = [o.outputs[0].text for o in remote.generate(prompts[:2], choice, use_tqdm=False)]
        assert got_text == want_text
        assert set(got_text) <= {"yes", "no"}
    finally:
        remote.engine.shutdown()


def test_a_killed_worker_is_named_and_never_hangs(folder) -> None:
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        distributed_executor_backend="mp",
        enforce_eager=True,
    )
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    pid = executor.pids[0]
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=f"rank 0 died: process {pid} exited"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)
        with pytest.raises(WorkerDiedError):
            executor.check_health()
    finally:
        llm.engine.shutdown()


def test_a_grammar_stops_on_a_generation_config_eos_under_mp(folder, tmp_path) -> None:
    """The EOS ids are resolved once (config, tokenizer, generation_config.json) and worker
    processes use that one set: a chat model's generation_config.json adds its end-of-turn
    token, and a grammar must be allowed to stop on it in a worker process exactly as in the
    engine's process (the workers used to leave generation_config.json out)."""
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    end_of_turn = 3  # <|im_end|>: EOS only through generation_config.json
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end_of_turn]}))
    kwargs = dict(dtype="float32", max_model_len=128, enforce_eager=True)
    params = SamplingParams(  # the grammar may end after any letter; end-of-turn is favoured
        temperature=0.0,
        max_tokens=16,
        logit_bias={end_of_turn: 50.0},
        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
    )
    prompts = _prompts(3, seed=5)
    local = LLM(str(model), **kwargs)
    want = local.generate(prompts, params, use_tqdm=False)
    remote = LLM(str(model), distributed_executor_backend="mp", **kwargs)
    try:
        got = remote.generate(prompts, params, use_tqdm=False)
    finally:
        remote.engine.shutdown()
    assert [c.token_ids[-1] for o in want for c in o.outputs] == [end_of_turn] * 3
    assert [(c.text, c.token_ids, c.finish_reason) for o in got for c in o.outputs] == [
        (c.text, c.token_ids, c.finish_reason) for o in want for c in o.outputs
    ]
