"""``/openapi.json`` describes the real bodies, and the live server keeps to it.

A server of its own (health and metrics left open, so the document's per-route security is
tested too) is fuzzed by schemathesis from its own document: generated requests, valid and
invalid, must never get a 5xx, and every response must match the documented status codes,
content types and schemas. Generation is capped at a few tokens so the run stays short.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.conftest import ServerHandle, assert_error, start_server

SERVER_FLAGS = ["--disable-auth-for-health-metrics", "--max-model-len", "64", "--max-num-seqs", "4"]
MAX_TOKENS = 4
VOCAB_SIZE = 2048  # the demo model's
EXAMPLES_PER_OPERATION = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "25"))
"""Bounded so the run takes about half a minute; raise it for a deeper search."""
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
    ignored_auth,
]
"""schemathesis' checks except positive_data_acceptance: a schema-valid body may still break a rule
the schema cannot say (a temperature in range, a prompt within the context), and get a 400."""


@pytest.fixture(scope="module")
def open_health_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(server_log_dir, *SERVER_FLAGS)
    yield handle
    handle.stop()
    assert handle.process.returncode == 0, handle.log()
    assert "Traceback" not in handle.log(), handle.log()


def test_openapi_needs_the_key_even_when_health_is_open(open_health_server: ServerHandle) -> None:
    url = f"{open_health_server.base_url}/openapi.json"
    assert_error(httpx.get(url), 401, code="invalid_api_key")
    for path in ("/health", "/metrics"):  # open by the flag, with HEAD as with GET
        assert httpx.get(f"{open_health_server.base_url}{path}").status_code == 200
        assert httpx.head(f"{open_health_server.base_url}{path}").status_code == 200
    assert httpx.get(url, headers=open_health_server.headers()).status_code == 200


def test_document_has_the_request_models_and_security(open_health_server: ServerHandle) -> None:
    doc = httpx.get(
        f"{open_health_server.base_url}/openapi.json", headers=open_health_server.headers()
    ).json()
    schemas = doc["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert schemas[model]["additionalProperties"] is False  # unknown fields are a 400
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert "max_completion_tokens" in schemas["ChatCompletionRequest"]["properties"]
    completion_ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completion_ok) == {"application/json", "text/event-stream"}
    assert doc["security"] == [{"bearer": []}]
    for path in ("/health", "/metrics"):
        assert (
            doc["paths"][path]["get"]["security"] == []
            and doc["paths"][path]["head"]["security"] == []
        )
    assert "security" not in doc["paths"]["/v1/models"]["get"]


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/version"),
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/metrics"),
    ("HEAD", "/metrics"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/embeddings"),
    ("POST", "/pooling"),
    ("POST", "/score"),
    ("POST", "/v1/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
    ("POST", "/v2/rerank"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("POST", "/invocations"),
    ("GET", "/load"),
]


@pytest.fixture(scope="module")
def api_schema(open_health_server: ServerHandle):
    return schemathesis.openapi.from_url(
        f"{open_health_server.base_url}/openapi.json",
        headers=open_health_server.headers(),
        timeout=30,
    )


def _steer(mode: GenerationMode):
    """Generation requests ask for a few tokens (the run tests the API, not the model's speed);
    schema-valid cases name the served model and in-vocabulary tokens, so more get past a 404 or
    400 to do real work. Negative cases keep what makes them invalid."""

    def steer(case):
        body, path = case.body, case.operation.path
        if not isinstance(body, dict):
            return case
        if path == "/v1/responses":
            value = body.get("max_output_tokens")
            if "max_output_tokens" not in body or (isinstance(value, int) and value > MAX_TOKENS):
                body["max_output_tokens"] = MAX_TOKENS
        elif path == "/v1/messages":  # max_tokens is required: a case without it stays so
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > MAX_TOKENS:
                body["max_tokens"] = MAX_TOKENS
        elif path in ("/v1/completions", "/v1/chat/completions"):
            for name in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(name), int) and body[name] > MAX_TOKENS:
                    body[name] = MAX_TOKENS
            if "max_tokens" not in body and "max_completion_tokens" not in body:
                body["max_tokens"] = MAX_TOKENS
        if mode is GenerationMode.POSITIVE:
            if isinstance(body.get("model"), str):
                body["model"] = "demo"
            if path == "/detokenize":
                body["tokens"] = [abs(t) % VOCAB_SIZE for t in body["tokens"]]
        return case

    return steer


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
FEATURES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "echo": True}),
    (
        "/v1/completions",
        {
            "prompt": ["a", "b"],
            "n": 2,
            "max_tokens": 2,
            "logprobs": 1,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "prompt_logprobs": 1,
            "stream": True,
            "echo": True,
            "logprobs": 1,
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": [[5, 6], [7]],
            "max_tokens": 3,
            "prompt_logprobs": 2,
            "stop": ["e", "a"],
            "return_tokens_as_token_ids": True,
            "logprobs": 1,
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_completion_tokens": 3,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 2,
        },
    ),
    ("/tokenize", {"messages": CHAT, "return_token_strs": True}),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
    ("/v1/responses", {"input": "hi", "instructions": "Be brief.", "max_output_tokens": 3}),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3, "stream": True},
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "system": "x"},
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    ),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("path", "body"), FEATURES, ids=[f"{p} {sorted(b)}" for p, b in FEATURES])
def test_feature_responses_match_the_document(
    api_schema, open_health_server: ServerHandle, path: str, body: dict
) -> None:
    """Responses random bodies rarely reach (logprobs, echo, streams with usage) match it too."""
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call_and_validate(
        headers=open_health_server.headers(), timeout=60, checks=CHECKS
    )
    assert response.status_code == 200, response.text


def test_every_operation_is_fuzzed(api_schema) -> None:
    documented = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


FUZZED = [
    (m, p, mode)
    for m, p in OPERATIONS
    for mode in GenerationMode
    if mode is GenerationMode.POSITIVE or m == "POST" or "{" in p
]
"""(method, path, mode): negative cases only where there is an input to break (a body or a path
parameter)."""


@pytest.mark.parametrize(
    ("method", "path", "mode"), FUZZED, ids=[f"{m} {p} {mode}" for m, p, mode in FUZZED]
)
def test_live_server_keeps_to_its_document(
    api_schema, open_health_server: ServerHandle, method: str, path: str, mode: GenerationMode
) -> None:
    """No 5xx, and every status, content type and body as documented (schemathesis' checks)."""
    strategy = api_schema[path][method].as_strategy(generation_mode=mode).map(_steer(mode))

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    def run(case) -> None:
        case.call_and_validate(headers=open_health_server.headers(), timeout=60, checks=CHECKS)

    run()
