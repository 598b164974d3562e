"""The bad-input table: each answered with the right status and OpenAI's error shape.

After the table the server must still be healthy, with nothing running or waiting and no
KV block in use.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import MAIN_MAX_MODEL_LEN, ServerHandle, assert_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
MISSING = object()


def _completion(**fields: Any) -> dict[str, Any]:
    body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not MISSING}


def _chat(**fields: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": USER, "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not MISSING}


# (path, body, expected status, expected param or "any")
JSON_CASES: list[tuple[str, Any, int, str | None]] = [
    (COMPLETIONS, _completion(prompt=MISSING), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[[]]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[""]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=None), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[1, 2, 10**7]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[1, -2, 3]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[[1, 2], [3, 10**7]]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[5] * (MAIN_MAX_MODEL_LEN + 1)), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[1.5, 2]), 400, "prompt"),
    (CHAT, _chat(messages=MISSING), 400, "messages"),
    (CHAT, _chat(messages=[]), 400, "messages"),
    (CHAT, _chat(messages=[[]]), 400, "messages.0"),
    (CHAT, _chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    (CHAT, _chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    (CHAT, _chat(messages="hi"), 400, "messages"),
]
for value in (0, -1, 10**9, "5", 1.5, None, True):
    JSON_CASES.append((COMPLETIONS, _completion(n=value), 400, "n"))
    JSON_CASES.append((CHAT, _chat(n=value), 400, "n"))
for value in (0, -1, 2**63, "16", 2.5):
    JSON_CASES.append((COMPLETIONS, _completion(max_tokens=value), 400, "max_tokens"))
    JSON_CASES.append((CHAT, _chat(max_completion_tokens=value), 400, "max_completion_tokens"))
for name, values in {
    "temperature": [-0.5, 1e9, "hot"],
    "top_p": [0, -0.1, 1.5],
    "top_k": [-5, 1.5, 2**40],
    "min_p": [-1, 2],
    "presence_penalty": [5, -5],
    "frequency_penalty": [3],
    "repetition_penalty": [0, -1, 1e6],
    "seed": [2**63, -(2**63) - 1, "1", 1.5],
    "logprobs": [21, -1],
    "min_tokens": [-1],
    "priority": [2**40, "high"],
}.items():
    for value in values:
        JSON_CASES.append((COMPLETIONS, _completion(**{name: value}), 400, name))
JSON_CASES += [
    (CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (COMPLETIONS, _completion(stop=["x"] * 10**5), 400, "stop"),
    (COMPLETIONS, _completion(stop=""), 400, "stop"),
    (COMPLETIONS, _completion(stop=["ok", ""]), 400, "stop"),
    (CHAT, _chat(stop=[""]), 400, "stop"),
    (COMPLETIONS, _completion(stream_options={"include_usage": True}), 400, "stream_options"),
    (COMPLETIONS, _completion(no_such_field=1), 400, "no_such_field"),
    (
        COMPLETIONS,
        _completion(spaces_between_special_tokens=False),
        400,
        "spaces_between_special_tokens",
    ),
    (CHAT, _chat(spaces_between_special_tokens=False), 400, "spaces_between_special_tokens"),
    (COMPLETIONS, _completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    (COMPLETIONS, _completion(stop_token_ids=[10**6], stream=True), 400, "stop_token_ids"),
    (CHAT, _chat(stop_token_ids=[2, 10**6]), 400, "stop_token_ids"),
    (CHAT, _chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (COMPLETIONS, _completion(model="gpt-4"), 404, "model"),
    (CHAT, _chat(model="gpt-4"), 404, "model"),
]
TRAVERSAL = [
    "../../etc/passwd",
    "/etc/passwd",
    "demo/../../etc/passwd",
    "..\\..\\windows",
    "%2e%2e%2fetc",
    "",
]
JSON_CASES += [(COMPLETIONS, _completion(model=m), 404, "model") for m in TRAVERSAL]


def _case_id(case: tuple[str, Any, int, str | None]) -> str:
    path, body, status, param = case
    shown = json.dumps({k: v for k, v in body.items() if k not in ("model", "max_tokens")})
    return f"{path.rsplit('/', 1)[-1]}-{status}-{param}-{shown[:40]}"


@pytest.mark.parametrize("case", JSON_CASES, ids=[_case_id(c) for c in JSON_CASES])
def test_json_bad_input(http: httpx.Client, case: tuple[str, Any, int, str | None]) -> None:
    path, body, status, param = case
    error = assert_error(http.post(path, json=body), status)
    assert error["param"] is not None and error["param"].startswith(param), error
    if status == 404:
        assert error["code"] == "model_not_found"
        assert "passwd" not in error["message"] and "windows" not in error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"not json", "application/json", 400),
        (b'{"prompt": "x",', "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'"a string"', "application/json", 400),
        (b"null", "application/json", 400),
        (b"", "application/json", 400),
        (b'{"prompt": "caf\xc3\x28"}', "application/json", 400),
        (b'{"prompt": "\xff\xfe"}', "application/json", 400),
        (
            b'{"prompt": "x\\ud800y", "messages": [{"role": "user", "content": "\\udfff"}]}',
            "application/json",
            400,
        ),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
        (b'{"prompt": "x", "top_p": Infinity}', "application/json", 400),
        (b'{"prompt": "x", "presence_penalty": -Infinity}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        (b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", "application/json", 400),
        (b'{"prompt": "x"}', "text/plain", 415),
        (b'{"prompt": "x"}', "application/x-www-form-urlencoded", 415),
        (b'{"prompt": "x"}', None, 415),
    ],
)
def test_raw_bad_bodies(
    server: ServerHandle, path: str, content: bytes, content_type: str | None, status: int
) -> None:
    headers = server.headers()
    if content_type:
        headers["Content-Type"] = content_type
    assert_error(
        httpx.post(server.base_url + path, content=content, headers=headers, timeout=30), status
    )


def test_oversized_body_is_413(server: ServerHandle) -> None:
    big = json.dumps({"prompt": "x" * (2 * 2**20)}).encode()
    headers = {**server.headers(), "Content-Type": "application/json"}
    assert_error(
        httpx.post(server.base_url + COMPLETIONS, content=big, headers=headers, timeout=30), 413
    )

    def chunks():  # no Content-Length: the limit applies to the bytes received
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(server.base_url + COMPLETIONS, content=chunks(), headers=headers, timeout=30)
    assert_error(r, 413)


def test_oversized_headers_are_refused(server: ServerHandle) -> None:
    headers = {**server.headers(), "X-Big": "y" * (64 * 1024)}
    r = httpx.get(server.base_url + "/v1/models", headers=headers, timeout=30)
    assert_error(r, r.status_code)  # OpenAI's shape whichever layer refused it
    assert r.status_code in (400, 431)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a " * 400_000, "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["short", "a " * 400_000], "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a " * 400_000}], "max_tokens": 2},
        ),
        ("/tokenize", {"prompt": "a " * 400_000}),
    ],
)
def test_prompts_that_cannot_fit_are_refused_before_tokenizing(
    http: httpx.Client, path: str, body: dict
) -> None:
    # 800 KB of text can never fit 256 tokens: the refusal names characters, not tokens,
    # because the prompt was measured against the bound, never tokenized.
    error = assert_error(http.post(path, json=body), 400, code="context_length_exceeded")
    assert "characters" in error["message"]


def test_too_many_headers_are_431(server: ServerHandle) -> None:
    """The default --max-header-count is 100, however small the headers."""

    def get(num_extra: int) -> httpx.Response:
        # httpx adds Host, Accept, Accept-Encoding, Connection and User-Agent; plus Authorization.
        headers = [*server.headers().items(), *((f"X-H{i}", "1") for i in range(num_extra))]
        return httpx.get(server.base_url + "/v1/models", headers=headers, timeout=30)

    assert get(100 - 6).status_code == 200
    error = assert_error(get(100 - 5), 431, code="headers_too_large")
    assert "101 headers" in error["message"] and "100" in error["message"]
    assert_error(get(1000), 431, code="headers_too_large")


def test_server_healthy_and_nothing_leaked_after_the_table(
    server: ServerHandle, http: httpx.Client
) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post(COMPLETIONS, json=_completion(max_tokens=3))
    assert ok.status_code == 200, ok.text
    m = server.wait_idle()
    assert m["tokenmill:num_requests_running"] == 0
    assert m["tokenmill:num_requests_waiting"] == 0
    assert m["tokenmill:kv_cache_usage_perc"] == 0
