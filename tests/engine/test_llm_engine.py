"""The whole engine on a tiny model: caching, preemption, n > 1, stops, aborts, seeds."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ContextLengthError, InvalidRequestError


@pytest.fixture(scope="module")
def folder(make_model):
    return make_model("llama")


def _prompts(num: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(low, high))] for _ in range(num)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_on_and_off_give_identical_tokens(folder) -> None:
    system = list(range(10, 50))  # a 40-token shared prefix
    prompts = [system + p for p in _prompts(6, seed=5, low=1, high=20)]
    on = LLM(str(folder), dtype="float32", max_model_len=256, block_size=8)
    off = LLM(
        str(folder), dtype="float32", max_model_len=256, block_size=8, enable_prefix_caching=False
    )
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = on.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert rest[0].num_cached_tokens == 40  # 5 full blocks of the shared prefix reused
    stats = on.engine.stats
    assert stats.num_prefix_hit_tokens >= 40 * 5
    assert _tokens(first + rest) == _tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    assert off.engine.stats.num_prefix_hit_tokens == 0


def test_kv_overflow_preempts_and_reproduces_unpressured_outputs(folder) -> None:
    prompts = _prompts(12, seed=6, low=30, high=60)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(folder), dtype="float32", max_model_len=256)
    # 12 blocks of 16 tokens: room for ~2 requests at full length
    tight = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4,
    )
    assert tight.engine.kv_manager.num_blocks == 12
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats.num_preemptions > 0
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
    assert _tokens(got) == _tokens(roomy.generate(prompts, params, use_tqdm=False))
    assert tight.engine.kv_manager.pool.num_free_blocks == 12
    assert all(b.ref_count == 0 for b in tight.engine.kv_manager.pool.blocks)


def test_n_samples_share_prompt_blocks(folder) -> None:
    llm = LLM(
        str(folder), dtype="float32", max_model_len=256, block_size=4, enable_prefix_caching=False
    )
    prompt = _prompts(1, seed=7, low=33, high=33)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    engine.add_request("x", prompt, params)
    engine.step()  # all four children prefill in one step
    tables = [engine.kv_manager.block_table(f"x#{i}") for i in range(4)]
    assert all(t[:8] == tables[0][:8] for t in tables)  # 8 full prompt blocks shared
    assert engine.kv_manager.pool.blocks[tables[0][0]].ref_count == 4
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks


def test_seed_reproduces_across_batches(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompt = _prompts(1, seed=8)[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    batch = llm.generate(_prompts(5, seed=9) + [prompt], [*others, params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone


def test_stop_strings_span_tokens_and_are_excluded(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompt = _prompts(1, seed=10)[0]
    full = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    text = full[0].outputs[0].text
    assert len(text) > 12
    stop = text[5:9]  # likely crosses a token boundary
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        cut = text.index(stop)
        assert out.text == (text[: cut + len(stop)] if include else text[:cut])
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_and_eos(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompt = _prompts(1, seed=11)[0]
    tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[tokens[3]], ignore_eos=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    cut = tokens.index(tokens[3])
    assert out.token_ids == tokens[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[3]


def test_abort_returns_blocks_and_finishes_with_abort(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    engine = llm.engine
    engine.add_request("a", _prompts(1, seed=12)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", _prompts(1, seed=13)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.usage == 0.0


def test_prompt_logprobs_match_transformers(folder) -> None:
    import transformers

    prompt = _prompts(1, seed=14, low=20, high=20)[0]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=7)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert len(entry) in (2, 3)


def test_bad_requests_raise_clear_errors(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    with pytest.raises(ContextLengthError, match="maximum context length is 64"):
        llm.generate([[5] * 64], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, -1]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="logprobs must be at most 20"):
        llm.generate(["hi"], SamplingParams(logprobs=21))
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_is_clamped_to_the_context(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=32)
    out = llm.generate(
        [[5] * 28], SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_chat_uses_the_template(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    out = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3), use_tqdm=False
    )[0]
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_request_metrics_are_ordered(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    m = llm.generate(["hello there"], GREEDY, use_tqdm=False)[0].metrics
    assert (
        m.arrival_time
        <= m.first_scheduled_time
        <= m.first_token_time
        <= m.last_token_time
        <= m.finished_time
    )


def test_static_slots_queue_abort_and_reuse_prefixes(folder) -> None:
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        kv_cache="static",
        enforce_eager=True,
    )
    engine = llm.engine
    shared = list(range(20, 60))
    for i in range(5):  # more requests than slots
        engine.add_request(
            f"r{i}", shared + [100 + i], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    engine.abort_request("r0")  # its slot goes to the next request
    done = {out.request_id: out for out in engine.step() if out.finished}
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["r0", "r1", "r2", "r3", "r4"]
    assert done["r0"].outputs[0].finish_reason == "abort"
    assert all(len(done[f"r{i}"].outputs[0].token_ids) == 4 for i in range(1, 5))
    # later requests found the shared 40-token prefix in a freed slot
    assert engine.kv_manager.stats.num_hit_tokens >= 40 * 2
    assert max(done[f"r{i}"].num_cached_tokens for i in range(2, 5)) >= 40
    assert engine.kv_manager.usage == 0.0


def test_out_of_vocab_stop_token_ids_are_rejected(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="stop_token_ids") as info:
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10**6], min_tokens=2))
    assert info.value.param == "stop_token_ids"
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_leaves_no_orphans(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], [5, -3]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.usage == 0.0


def test_requests_end_at_kv_capacity_instead_of_hanging(folder) -> None:
    # 4 blocks of 16 tokens, but a context of 256: a request must stop at 64 tokens
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=4 * 16 * 512)
    out = llm.generate(
        [[5] * 30], SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 30


def test_static_kv_over_budget_is_a_clear_config_error(folder) -> None:
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match="lower --max-num-seqs or --max-model-len"):
        LLM(
            str(folder),
            dtype="float32",
            max_model_len=256,
            max_num_seqs=64,
            kv_cache="static",
            kv_cache_memory=1024 * 1024,
            enforce_eager=True,
        )


def test_prompt_logprobs_survive_preemption(folder) -> None:
    prompts = _prompts(6, seed=15, low=40, high=60)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(str(folder), dtype="float32", max_model_len=128).generate(
        prompts, params, use_tqdm=False
    )
    tight_llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=10 * 16 * 512,
        max_num_batched_tokens=32,
    )
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.engine.stats.num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for pos in range(1, len(a.prompt_logprobs)):
            token = a.prompt_token_ids[pos]
            assert (
                abs(a.prompt_logprobs[pos][token].logprob - b.prompt_logprobs[pos][token].logprob)
                < 1e-4
            )


def test_min_tokens_defers_stop_strings(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    prompt = _prompts(1, seed=16)[0]
    full = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    first_token_text = llm.tokenizer.decode(full[0].outputs[0].token_ids[:1])
    assert first_token_text.strip()
    stop = first_token_text.strip()[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=16
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16  # the stop string in the first token did not end it early


def _outputs_by_kind(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, kind
) -> dict[str, list]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{kind.name}-{i}", prompt, params.clone(output_kind=kind))
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id.split("-")[1], []).append(out)
    return outputs


def test_delta_and_final_only_outputs_add_up_to_the_cumulative_ones(folder) -> None:
    from tokenmill.core.sampling_params import RequestOutputKind

    prompts = _prompts(4, seed=8)
    # Sampled n=2 with logprobs, prompt logprobs and a stop string that holds text back.
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=10,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
        stop=["never-seen-stop"],
    )
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    cumulative = _outputs_by_kind(llm, prompts, params, RequestOutputKind.CUMULATIVE)
    delta = _outputs_by_kind(llm, prompts, params, RequestOutputKind.DELTA)
    final = _outputs_by_kind(llm, prompts, params, RequestOutputKind.FINAL_ONLY)

    def fields(out) -> list[tuple]:
        return [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]

    for key, steps in cumulative.items():
        last = steps[-1]
        assert last.finished and len(last.outputs[0].token_ids) == 10
        (only,) = final[key]
        assert (
            only.finished
            and fields(only) == fields(last)
            and only.prompt_logprobs == last.prompt_logprobs
        )
        deltas = delta[key]
        assert len(deltas) == len(steps)
        assert all(
            len(c.token_ids) <= 2 for d in deltas for c in d.outputs
        )  # never the whole history
        assert deltas[0].prompt_logprobs == last.prompt_logprobs
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        folded = deltas[0].copy()
        for d in deltas[1:]:
            folded.add(d)
        assert folded.finished and fields(folded) == fields(last)


def test_priority_is_refused_under_fcfs_not_ignored(folder) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    with pytest.raises(InvalidRequestError, match="scheduling-policy priority") as info:
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False, priority=[0, 1])
    assert info.value.param == "priority"
    assert not llm.engine.has_unfinished_requests()  # nothing half-submitted keeps running
    ranked = LLM(str(folder), dtype="float32", max_model_len=128, scheduling_policy="priority")
    assert len(ranked.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False, priority=[0, 1])) == 2


def test_tokenizer_option_reads_another_folder(make_model, tmp_path) -> None:
    """--tokenizer: the tokenizer (and its chat template) come from that folder, not the model's."""
    import shutil

    folder = make_model("llama")
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, other / name)
    (other / "chat_template.jinja").write_text("OTHER {{ messages[0]['content'] }}")
    llm = LLM(str(folder), dtype="float32", max_model_len=64, tokenizer=str(other))
    assert llm.tokenizer.chat_template == "OTHER {{ messages[0]['content'] }}"
    assert LLM(str(folder), dtype="float32", max_model_len=64).tokenizer.chat_template != (
        "OTHER {{ messages[0]['content'] }}"
    )


def test_the_step_budget_defaults_per_device_and_a_given_one_wins(folder) -> None:
    """Without --max-num-batched-tokens a CPU engine steps 1024 tokens (a GPU 2048, vLLM's);
    the resolved config says which, and a given budget is used as it is."""
    from tokenmill.config import EngineConfig, default_step_tokens

    assert (default_step_tokens("cpu"), default_step_tokens("cuda")) == (1024, 2048)
    assert EngineConfig(model="m").step_token_budget("cuda") == 2048
    assert EngineConfig(model="m", max_num_batched_tokens=300).step_token_budget("cpu") == 300
    llm = LLM(str(folder), dtype="float32", max_model_len=2048, device="cpu")
    assert llm.engine.config.max_num_batched_tokens == 1024
    assert llm.engine.scheduler.max_num_batched_tokens == 1024
    assert llm.engine.stats.precision["max_num_batched_tokens"] == "1024"  # /metrics' label
    given = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=96)
    assert given.engine.scheduler.max_num_batched_tokens == 96
    # A 1500-token prompt is prefilled in two steps of the default budget (one of a budget
    # that holds it whole), with the same tokens.
    prompt = [10 + i % 200 for i in range(1500)]
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    whole = LLM(str(folder), dtype="float32", max_model_len=2048, max_num_batched_tokens=2048)
    outs = []
    for engine in (llm, whole):
        before = engine.engine.stats.num_steps
        outs.append(_tokens(engine.generate([prompt], one_token, use_tqdm=False)))
        outs.append(engine.engine.stats.num_steps - before)
    assert outs[0] == outs[2] and (outs[1], outs[3]) == (2, 1)
