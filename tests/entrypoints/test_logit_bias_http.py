"""logit_bias over HTTP with the official openai client, completions and chat: +100 forces a
token, -100 bans one (greedy), and a bad bias is OpenAI's 400 naming ``logit_bias``."""

from __future__ import annotations

import openai
import pytest

from tokenmill.core.sampling_params import MAX_LOGIT_BIAS_TOKENS

EOS_OFF = {"ignore_eos": True, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


def _ids(choice) -> list[int]:
    return (choice.model_extra or {})["token_ids"]


def test_completions_bias_forces_and_bans_tokens(client: openai.OpenAI) -> None:
    def complete(**kwargs) -> list[int]:
        out = client.completions.create(
            model="demo",
            prompt="The river ran",
            max_tokens=6,
            temperature=0,
            extra_body=EOS_OFF,
            **kwargs,
        )
        return _ids(out.choices[0])

    base = complete()
    forced = next(t for t in range(40, 200) if t not in base)
    assert complete(logit_bias={str(forced): 100}) == [forced] * 6
    banned = complete(logit_bias={str(base[0]): -100})
    assert base[0] not in banned and banned[0] != base[0]
    streamed = client.completions.create(
        model="demo",
        prompt="The river ran",
        max_tokens=6,
        temperature=0,
        stream=True,
        logit_bias={str(forced): 100},
        extra_body=EOS_OFF,
    )
    assert [t for c in streamed if c.choices for t in _ids(c.choices[0])] == [forced] * 6


def test_chat_bias_forces_a_token(client: openai.OpenAI) -> None:
    def chat(**kwargs) -> list[int]:
        out = client.chat.completions.create(
            model="demo",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0,
            extra_body=EOS_OFF,
            **kwargs,
        )
        return _ids(out.choices[0])

    base = chat()
    forced = next(t for t in range(40, 200) if t not in base)
    assert chat(logit_bias={str(forced): 100}) == [forced] * 5


@pytest.mark.parametrize(
    "bias",
    [
        {"7": 100.5},
        {"7": -101},
        {"seven": 1},
        {"-3": 1},
        {"100000000": 1},  # outside the vocabulary
        {str(t): 1 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)},
    ],
)
def test_a_bad_bias_is_a_400_naming_logit_bias(client: openai.OpenAI, bias) -> None:
    for create in (
        lambda: client.completions.create(model="demo", prompt="x", max_tokens=2, logit_bias=bias),
        lambda: client.chat.completions.create(
            model="demo",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            logit_bias=bias,
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        body = info.value.body
        assert isinstance(body, dict), body
        assert body["type"] == "invalid_request_error" and body["param"] == "logit_bias", body
