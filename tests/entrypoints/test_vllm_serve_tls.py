"""vLLM flags that change how the server runs: TLS, qwen3 reasoning, no chunked prefill,
no docs, a generation-config folder, token-id logprob labels, no stats line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import REPO_ROOT, ServerHandle, free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def tls_server(demo_cache: str, server_log_dir: Path, tmp_path_factory) -> Iterator[ServerHandle]:
    folder = tmp_path_factory.mktemp("tls")
    key, cert = _self_signed(folder)
    gen = folder / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 30}))
    port = free_port()
    log_path = server_log_dir / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", "demo",
        "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--max-model-len", "128", "--max-num-batched-tokens", "32",
        "--no-enable-chunked-prefill",
        "--reasoning-parser", "qwen3",
        "--disable-fastapi-docs",
        "--generation-config", str(gen),
        "--return-tokens-as-token-ids",
        "--disable-log-stats",
        "--log-stats-interval", "0.2",
    ]  # fmt: skip
    env = {**os.environ, "TOKENMILL_CACHE": demo_cache}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    handle = ServerHandle(process, port, None, log_path)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, handle.log()
        try:
            if httpx.get(_url(handle, "/health"), verify=False, timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, handle.log()
        time.sleep(0.1)
    yield handle
    handle.stop()
    assert process.returncode == 0, handle.log()


def _url(server: ServerHandle, path: str) -> str:
    return f"https://127.0.0.1:{server.port}{path}"


def _chat(server: ServerHandle, **fields: object) -> dict:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **fields}
    response = httpx.post(_url(server, "/v1/chat/completions"), json=body, verify=False, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_speaks_https_only(tls_server: ServerHandle) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health", timeout=5)


def test_generation_config_folder_caps_max_tokens(tls_server: ServerHandle) -> None:
    data = _chat(tls_server, max_tokens=50, ignore_eos=True)
    assert data["usage"]["completion_tokens"] == 30


def test_qwen3_reasoning_follows_enable_thinking(tls_server: ServerHandle) -> None:
    constraint = {"structured_outputs": {"regex": "<think>ab</think>cd"}, "max_tokens": 40}
    thinking = _chat(tls_server, **constraint)["choices"][0]["message"]
    assert (thinking["reasoning_content"], thinking["content"]) == ("ab", "cd")
    off = _chat(tls_server, **constraint, chat_template_kwargs={"enable_thinking": False})
    message = off["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "<think>ab</think>cd"


def test_return_tokens_as_token_ids_is_the_default(tls_server: ServerHandle) -> None:
    data = _chat(tls_server, max_tokens=2, logprobs=True)
    tokens = [entry["token"] for entry in data["choices"][0]["logprobs"]["content"]]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_long_prompt_without_chunked_prefill(tls_server: ServerHandle) -> None:
    """--max-num-batched-tokens 32 but no chunking: the step budget grows to the context."""
    data = _chat(tls_server, messages=[{"role": "user", "content": "word " * 40}], max_tokens=2)
    assert data["usage"]["prompt_tokens"] > 32
    assert "the step budget is 128 tokens" in tls_server.log()


def test_dtype_auto_is_bf16_where_the_cpu_computes_it(tls_server: ServerHandle) -> None:
    """vLLM's default: a float32 checkpoint (the demo) runs as bf16 on a CPU with bf16 units,
    and on AVX2 where tokenmill's kernels read bf16 weights."""
    from tokenmill import kernels
    from tokenmill.model.cpu import cpu_info

    if cpu_info().has_native_bf16 or kernels.active_isa() == "avx2":
        assert "checkpoint is float32; using bfloat16" in tls_server.log()
        assert "--dtype float32 keeps float32" in tls_server.log()
    else:
        assert "dtype auto: float32, as the checkpoint declares" in tls_server.log()


def test_docs_disabled_and_no_stats_line(tls_server: ServerHandle) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(_url(tls_server, path), verify=False, timeout=10).status_code == 404
    _chat(tls_server, max_tokens=2)
    time.sleep(0.5)  # several --log-stats-interval periods: none may log
    assert "Avg prompt throughput" not in tls_server.log()
