"""The prefix cache over HTTP with two API keys: each key sees only its own cached blocks
(``usage.prompt_tokens_details.cached_tokens`` stays 0 for another key's prompt), the
``--share-prefix-cache-across-api-keys`` opt-out restores sharing, and vLLM's ``cache_salt``
field separates requests within one key. A bad ``cache_salt`` is a 400 in OpenAI's error
shape. Real servers on loopback, the official ``openai`` SDK and raw HTTP.

Each "miss" is asked while the blocks it must not see are cached (the servers keep cached
blocks until the pool's fresh ones are used), so a miss proves the namespace, not an eviction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import (
    MAIN_KEY,
    OTHER_KEY,
    ServerHandle,
    assert_error,
    start_server,
    wait_healthy,
)

VLLM_MESSAGE = "Parameter 'cache_salt' must be a non-empty string if provided."
# --prefix-cache-fills-pool: evict cached blocks only once the fresh ones are used (vLLM's
# order). By default a freed block is reused before a fresh one, so on a quiet server one
# request's allocation evicts the previous request's cached blocks, and whether a key's blocks
# are still cached would depend on what ran before.
FLAGS = (
    "--enable-prompt-tokens-details", "--max-model-len", "256", "--api-key", OTHER_KEY,
    "--prefix-cache-fills-pool",
)  # fmt: skip


@pytest.fixture(scope="module")
def servers(demo_cache: str, server_log_dir: Path) -> Iterator[dict[str, ServerHandle]]:
    """One server salting by key (the default) and one sharing across keys, started together."""
    handles = {
        "salted": start_server(server_log_dir, *FLAGS, wait=False),
        "shared": start_server(
            server_log_dir, *FLAGS, "--share-prefix-cache-across-api-keys", wait=False
        ),
    }
    try:
        for handle in handles.values():
            wait_healthy(handle)
        yield handles
    finally:
        for handle in handles.values():
            handle.stop()
    for handle in handles.values():
        assert handle.process.returncode == 0, handle.log()
        assert "Traceback" not in handle.log(), handle.log()
        for key in (MAIN_KEY, OTHER_KEY):  # a key is never logged
            assert key not in handle.log()


def _client(server: ServerHandle, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _prompt() -> str:
    """A prompt no other test sent, several blocks long."""
    return f"Request {uuid.uuid4().hex}: the quarterly figures stay private to this tenant. " * 3


def _completion_cached(server: ServerHandle, key: str, prompt: str, **extra: Any) -> int:
    out = _client(server, key).completions.create(
        model="demo", prompt=prompt, max_tokens=1, extra_body=extra or None
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


def _chat_cached(server: ServerHandle, key: str, text: str, **extra: Any) -> int:
    body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _responses_cached(server: ServerHandle, key: str, text: str, **extra: Any) -> int:
    out = _client(server, key).responses.create(
        model="demo", input=text, max_output_tokens=1, store=False, extra_body=extra or None
    )
    assert out.usage is not None
    return out.usage.input_tokens_details.cached_tokens


ENDPOINTS = {
    "completions": _completion_cached,
    "chat": _chat_cached,
    "responses": _responses_cached,
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_another_key_never_hits_a_keys_cached_blocks(
    servers: dict[str, ServerHandle], endpoint: str
) -> None:
    cached, server, prompt = ENDPOINTS[endpoint], servers["salted"], _prompt()
    assert cached(server, MAIN_KEY, prompt) == 0
    assert cached(server, MAIN_KEY, prompt) >= 16  # the key's own blocks are reused
    assert cached(server, OTHER_KEY, prompt) == 0  # they are cached, but not for this key
    assert cached(server, OTHER_KEY, prompt) >= 16  # it caches its own


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_the_opt_out_shares_blocks_across_keys(
    servers: dict[str, ServerHandle], endpoint: str
) -> None:
    cached, server, prompt = ENDPOINTS[endpoint], servers["shared"], _prompt()
    assert cached(server, MAIN_KEY, prompt) == 0
    assert cached(server, OTHER_KEY, prompt) >= 16


@pytest.mark.parametrize("which", ["salted", "shared"])
def test_a_client_cache_salt_separates_requests_within_one_key(
    servers: dict[str, ServerHandle], which: str
) -> None:
    server, prompt = servers[which], _prompt()
    salt = uuid.uuid4().hex
    assert _completion_cached(server, MAIN_KEY, prompt, cache_salt=salt) == 0
    assert _completion_cached(server, MAIN_KEY, prompt, cache_salt=salt) >= 16
    assert _completion_cached(server, MAIN_KEY, prompt, cache_salt=salt + "x") == 0
    assert _completion_cached(server, MAIN_KEY, prompt) == 0  # no salt: not the salted blocks
    # The same client salt under another key is still that key's own namespace (by default).
    other = _completion_cached(server, OTHER_KEY, prompt)
    assert (other == 0) if which == "salted" else (other >= 16)


def test_a_client_salt_cannot_reach_another_keys_namespace(
    servers: dict[str, ServerHandle],
) -> None:
    """Whatever salt key B sends, it never lands on key A's unsalted blocks."""
    server, prompt = servers["salted"], _prompt()
    assert _chat_cached(server, MAIN_KEY, prompt) == 0
    for salt in (MAIN_KEY, "api_key", "key-index:0"):
        assert _chat_cached(server, OTHER_KEY, prompt, cache_salt=salt) == 0
        assert _chat_cached(server, MAIN_KEY, prompt) >= 16  # A's blocks were cached all along


BAD_SALTS: list[Any] = ["", 42, ["salt"], {"salt": 1}, True]


@pytest.mark.parametrize("value", BAD_SALTS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_bad_cache_salt_is_a_400_naming_it(
    servers: dict[str, ServerHandle], path: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": "demo", "max_tokens": 1, "cache_salt": value}
    if path == "/v1/completions":
        body["prompt"] = "hello"
    elif path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body = {"model": "demo", "input": "hello", "cache_salt": value}
    response = httpx.post(
        f"{servers['salted'].base_url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {MAIN_KEY}"},
        timeout=60,
    )
    error = assert_error(response, 400, param="cache_salt")
    assert error["message"] == VLLM_MESSAGE


def test_the_sdk_raises_bad_request_for_an_empty_salt(servers: dict[str, ServerHandle]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(servers["salted"], MAIN_KEY).chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"cache_salt": ""},
        )
    assert VLLM_MESSAGE in str(err.value)
