"""``/v1/models``, ``/health``, ``/version``, ``/metrics``, ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import httpx
import openai

from tests.entrypoints.conftest import MAIN_MAX_MODEL_LEN, ServerHandle, assert_error

EXPECTED_METRICS = [
    "tokenmill:num_requests_running",
    "tokenmill:num_requests_waiting",
    "tokenmill:kv_cache_usage_perc",
    "tokenmill:prompt_tokens_total",
    "tokenmill:generation_tokens_total",
    "tokenmill:request_success_total",
    "tokenmill:num_preemptions_total",
    "tokenmill:prefix_cache_queries_total",
    "tokenmill:prefix_cache_hits_total",
    "tokenmill:time_to_first_token_seconds_count",
    "tokenmill:inter_token_latency_seconds_count",
    "tokenmill:request_time_per_output_token_seconds_count",
    "tokenmill:e2e_request_latency_seconds_count",
    "tokenmill:request_queue_time_seconds_count",
    "tokenmill:request_prompt_tokens_count",
    "tokenmill:request_generation_tokens_count",
    "tokenmill:compile_time_seconds",
]


def test_compile_time_is_exported_from_the_engine_stats() -> None:
    from tokenmill.core.stats import EngineStats
    from tokenmill.metrics import ServerMetrics

    metrics = ServerMetrics("demo", 1024, lambda: EngineStats(compile_time_s=12.5, num_running=3))
    sample = metrics.registry.get_sample_value
    assert sample("tokenmill:compile_time_seconds", {"model_name": "demo"}) == 12.5
    assert sample("tokenmill:num_requests_running", {"model_name": "demo"}) == 3


def test_models_list_and_retrieve(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAIN_MAX_MODEL_LEN
    assert_error(http.get("/v1/models/nope"), 404, param="model", code="model_not_found")


def test_health_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]


def test_head_health_and_metrics_answer_as_get_without_a_body(
    server: ServerHandle, http: httpx.Client
) -> None:
    for path in ("/health", "/metrics"):
        get, head = http.get(path), http.head(path)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b""
        assert head.headers.get("content-type") == get.headers.get("content-type"), path
        assert int(head.headers["content-length"]) > 0 or path == "/health"
    assert (
        http.head("/health").headers["content-length"]
        == http.get("/health").headers["content-length"]
    )
    # The same auth rules as GET: the shared server opens nothing.
    assert httpx.head(f"{server.base_url}/health").status_code == 401
    assert httpx.head(f"{server.base_url}/metrics").status_code == 401


def test_metrics_names_labels_and_counts(server: ServerHandle, client: openai.OpenAI) -> None:
    before = server.metrics()
    client.completions.create(
        model="demo", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    after = server.wait_idle()
    for name in EXPECTED_METRICS:
        assert name in after, name
    assert (
        after["tokenmill:generation_tokens_total"]
        - before.get("tokenmill:generation_tokens_total", 0)
        >= 3
    )
    assert after["tokenmill:prompt_tokens_total"] > before.get("tokenmill:prompt_tokens_total", 0)
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers()).text
    assert 'tokenmill:request_success_total{finished_reason="length",model_name="demo"}' in text
    assert 'tokenmill:num_requests_running{model_name="demo"}' in text


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    r = http.post(
        "/tokenize", json={"prompt": "Blocks of memory", "return_token_strs": True}
    ).json()
    assert (
        r["count"] == len(r["tokens"]) == len(r["token_strs"])
        and r["max_model_len"] == MAIN_MAX_MODEL_LEN
    )
    without = http.post(
        "/tokenize", json={"prompt": "Blocks of memory", "add_special_tokens": False}
    ).json()
    assert without["count"] <= r["count"]
    text = http.post("/detokenize", json={"tokens": without["tokens"]}).json()["prompt"]
    assert text == "Blocks of memory"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_tokenize_errors(http: httpx.Client) -> None:
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")
    assert_error(http.post("/tokenize", json={}), 400, param="prompt")
    assert_error(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, param="model")
