"""Request limits over HTTP: the engine computes them (engine/request_limits.py), each API
answers a violation in its own error shape.

As vLLM's API servers: a prompt plus ``max_tokens`` over the context is a 400
``context_length_exceeded`` naming the field sent; without ``max_tokens`` a request may use
what the prompt leaves; the generation config's ``max_new_tokens`` caps without refusing. A
route's context, prompt and ``max_tokens`` caps work the same way within the route.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import InProcessServer, serve_in_process, wait_healthy
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.entrypoints.openai.state import ServerConfig

CONTEXT = 64
GENERATION_CAP = 20
"""The generation config's ``max_new_tokens`` (--override-generation-config)."""
ENGINE_CONFIG = EngineConfig(
    model="demo",
    max_model_len=CONTEXT,
    max_num_seqs=4,
    num_threads=1,
    override_generation_config={"max_new_tokens": GENERATION_CAP},
)
ROUTES_YAML = """\
routes:
  - name: tight
    match: {headers: [tight]}
    max_model_len: 48
    max_input_tokens: 40
    max_tokens: 10
    features: {logprobs: false, max_n: 1}
"""
TIGHT = {"X-Tokenmill-Route": "tight"}
EOS_OFF = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served(demo_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    path = tmp_path_factory.mktemp("limits") / "routes.yaml"
    path.write_text(ROUTES_YAML)
    engine = AsyncLLMEngine(ENGINE_CONFIG)
    server = serve_in_process(engine, ServerConfig(routes_config=str(path)), ENGINE_CONFIG)
    wait_healthy(server.base_url)
    yield server
    server.stop()


@pytest.fixture
def client(served: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)


def _post(served: InProcessServer, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{served.base_url}/v1/completions",
        json={"model": "demo", **EOS_OFF, **body},
        headers=headers or {},
        timeout=60,
    )


def test_completions_max_tokens_over_the_context_is_400(client: openai.OpenAI) -> None:
    prompt = [5] * 60
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=prompt, max_tokens=5)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "is too large: 5" in error["message"] and "(5 > 64 - 60)" in error["message"]
    fits = client.completions.create(model="demo", prompt=prompt, max_tokens=4, extra_body=EOS_OFF)
    assert fits.usage is not None and fits.usage.completion_tokens == 4
    left = client.completions.create(
        model="demo", prompt=prompt, max_tokens=None, extra_body=EOS_OFF
    )
    assert left.usage is not None and left.usage.completion_tokens == 4
    assert left.choices[0].finish_reason == "length"


def test_chat_names_the_field_it_was_sent_as(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello"}]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=messages, **{field: CONTEXT})  # type: ignore[call-overload]
        error = info.value.body
        assert isinstance(error, dict)
        assert error["param"] == field and error["code"] == "context_length_exceeded"


def test_the_generation_config_caps_without_refusing(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello"}]
    for max_tokens in (None, GENERATION_CAP + 10):
        chat = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=max_tokens, extra_body=EOS_OFF
        )
        assert chat.usage is not None and chat.usage.completion_tokens == GENERATION_CAP
    few = client.completions.create(model="demo", prompt="hi", max_tokens=3, extra_body=EOS_OFF)
    assert few.usage is not None and few.usage.completion_tokens == 3


def test_anthropic_messages_get_anthropics_error_shape(served: InProcessServer) -> None:
    claude = anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model="demo", max_tokens=CONTEXT, messages=[{"role": "user", "content": "hello"}]
        )
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "'max_tokens' or 'max_completion_tokens' is too large" in body["error"]["message"]


def test_logprobs_and_beam_width_bounds(served: InProcessServer) -> None:
    error = assert_error(_post(served, {"prompt": "hi", "max_tokens": 1, "logprobs": 21}), 400)
    assert error["param"] == "logprobs" and "at most 20" in error["message"]
    beam = {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 5, "temperature": 0}
    error = assert_error(_post(served, beam), 400, param="n")
    assert "--max-num-seqs (4)" in error["message"]


def test_a_routes_context_is_refused_past_and_caps_the_default(served: InProcessServer) -> None:
    prompt = list(range(100, 140))  # 40 tokens: the route's context (48) leaves 8
    over = _post(served, {"prompt": prompt, "max_tokens": 9}, TIGHT)
    error = assert_error(over, 400, param="max_tokens", code="context_length_exceeded")
    assert "route 'tight' has a context of 48 tokens" in error["message"]
    left = _post(served, {"prompt": prompt, "max_tokens": None}, TIGHT)
    assert left.status_code == 200 and left.json()["usage"]["completion_tokens"] == 8
    short = _post(served, {"prompt": "hi", "max_tokens": None}, TIGHT)  # the route's cap, 10
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 10
    assert _post(served, {"prompt": prompt, "max_tokens": 9}).status_code == 200  # off the route


def test_a_routes_prompt_max_tokens_and_feature_caps(served: InProcessServer) -> None:
    long = _post(served, {"prompt": list(range(100, 141)), "max_tokens": 1}, TIGHT)
    error = assert_error(long, 400, param="prompt", code="context_length_exceeded")
    assert "at most 40 tokens; this one has 41" in error["message"]
    over_cap = assert_error(_post(served, {"prompt": "hi", "max_tokens": 11}, TIGHT), 400)
    assert over_cap["param"] == "max_tokens" and "at most 10 output tokens" in over_cap["message"]
    for extra, param in (({"n": 2}, "n"), ({"logprobs": 1}, "logprobs")):
        refused = _post(served, {"prompt": "hi", "max_tokens": 1, **extra}, TIGHT)
        assert_error(refused, 403, param=param, code="feature_not_allowed")
