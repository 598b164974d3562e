"""Beam search over HTTP: vLLM's request fields on completions and chat."""

from __future__ import annotations

import httpx
import openai

from tests.entrypoints.conftest import ServerHandle, assert_error, sse_events

BEAM = {"use_beam_search": True, "ignore_eos": True}


def test_completion_beam_search_returns_the_n_best_beams(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="demo",
        prompt="The license",
        max_tokens=6,
        n=2,
        best_of=3,
        extra_body={**BEAM, "length_penalty": 0.5, "early_stopping": "never"},
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.choices[0].text != result.choices[1].text  # distinct beams
    assert result.usage.completion_tokens == 12


def test_width_one_beam_search_is_greedy(client: openai.OpenAI) -> None:
    kwargs = dict(model="demo", prompt="def parse(", max_tokens=8)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kwargs)
    beam = client.completions.create(extra_body=BEAM, **kwargs)
    assert beam.choices[0].text == greedy.choices[0].text


def test_streamed_beam_search_equals_non_streamed(server: ServerHandle) -> None:
    body = {"prompt": "Returns the", "max_tokens": 5, "n": 2, **BEAM}
    with server.http() as http:
        full = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        assert isinstance(event, dict)
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}


def test_chat_beam_search(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=5,
        n=2,
        extra_body=BEAM,
    )
    assert len(result.choices) == 2
    assert all(c.message.content is not None for c in result.choices)


def test_beam_search_refusals_are_400(http: httpx.Client) -> None:
    base = {"prompt": "x", "max_tokens": 4, "use_beam_search": True}
    assert_error(http.post("/v1/completions", json={**base, "stop": ["y"]}), 400, param="stop")
    assert_error(http.post("/v1/completions", json={**base, "best_of": 64}), 400, param="best_of")
    assert_error(
        http.post("/v1/completions", json={**base, "early_stopping": "soon"}),
        400,
        param="early_stopping",
    )
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "n": 1, "best_of": 2}), 400, "best_of"
    )


def test_extreme_finite_length_penalties_neither_kill_the_engine_nor_fail(
    server: ServerHandle,
) -> None:
    """``length_penalty`` 1000 raised OverflowError in the step; /health went 503."""
    with server.http() as http:
        for penalty in (1000, -1000, 1e308):
            body = {"prompt": "The", "max_tokens": 20, "n": 2, "length_penalty": penalty, **BEAM}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"]) == 2
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
