"""Speculative decoding through the whole engine: greedy output is token-identical to
transformers (and to the engine without speculation) on every path, and drafts really
were accepted, so the identity is not vacuous."""

from __future__ import annotations

import random

import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest

MAX_NEW = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _copy_prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves: prompt lookup finds proposals there, and
    tiny random models fall into loops that it then predicts."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        text = [rng.randrange(4, vocab) for _ in range(rng.randint(6, 30))]
        start = rng.randrange(len(text) - 4)
        out.append(text + text[start : start + rng.randint(3, 8)])
    return out


def _greedy(max_tokens: int = MAX_NEW, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_speculated(llm: LLM) -> None:
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0, "nothing was proposed: the test proves nothing"
    assert stats.spec_num_accepted_tokens > 0, "nothing was accepted: the test proves nothing"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_greedy_matches_transformers(make_model, reference_greedy, family, kv_cache) -> None:
    folder = make_model(family)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        kv_cache=kv_cache,
        enforce_eager=True,
        speculative_config=NGRAM,
    )
    prompts = _copy_prompts(llm.tokenizer.vocab_size, 6, seed=1)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected
    _assert_speculated(llm)
    assert llm.engine.runner.num_compiled_verify_steps == 0  # enforce_eager: the eager path
    # without a compiled step, verification steps run as eager decode rows
    assert llm.engine.runner.num_row_verify_steps > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_static_compiled_verification_matches_transformers(
    make_model, reference_greedy, method
) -> None:
    """static, compiled: steps verifying k + 1 tokens per request run through the compiled
    graphs (a bucket added for their rows), and greedy output is still transformers'."""
    folder = make_model("llama")
    spec = NGRAM if method == "ngram" else {"model": str(folder), "num_speculative_tokens": 3}
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        kv_cache="static",
        speculative_config=spec,
    )
    step = llm.engine.runner.compiled_decode
    assert step is not None and step.buckets == [1, 2, 8]  # 2 requests x (1 + 3 drafts)
    prompts = _copy_prompts(llm.tokenizer.vocab_size, 4, seed=12)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected
    _assert_speculated(llm)
    assert llm.engine.runner.num_compiled_verify_steps > 0
    assert step.eager_buckets == []
    if method == "draft_model":  # static: the draft compiles too, and proposes through it
        rows = llm.engine.executor.driver_worker.proposer.rows
        assert rows.compiled is not None and rows.num_compiled > 0


def test_chunked_prefill_preemption_and_prefix_caching_stay_exact(make_model) -> None:
    folder = make_model("llama")
    plain = LLM(str(folder), dtype="float32", max_model_len=128, block_size=4)
    tight = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=7,  # chunked prefill, and drafts cut to the budget
        kv_cache_memory=40 * 4 * 2 * 2 * 2 * 16 * 4,  # 40 blocks of 4 tokens
        speculative_config={**NGRAM, "disable_by_batch_size": 16},
    )
    assert tight.engine.kv_manager.num_blocks == 40
    shared = _copy_prompts(plain.tokenizer.vocab_size, 1, seed=3)[0]
    prompts = [shared + p for p in _copy_prompts(plain.tokenizer.vocab_size, 8, seed=4)]
    params = _greedy(32)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == want
    assert tight.engine.stats.num_preemptions > 0
    assert tight.engine.stats.num_prefix_hit_tokens > 0
    _assert_speculated(tight)
    # again, now from the prefix cache that speculative steps filled
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == want
    pool = tight.engine.kv_manager.pool
    assert pool.num_free_blocks == 40 and all(b.ref_count == 0 for b in pool.blocks)


def test_stops_max_tokens_and_min_tokens_cut_the_accepted_run(make_model) -> None:
    folder = make_model("llama")
    plain = LLM(str(folder), dtype="float32", max_model_len=128)
    spec = LLM(str(folder), dtype="float32", max_model_len=128, speculative_config=NGRAM)
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 6, seed=5)
    full = _tokens(plain.generate(prompts, _greedy(), use_tqdm=False))
    cases = [_greedy(max_tokens=n) for n in (1, 2, 5, 9)]
    # a stop token and a stop string taken from the middle of each greedy output
    cases += [
        _greedy(stop_token_ids=[full[0][7]]),
        _greedy(stop_token_ids=[full[1][5]], min_tokens=9),
    ]
    text = plain.tokenizer.decode(full[2])
    cases.append(_greedy(stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got
        ] == [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want
        ], params
    _assert_speculated(spec)


def test_logprobs_are_the_targets(make_model) -> None:
    folder = make_model("llama")
    plain = LLM(str(folder), dtype="float32", max_model_len=128)
    spec = LLM(str(folder), dtype="float32", max_model_len=128, speculative_config=NGRAM)
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 3, seed=6)
    want = plain.generate(prompts, _greedy(logprobs=2), use_tqdm=False)
    got = spec.generate(prompts, _greedy(logprobs=2), use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for we, ge in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert we.keys() == ge.keys()
            for t in we:
                assert ge[t].logprob == pytest.approx(we[t].logprob, abs=1e-4)
                assert ge[t].rank == we[t].rank
    _assert_speculated(spec)


def test_n_samples_fp8_kv_and_seeded_sampling(make_model) -> None:
    folder = make_model("llama")
    options = {"dtype": "float32", "max_model_len": 128, "kv_cache_dtype": "fp8"}
    plain = LLM(str(folder), **options)
    spec = LLM(str(folder), **options, speculative_config=NGRAM)
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 3, seed=7)
    greedy_n = _greedy(n=2)
    assert _tokens(spec.generate(prompts, greedy_n, use_tqdm=False)) == _tokens(
        plain.generate(prompts, greedy_n, use_tqdm=False)
    )
    _assert_speculated(spec)
    # seeded sampling with speculation is reproducible, sample by sample
    seeded = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True
    )
    first = [
        [c.token_ids for c in o.outputs] for o in spec.generate(prompts, seeded, use_tqdm=False)
    ]
    again = [
        [c.token_ids for c in o.outputs] for o in spec.generate(prompts, seeded, use_tqdm=False)
    ]
    assert first == again


def test_lora_with_speculation_matches_without(make_model, make_adapter) -> None:
    folder = make_model("llama")
    lora = LoRARequest("a", 1, str(make_adapter(folder)))
    options = {"dtype": "float32", "max_model_len": 128, "enable_lora": True}
    plain = LLM(str(folder), **options)
    spec = LLM(str(folder), **options, speculative_config=NGRAM)
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 4, seed=8)
    want = _tokens(plain.generate(prompts, _greedy(), use_tqdm=False, lora_request=lora))
    assert want != _tokens(plain.generate(prompts, _greedy(), use_tqdm=False))
    assert _tokens(spec.generate(prompts, _greedy(), use_tqdm=False, lora_request=lora)) == want
    _assert_speculated(spec)


def test_beam_search_with_speculation_is_refused(make_model) -> None:
    spec = LLM(
        str(make_model("llama")), dtype="float32", max_model_len=64, speculative_config=NGRAM
    )
    with pytest.raises(InvalidRequestError, match="speculative decoding") as info:
        spec.engine.add_request(
            "b", [5, 6, 7], SamplingParams(use_beam_search=True, n=2, max_tokens=4)
        )
    assert info.value.param == "use_beam_search"


def test_policy_turns_speculation_off_for_a_full_batch(make_model) -> None:
    folder = make_model("llama")
    spec = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        speculative_config={**NGRAM, "disable_by_batch_size": 2},
    )
    prompts = _copy_prompts(spec.tokenizer.vocab_size, 6, seed=9)
    spec.generate(prompts, _greedy(8), use_tqdm=False)
    assert spec.engine.stats.spec_num_drafts == 0  # six running requests: above the limit
    spec.generate(prompts[:1], _greedy(), use_tqdm=False)
    assert spec.engine.stats.spec_num_draft_tokens > 0  # one alone: proposals again


def test_policy_grades_proposals_by_batch_size(make_model) -> None:
    """k = 4 up to half of disable_by_batch_size (4) running requests, fewer above, none past
    it: the steps the policy graded, and the drafts verified, follow the batch size."""
    from tokenmill.core.speculative import num_tokens_to_propose

    folder = make_model("llama")
    config = {**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 4}
    spec = LLM(str(folder), dtype="float32", max_model_len=128, speculative_config=config)
    assert [num_tokens_to_propose(spec.engine.speculative, n) for n in range(1, 7)] == [
        4,
        4,
        3,
        1,
        0,
        0,
    ]
    prompts = _copy_prompts(spec.tokenizer.vocab_size, 4, seed=14)
    for batch, k in ((4, 1), (3, 3), (1, 4)):
        before = spec.engine.stats
        spec.generate(prompts[:batch], _greedy(12), use_tqdm=False)
        after = spec.engine.stats
        steps = {
            n: after.spec_policy_steps.get(n, 0) - before.spec_policy_steps.get(n, 0)
            for n in after.spec_policy_steps
        }
        # all start together; a request whose drafts were accepted finishes first, and the
        # smaller batch then gets the policy's k for its size
        allowed = {num_tokens_to_propose(spec.engine.speculative, n) for n in range(1, batch + 1)}
        graded = {n for n, count in steps.items() if count}
        assert k in graded and graded <= allowed, (batch, steps)
        drafts = after.spec_num_drafts - before.spec_num_drafts
        draft_tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        assert drafts > 0 and draft_tokens <= max(graded) * drafts, batch


def test_structured_outputs_with_speculation_match_and_validate() -> None:
    """Drafts are checked against the grammar position by position (a banned draft is
    rejected, the matcher rolled back): greedy JSON is identical, sampled JSON validates."""
    import json

    import jsonschema

    from tokenmill.core.structured_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "items": {"type": "array", "items": {"enum": ["one", "two"]}, "maxItems": 6},
        },
        "required": ["name", "items"],
        "additionalProperties": False,
    }
    prompts = ["Return a record:", "The licence says", "def parse(text):"]
    plain = LLM("demo", max_model_len=256)
    spec = LLM("demo", max_model_len=256, speculative_config=NGRAM)

    def params(**options) -> SamplingParams:
        return SamplingParams(
            max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema), **options
        )

    want = plain.generate(prompts, params(temperature=0.0), use_tqdm=False)
    got = spec.generate(prompts, params(temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    _assert_speculated(spec)
    sampled = spec.generate(prompts, params(temperature=1.0, n=2, seed=5), use_tqdm=False)
    for out in sampled:
        for completion in out.outputs:
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_draft_model_greedy_matches_transformers(
    make_model, reference_greedy, tmp_path, kv_cache
) -> None:
    """method draft_model: the target itself as its draft (every draft accepted) and a
    one-layer truncation of it (most rejected); the output is the target's either way."""
    from tokenmill.model.demo import build_truncated_draft

    folder = make_model("llama")
    build_truncated_draft(folder, tmp_path / "draft", 1)
    from tokenmill.tokenizer import Tokenizer

    prompts = _copy_prompts(Tokenizer.from_pretrained(folder).vocab_size, 4, seed=10)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    for draft, min_rate in ((folder, 1.0), (tmp_path / "draft", 0.0)):
        llm = LLM(
            str(folder),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            kv_cache=kv_cache,
            enforce_eager=True,
            block_size=4,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
        )
        assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected
        stats = llm.engine.stats
        assert stats.spec_num_draft_tokens > 0
        assert stats.spec_num_accepted_tokens >= min_rate * stats.spec_num_draft_tokens


def test_draft_row_loop_proposes_what_the_runner_path_proposes(make_model, tmp_path) -> None:
    """The draft's tight decode-row loop and its general path through the draft's ModelRunner make the same proposals: the same
    drafted and accepted counts, the same output."""
    from tokenmill.model.demo import build_truncated_draft

    folder = make_model("llama")
    build_truncated_draft(folder, tmp_path / "draft", 1)
    runs = []
    for use_rows in (True, False):
        llm = LLM(
            str(folder),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            enforce_eager=True,
            block_size=4,
            speculative_config={"model": str(tmp_path / "draft"), "num_speculative_tokens": 3},
        )
        drafter = llm.engine.executor.driver_worker.proposer
        rows = drafter.rows
        assert rows is not None and rows.compiled is None  # enforce_eager: eager rows
        if not use_rows:
            drafter.rows = None
        prompts = _copy_prompts(llm.tokenizer.vocab_size, 4, seed=21)
        out = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
        stats = llm.engine.stats
        runs.append((out, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens))
        assert (rows.num_eager > 0) == use_rows
    assert runs[0] == runs[1]
    assert runs[0][1] > 0


def test_draft_catch_up_within_a_small_budget_stays_exact(make_model) -> None:
    """The draft's catch-up counts in max_num_batched_tokens: with 30-token prompts and a
    budget of 7, it reads them in chunks over several steps, then proposes; exact still."""
    folder = make_model("llama")
    plain = LLM(str(folder), dtype="float32", max_model_len=128)
    spec = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=7,
        speculative_config={"model": str(folder), "num_speculative_tokens": 2},
    )
    engine = spec.engine
    prompts = [p + p[:10] for p in _copy_prompts(plain.tokenizer.vocab_size, 2, seed=13)]
    prompts = [(p * 4)[:30] for p in prompts]
    params = _greedy(20)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    budgets = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        budgets.append((out.total_num_tokens, out.num_draft_model_tokens))
        return out

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == want
    assert all(target + draft <= 7 for target, draft in budgets)
    assert sum(1 for _, draft in budgets if draft >= 5) >= 4  # catch-up in chunks
    assert engine.stats.spec_num_accepted_tokens > 0


def test_draft_model_survives_preemption_and_refuses_another_vocabulary(
    make_model, tmp_path
) -> None:
    import json

    from tokenmill.errors import ConfigError
    from tokenmill.model.demo import build_truncated_draft

    folder = make_model("llama")
    plain = LLM(str(folder), dtype="float32", max_model_len=128, block_size=4)
    tight = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        kv_cache_memory=40 * 4 * 2 * 2 * 2 * 16 * 4,
        speculative_config={"model": str(folder), "num_speculative_tokens": 4},
    )
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 8, seed=11)
    params = _greedy(32)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == _tokens(
        plain.generate(prompts, params, use_tqdm=False)
    )
    assert tight.engine.stats.num_preemptions > 0
    assert tight.engine.stats.spec_num_accepted_tokens > 0
    build_truncated_draft(folder, tmp_path / "other", 1)
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    config["vocab_size"] += 1
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(
            str(folder),
            dtype="float32",
            max_model_len=64,
            speculative_config={"model": str(tmp_path / "other"), "num_speculative_tokens": 2},
        )


def test_demo_draft_is_the_shipped_trained_one_and_is_accepted() -> None:
    """demo-draft is the distilled one-layer draft in the package (a few MB), and on the
    demo its greedy guesses are mostly the demo's: acceptance well above the untrained
    truncation's (about 0.3), output identical."""
    import json

    from tokenmill.model.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, demo_draft_path

    assert demo_draft_path() == DEMO_DRAFT_DIR
    config = json.loads((DEMO_DRAFT_DIR / "config.json").read_text())
    demo = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == demo["vocab_size"]
    assert (DEMO_DRAFT_DIR / "tokenizer.json").read_bytes() == (
        DEMO_MODEL_DIR / "tokenizer.json"
    ).read_bytes()
    assert (DEMO_DRAFT_DIR / "model.safetensors").stat().st_size < 5 * 2**20
    prompts = ["The recipe requires flour, butter, sugar", "Return the list of"]
    params = _greedy(32)
    plain = LLM("demo", dtype="float32", max_model_len=256)
    spec = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        speculative_config={"model": "demo-draft", "num_speculative_tokens": 4},
    )
    want = [_tokens(plain.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert [_tokens(spec.generate([p], params, use_tqdm=False))[0] for p in prompts] == want
    stats = spec.engine.stats
    assert stats.spec_num_accepted_tokens >= 0.45 * stats.spec_num_draft_tokens > 0


def _staggered(llm: LLM, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list[int]]:
    """Request 0 alone until its prompt is prefilled, then the others (short answers) join;
    once they finish, request 0 runs alone again. Outputs by id, and per step the draft
    forwards run so far (the worker's own count)."""
    engine = llm.engine
    drafter = engine.executor.driver_worker.proposer
    engine.add_request("long", prompts[0], _greedy(28))
    outputs: dict[str, list[int]] = {}
    forwards: list[int] = []

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        forwards.append(drafter.num_forwards if drafter is not None else 0)

    step()  # prefill of the first request: it decodes from here on
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"short{i}", prompt, _greedy(6))
    while engine.has_unfinished_requests():
        step()
    return outputs, forwards


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_draft_model_costs_nothing_while_the_policy_keeps_it_off(make_model, kv_cache) -> None:
    """More requests than disable_by_batch_size: the draft runs no forward and reads no
    token, counting the requests that are about to join (the first one does not speculate,
    its draft reading the prompt, while the others wait to be admitted). When the batch
    shrinks, the draft reads its whole lag and speculation resumes, output unchanged."""
    folder = make_model("llama")
    kwargs = {
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_seqs": 8,
        "kv_cache": kv_cache,
        "enforce_eager": True,
    }
    plain = LLM(str(folder), **kwargs)
    spec = LLM(
        str(folder),
        **kwargs,
        speculative_config={
            "model": str(folder),  # the target as its own draft: every draft accepted
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 2,
        },
    )
    prompts = _copy_prompts(plain.tokenizer.vocab_size, 5, seed=21)
    want, _ = _staggered(plain, prompts)
    got, forwards = _staggered(spec, prompts)
    assert got == want
    stats = spec.engine.stats
    num_busy = 1 + 6  # steps until the short answers are done (request 0 ran alone in one)
    assert forwards[:num_busy] == [0] * num_busy, forwards
    assert stats.spec_policy_steps.get(0, 0) >= num_busy - 1
    # alone again: the draft read the prompt and the outputs so far, then drafted
    assert forwards[-1] > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_draft_model_steps > 0
    assert stats.spec_num_draft_model_tokens >= len(prompts[0]) + 6


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_draft_loop_proposes_what_per_forward_rows_propose(
    make_model, reference_greedy, tmp_path, kv_cache
) -> None:
    """A step's draft forwards run as one compiled call (after a one- and a two-token
    catch-up), proposing what one call per forward proposes: the same drafted and accepted
    counts, transformers' output."""
    from tokenmill.model.demo import build_truncated_draft

    folder = make_model("llama")
    from tokenmill.tokenizer import Tokenizer

    build_truncated_draft(folder, tmp_path / "draft", 1)
    prompts = _copy_prompts(Tokenizer.from_pretrained(folder).vocab_size, 4, seed=22)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    runs = []
    for use_loop in (True, False):
        llm = LLM(
            str(folder),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=2,
            kv_cache=kv_cache,
            speculative_config={"model": str(tmp_path / "draft"), "num_speculative_tokens": 3},
        )
        drafter = llm.engine.executor.driver_worker.proposer
        assert (drafter.rows.compiled is not None) == (kv_cache == "static")
        loops = drafter.loops
        assert sorted(loops) == [(1, 3), (2, 3)]
        assert all(loop.max_batch == 2 for loop in loops.values())
        if not use_loop:
            drafter.loops = {}
        assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected
        stats = llm.engine.stats
        runs.append((stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens))
        assert (loops[1, 3].num_calls > 0) == use_loop  # after a rejection: one call
    assert runs[0] == runs[1] and runs[0][0] > 0
