"""``POST /v1/completions`` through the official client and raw HTTP."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.entrypoints.conftest import MAIN_MAX_MODEL_LEN, ServerHandle, assert_error, sse_events

EOS_OFF = {"ignore_eos": True}


def test_completion_basic_shape_and_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.completions.create(
        model="demo", prompt="The quick brown fox", max_tokens=5, temperature=0, extra_body=EOS_OFF
    )
    assert result.id.startswith("cmpl-")
    assert result.object == "text_completion" and result.model == "demo"
    assert len(result.choices) == 1
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    assert result.usage.prompt_tokens == len(ids)
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == len(ids) + 5
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "quick brown fox" in text


def test_streamed_text_equals_non_streamed_for_same_seed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        extra_body=EOS_OFF,
    )
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == 12 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_raw_sse_ends_with_done(server: ServerHandle) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers()
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_prompt_forms_n_and_choice_indexes(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    for prompt, num_prompts in (
        ("hello world", 1),
        (["hello", "world"], 2),
        (ids, 1),
        ([ids, ids[:2]], 2),
    ):
        result = client.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=3,
            n=2,
            temperature=0.8,
            seed=7,
            extra_body=EOS_OFF,
        )
        assert sorted(c.index for c in result.choices) == list(range(2 * num_prompts))
        assert result.usage.completion_tokens == 3 * 2 * num_prompts
    # token ids and the text they encode give the same greedy completion
    by_ids = client.completions.create(
        model="demo", prompt=ids, max_tokens=4, temperature=0, extra_body=EOS_OFF
    )
    by_text = client.completions.create(
        model="demo", prompt="hello world", max_tokens=4, temperature=0, extra_body=EOS_OFF
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_seeded_n_streams_match_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo",
        prompt=["a", "b"],
        max_tokens=6,
        n=2,
        seed=99,
        temperature=1.0,
        extra_body=EOS_OFF,
    )
    full = client.completions.create(**kwargs)
    texts = {c.index: c.text for c in full.choices}
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts


def test_echo_and_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="demo",
        prompt="hello there",
        max_tokens=3,
        echo=True,
        logprobs=2,
        temperature=0,
        extra_body=EOS_OFF,
    )
    choice = result.choices[0]
    assert choice.text.startswith("hello there")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == result.usage.prompt_tokens + 3
    plain = client.completions.create(
        model="demo",
        prompt="hello there",
        max_tokens=3,
        logprobs=2,
        temperature=0,
        extra_body=EOS_OFF,
    )
    assert len(plain.choices[0].logprobs.tokens) == 3
    assert all(1 <= len(top) <= 3 for top in plain.choices[0].logprobs.top_logprobs)


def test_return_tokens_as_token_ids_names_exact_ids(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    kwargs = dict(
        model="demo", prompt="hello there", max_tokens=4, echo=True, logprobs=2, temperature=0
    )
    plain = client.completions.create(**kwargs, extra_body=EOS_OFF).choices[0]
    as_ids = client.completions.create(
        **kwargs, extra_body={**EOS_OFF, "return_tokens_as_token_ids": True}
    ).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in as_ids.logprobs.tokens)
    prompt_ids = http.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    assert ids[: len(prompt_ids)] == prompt_ids
    detokenized = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detokenized.startswith("<s>")  # /detokenize keeps special tokens, as vLLM's does
    assert detokenized.removeprefix("<s>") == as_ids.text == plain.text
    # Same numbers and offsets into the text; only the token names change.
    assert as_ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert as_ids.logprobs.text_offset == plain.logprobs.text_offset
    for top in as_ids.logprobs.top_logprobs[1:]:
        assert top and all(k.startswith("token_id:") for k in top)
    streamed = client.completions.create(
        **kwargs, stream=True, extra_body={**EOS_OFF, "return_tokens_as_token_ids": True}
    )
    assert [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ] == (as_ids.logprobs.tokens)


def test_prompt_logprobs_are_returned(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="demo", prompt="hello there", max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    entries = result.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == result.usage.prompt_tokens
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])
    streamed = client.completions.create(
        model="demo",
        prompt="hello there",
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": 1},
    )
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed if c.choices]
    assert firsts[0] == entries and all(f is None for f in firsts[1:])


def test_stop_strings_and_stop_reason(client: openai.OpenAI) -> None:
    base = (
        client.completions.create(
            model="demo", prompt="The river", max_tokens=20, temperature=0, extra_body=EOS_OFF
        )
        .choices[0]
        .text
    )
    stop = base[5:8]
    assert stop.strip(), base
    result = client.completions.create(
        model="demo",
        prompt="The river",
        max_tokens=20,
        temperature=0,
        extra_body=EOS_OFF,
        stop=[stop],
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == base[: base.index(stop)]
    assert choice.model_extra.get("stop_reason") == stop


def test_max_tokens_beyond_context_is_400_and_none_takes_what_is_left(
    client: openai.OpenAI,
) -> None:
    """As vLLM: a prompt plus max_tokens over the context is refused; null uses what is left."""
    prompt = [5] * (MAIN_MAX_MODEL_LEN - 4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=prompt, max_tokens=10**6)
    error = info.value.body
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"(1000000 > {MAIN_MAX_MODEL_LEN} - {MAIN_MAX_MODEL_LEN - 4})" in error["message"]
    result = client.completions.create(
        model="demo", prompt=prompt, max_tokens=None, extra_body=EOS_OFF
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 4


def test_over_context_prompt_is_400_context_length(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={"prompt": [5] * (MAIN_MAX_MODEL_LEN + 10), "max_tokens": 1}
    )
    error = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert "context length" in error["message"]


def test_extra_vllm_sampling_fields(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="demo",
        prompt="hello",
        max_tokens=5,
        user="someone",
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 5,
            "ignore_eos": False,
            "priority": 1,
        },
    )
    assert result.usage.completion_tokens == 5  # min_tokens holds EOS back


def test_suffix_is_rejected_clearly(http: httpx.Client) -> None:
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, param="suffix"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_client_errors_surface_as_openai_exceptions(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=-1, stream=stream)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1, stream=stream)


def test_access_log_line_has_id_tokens_and_ttft(server: ServerHandle, http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": "demo", "prompt": "log me", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200
    rid, usage = r.headers["x-request-id"], r.json()["usage"]
    line = re.compile(
        rf'"POST /v1/completions" 200 [\d.]+ms id={re.escape(rid)} '
        rf"prompt_tokens={usage['prompt_tokens']} completion_tokens=3 ttft_ms=[\d.]+$"
    )
    deadline = time.monotonic() + 10
    while not any(line.search(text) for text in server.log().splitlines()):
        assert time.monotonic() < deadline, f"no access-log line for {rid}"
        time.sleep(0.05)


def test_streamed_echo_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="demo",
        prompt="hello there",
        max_tokens=4,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body=EOS_OFF,
    )
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text.startswith("hello there")  # the prompt comes first, once
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == full.logprobs.tokens
