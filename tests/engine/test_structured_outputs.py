"""Constrained decoding through the whole engine on the demo model: mixed batches,
preemption, both KV strategies, n > 1, stop strings, min_tokens and max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["Return a record:", "The licence says", "def parse(text):", "Hello there"]


def _json(max_tokens: int = 80, **kwargs) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo", dtype="float32", max_model_len=512)


def test_unconstrained_rows_get_their_own_greedy_tokens_in_a_mixed_batch(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    constrained = [
        _json(temperature=0.0),
        SamplingParams(
            max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
        ),
        SamplingParams(
            max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
        ),
    ]
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[2]],
        [plain, constrained[0], plain, constrained[1], constrained[2]],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in alone
    ]
    record = mixed[1].outputs[0]
    assert record.finish_reason == "stop"
    jsonschema.validate(json.loads(record.text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", mixed[3].outputs[0].text)
    assert mixed[4].outputs[0].text in ("yes", "no")


def test_preemption_and_chunked_prefill_keep_grammar_state(llm: LLM) -> None:
    params = _json(max_tokens=40, temperature=0.0)
    prompts = [p + " " + str(i) * 12 for i, p in enumerate(PROMPTS)]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    # Little KV (preemption) and an 8-token step budget (prompts prefill in chunks).
    tight = LLM(
        "demo",
        dtype="float32",
        max_model_len=96,
        kv_cache_memory=6 * 16 * 2048,
        max_num_batched_tokens=8,
    )
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats.num_preemptions > 0
    assert all(len(o.prompt_token_ids) > 8 for o in got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    tight.engine.step()  # the runner drops finished sequences at the next step
    assert tight.engine.runner.grammar_masks.num_sequences == 0


def test_static_kv_sampled_n2_samples_each_follow_the_grammar() -> None:
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        kv_cache="static",
        max_num_seqs=4,
        enforce_eager=True,
    )
    outs = llm.generate(PROMPTS[:2], _json(n=2, temperature=1.0, seed=7), use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_max_tokens_mid_structure_is_length_and_stop_strings_still_apply(llm: LLM) -> None:
    short = llm.generate(PROMPTS[0], _json(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "length"
    assert short.outputs[0].text.startswith('{"')
    stopped = llm.generate(PROMPTS[0], _json(temperature=0.0, stop=['"age"']), use_tqdm=False)[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"'
    assert stopped.text.startswith('{"name":')


def test_a_complete_grammar_ends_the_request_even_under_min_tokens(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=20,
        min_tokens=10,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # A regex that may go on: EOS is masked until min_tokens, then allowed where it can end.
    digits = SamplingParams(
        max_tokens=12,
        min_tokens=4,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]+"),
    )
    out = llm.generate(PROMPTS[2], digits, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]+", out.text) and len(out.token_ids) >= 4


def test_bad_constraints_are_refused_offline_too(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="Unimplemented keys"):
        llm.generate("x", SamplingParams(structured_outputs={"json": {"not": {}}}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_structured_outputs_may_be_given_as_a_dict() -> None:
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"schema": {}})
