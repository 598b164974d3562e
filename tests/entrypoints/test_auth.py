"""API keys: every route and path variant needs one; health and metrics only by a flag.

The shared server has two keys and no open routes, so every request without a valid key
gets 401 in OpenAI's shape, whatever the path spelling or method.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from tests.entrypoints.conftest import MAIN_KEY, OTHER_KEY, ServerHandle, assert_error
from tokenmill.entrypoints.openai.auth import APIKeyAuthMiddleware

ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/demo"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/route"),
]
BAD_AUTH = {
    "missing": None,
    "wrong": "Bearer sk-wrong",
    "wrong-case": f"Bearer {MAIN_KEY.upper()}",
    "prefix": f"Bearer {MAIN_KEY[:-1]}",
    "longer": f"Bearer {MAIN_KEY}x",
    "empty": "Bearer",
    "no-scheme": MAIN_KEY,
    "basic": f"Basic {MAIN_KEY}",
}
BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [5]},
}


def _variants(path: str) -> list[str]:
    head, _, tail = path.rpartition("/")
    encoded = f"{head}/%{ord(tail[0]):02X}{tail[1:]}"
    return [
        path,
        path + "/",
        "/" + path,
        path.replace("/", "//"),
        encoded,
        path.upper(),
        path + "?a=1",
        path + "%2F",
        path + "/.",
    ]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("auth", list(BAD_AUTH), ids=list(BAD_AUTH))
def test_bad_keys_are_401_on_every_route_and_variant(
    server: ServerHandle, method: str, path: str, auth: str
) -> None:
    value = BAD_AUTH[auth]
    headers = {"Authorization": value} if value is not None else {}
    body = BODIES.get(path)
    with httpx.Client(base_url=server.base_url, timeout=30) as plain:
        for variant in _variants(path):
            for verb in (method, "OPTIONS", "HEAD"):
                r = plain.request(
                    verb, variant, headers=headers, json=body if verb == "POST" else None
                )
                assert r.status_code == 401, (verb, variant, r.status_code, r.text)
                if verb != "HEAD":
                    error = assert_error(r, 401, code="invalid_api_key")
                    assert error["type"] == "authentication_error"


def _raw_status(server: ServerHandle, request_line: str, headers: str = "") -> int:
    """Status of a request sent byte for byte (no client-side path normalization)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            f"{request_line}\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode()
        )
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "target",
    [
        "/v1/../health",
        "/./metrics",
        "/v1/models/../models",
        "/%2E%2E/health",
        "http://127.0.0.1/health",
        "/health#x",
        "*",
    ],
)
def test_raw_path_tricks_need_the_key(server: ServerHandle, target: str) -> None:
    method = "OPTIONS" if target == "*" else "GET"
    assert _raw_status(server, f"{method} {target} HTTP/1.1") in (400, 401)


def test_two_authorization_headers_are_refused(server: ServerHandle) -> None:
    headers = [("Authorization", f"Bearer {MAIN_KEY}"), ("Authorization", "Bearer sk-wrong")]
    assert_error(httpx.get(f"{server.base_url}/v1/models", headers=headers), 401)


@pytest.mark.parametrize("key", [MAIN_KEY, OTHER_KEY])
def test_each_configured_key_works(server: ServerHandle, key: str) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    assert client.models.list().data[0].id == "demo"
    lower_scheme = httpx.get(
        f"{server.base_url}/health", headers={"Authorization": f"bearer {key}"}
    )
    assert lower_scheme.status_code == 200


def test_openai_client_with_wrong_key_raises_authentication_error(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="demo", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], stream=True
        )


def _scope_state(app_keys: list[str], headers: list[tuple[bytes, bytes]]) -> dict:
    """The ``scope["state"]`` the middleware hands the app for one request (in process)."""
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen.update(scope.get("state", {}))

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(APIKeyAuthMiddleware(app, app_keys)(scope, None, None))  # type: ignore[arg-type]
    return seen


def test_each_key_gets_its_own_cache_salt_and_never_the_key_itself() -> None:
    keys = [MAIN_KEY, OTHER_KEY]
    salts = []
    for index, key in enumerate(keys):
        state = _scope_state(keys, [(b"authorization", f"Bearer {key}".encode())])
        assert state["api_key_id"] == index
        assert key not in state["api_key_salt"]
        salts.append(state["api_key_salt"])
    assert salts[0] != salts[1]
    again = _scope_state(keys, [(b"x-api-key", MAIN_KEY.encode())])  # Anthropic's header
    assert again["api_key_salt"] == salts[0]


def test_a_replica_salts_by_the_key_index_its_front_end_sent() -> None:
    """A data-parallel replica has no keys: it salts by the forwarded index, one per key."""
    first = _scope_state([], [(b"x-tokenmill-api-key-id", b"0")])
    second = _scope_state([], [(b"x-tokenmill-api-key-id", b"1")])
    assert first["api_key_id"] == 0 and second["api_key_id"] == 1
    assert first["api_key_salt"] != second["api_key_salt"]
    assert _scope_state([], []) == {}  # no keys anywhere: no salt, one shared cache
