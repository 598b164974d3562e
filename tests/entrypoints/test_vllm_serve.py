"""``tokenmill serve`` started with a realistic vLLM command line, talked to with real clients.

One server takes two dozen of vLLM's flags as a vLLM user would copy them; each test checks
what one flag (or response field) does on the live server, with the openai SDK or raw HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import ServerHandle, start_server
from tokenmill.model.demo import demo_model_path
from tokenmill.tokenizer.tokenizer import Tokenizer

MAX_NEW_TOKENS = 24
"""The cap the server's --override-generation-config sets."""
TEMPLATE = (
    "{{ greeting }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat template reading content as a string (so list content is joined for it)."""
THINK = "<think>ab</think>cd"


@pytest.fixture(scope="module")
def vllm_server(demo_cache: str, server_log_dir: Path, tmp_path_factory) -> Iterator[ServerHandle]:
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    handle = start_server(
        server_log_dir,
        "--model", "demo",
        "--served-model-name", "demo",
        "--dtype", "float32",
        "--max-model-len", "256",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256",
        "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "1",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--trust-remote-code",
        "--seed", "0",
        "--chat-template", str(template),
        "--default-chat-template-kwargs", '{"greeting": "hi"}',
        "--response-role", "bot",
        "--generation-config", "vllm",
        "--override-generation-config", json.dumps({"max_new_tokens": MAX_NEW_TOKENS}),
        "--reasoning-parser", "deepseek_r1",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-log-requests",
        "--enable-log-outputs",
        "--max-log-len", "12",
        "--uvicorn-log-level", "warning",
        "--disable-access-log-for-endpoints", "/health,/metrics",
        "--allowed-origins", '["http://example.com"]',
        "--allow-credentials",
        "--root-path", "/proxy",
        "--attention-backend", "torch_sdpa",
        "--mamba-backend", "triton",
        "--log-stats-interval", "0.5",
    )  # fmt: skip
    yield handle
    handle.stop()
    assert handle.process.returncode == 0, handle.log()


@pytest.fixture(scope="module")
def client(vllm_server: ServerHandle) -> openai.OpenAI:
    return vllm_server.openai()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_path())


def _wait_for_log(server: ServerHandle, text: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    return server.log()


def test_serves_and_logs_what_it_ignores_and_accepts(
    vllm_server: ServerHandle, client: openai.OpenAI
) -> None:
    out = client.completions.create(model="demo", prompt="Hello there, world", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens >= 1
    log = _wait_for_log(vllm_server, "Generated response")
    assert "--mamba-backend is ignored: no Mamba/SSM model family is supported" in log
    assert "attention backend torch_sdpa" in log
    assert "--trust-remote-code: accepted, but no code from the model folder is run" in log
    assert "Received request cmpl-" in log and "prompt: 'Hello there,'" in log  # --max-log-len 12
    assert "Generated response cmpl-" in log
    assert "unrecognized arguments" not in log
    assert "GET /health" not in log  # --disable-access-log-for-endpoints
    assert "Uvicorn running on" not in log  # --uvicorn-log-level warning


def test_periodic_stats_line_while_busy(vllm_server: ServerHandle, client: openai.OpenAI) -> None:
    client.completions.create(model="demo", prompt="stats please", max_tokens=8)
    log = _wait_for_log(vllm_server, "Avg prompt throughput")
    assert "Avg prompt throughput:" in log and "Prefix cache hit rate:" in log


def test_override_generation_config_caps_max_tokens(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo", prompt="Once", max_tokens=100, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == MAX_NEW_TOKENS
    assert out.choices[0].finish_reason == "length"


def test_cached_tokens_count_the_prefix_cache_hit(client: openai.OpenAI) -> None:
    prompt = "The prefix cache keeps the blocks of this prompt for the next request: " * 3
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=1)
    second = client.completions.create(model="demo", prompt=prompt, max_tokens=1)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert 16 <= cached < second.usage.prompt_tokens
    assert cached % 16 == 0  # whole blocks


def test_force_include_usage_on_streams_that_did_not_ask(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model="demo", prompt="stream", max_tokens=3, stream=True)
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3


def test_return_token_ids_on_completions(
    vllm_server: ServerHandle, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    out = client.completions.create(
        model="demo",
        prompt="token ids",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0].model_extra or {}
    assert choice["prompt_token_ids"] == tokenizer.encode("token ids")
    assert len(choice["token_ids"]) == out.usage.completion_tokens  # type: ignore[union-attr]
    stream = client.completions.create(
        model="demo",
        prompt="token ids",
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c for c in stream if c.choices]
    assert (chunks[0].choices[0].model_extra or {})["prompt_token_ids"] == choice[
        "prompt_token_ids"
    ]
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert streamed == choice["token_ids"]
    assert all("prompt_token_ids" not in (c.choices[0].model_extra or {}) for c in chunks[1:])


def test_chat_return_token_ids_and_prompt_logprobs(vllm_server: ServerHandle) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "temperature": 0,
        "return_token_ids": True,
        "prompt_logprobs": 1,
    }
    with vllm_server.http() as http:
        data = http.post("/v1/chat/completions", json=body).json()
        prompt_ids = http.post(
            "/tokenize", json={"messages": body["messages"], "model": "demo"}
        ).json()["tokens"]
    assert data["prompt_token_ids"] == prompt_ids
    assert len(data["choices"][0]["token_ids"]) == data["usage"]["completion_tokens"]
    logprobs = data["prompt_logprobs"]
    assert len(logprobs) == len(prompt_ids) and logprobs[0] is None
    assert str(prompt_ids[1]) in logprobs[1]


def test_response_role_and_reasoning_content(vllm_server: ServerHandle) -> None:
    """deepseek_r1: text up to </think> is reasoning; without it all of the output is."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "think"}],
        "max_tokens": 40,
        "structured_outputs": {"regex": THINK},
    }
    with vllm_server.http() as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["role"] == "bot"
        assert (message["reasoning_content"], message["reasoning"]) == ("ab", "ab")
        assert message["content"] == "cd"
        plain = {**body, "structured_outputs": {"regex": "[a-z]{5}"}}
        message = http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
        assert message["content"] is None and len(message["reasoning_content"]) == 5


def test_reasoning_streams_as_reasoning_then_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "think"}],
        max_tokens=40,
        stream=True,
        extra_body={"structured_outputs": {"regex": THINK}},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "bot"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("ab", "cd")
    assert chunks[-1].usage is not None  # --enable-force-include-usage


def test_chat_template_flag_default_kwargs_and_string_content(
    vllm_server: ServerHandle, tokenizer: Tokenizer
) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    with vllm_server.http() as http:
        ids = http.post(
            "/tokenize", json={"model": "demo", "messages": [{"role": "user", "content": parts}]}
        ).json()["tokens"]
    assert ids == tokenizer.encode("hi<|user|>a\nb\n<|assistant|>", add_special_tokens=False)


def test_tokenize_token_strs_and_detokenize_keeps_special_tokens(
    vllm_server: ServerHandle, tokenizer: Tokenizer
) -> None:
    with vllm_server.http() as http:
        tok = http.post(
            "/tokenize", json={"model": "demo", "prompt": "hello", "return_token_strs": True}
        ).json()
        assert tok["tokens"][0] == tokenizer.bos_token_id
        assert tok["token_strs"] == tokenizer.convert_ids_to_tokens(tok["tokens"])
        text = http.post("/detokenize", json={"model": "demo", "tokens": tok["tokens"]}).json()
    assert text["prompt"] == tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    assert text["prompt"].startswith("<s>")


def test_cors_allows_only_the_given_origins(vllm_server: ServerHandle) -> None:
    preflight = {"Access-Control-Request-Method": "POST"}
    allowed = httpx.options(
        f"{vllm_server.base_url}/v1/completions",
        headers={**preflight, "Origin": "http://example.com"},
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://example.com"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = httpx.options(
        f"{vllm_server.base_url}/v1/completions",
        headers={**preflight, "Origin": "http://elsewhere.example"},
    )
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers


def test_root_path_and_docs(vllm_server: ServerHandle) -> None:
    with vllm_server.http() as http:
        spec = http.get("/openapi.json").json()
        assert spec["servers"] == [{"url": "/proxy"}]
        assert http.get("/docs").status_code == 200


VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
}
"""vLLM 0.32's engine metric families (vllm/v1/metrics/loggers.py) that apply to tokenmill."""


def test_vllm_metric_names_labels_and_buckets(
    vllm_server: ServerHandle, client: openai.OpenAI
) -> None:
    client.completions.create(model="demo", prompt="metrics for vLLM dashboards", max_tokens=3, n=2)
    vllm_server.wait_idle()
    text = httpx.get(
        f"{vllm_server.base_url}/metrics", headers=vllm_server.headers(), timeout=10
    ).text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE vllm:"))
    for name, kind in VLLM_FAMILIES.items():
        shown = name + "_total" if kind == "counter" else name  # counters' TYPE line names
        assert types.get(shown) == kind, f"{name}: {types.get(shown)}"
    labels = 'engine="0",model_name="demo"'
    assert f"vllm:num_requests_running{{{labels}}} 0.0" in text
    assert (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="demo"}' in text
    )
    assert 'vllm:request_params_n_bucket{engine="0",le="2.0",model_name="demo"} ' in text
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="demo"}' in text
    )
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="16384.0",model_name="demo"}' in text
    assert (
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="demo",reason="capacity"}'
        in text
    )
    assert 'block_size="16"' in text and 'enable_prefix_caching="True"' in text
    # the same observations under both names
    for name in ("request_prompt_tokens_count", "generation_tokens_total", "prompt_tokens_total"):
        tokenmill = vllm_server.metrics()[f"tokenmill:{name}"]
        assert tokenmill > 0 and vllm_server.metrics()[f"vllm:{name}"] == tokenmill
