"""``bench serve`` end to end against the fake streaming server on loopback.

The server's delays are known, so TTFT, ITL, TPOT and E2E measured through real HTTP
streaming must land on them (within scheduling slack of a shared CPU).
"""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from tests.bench.fake_openai_server import MODEL_NAME
from tokenmill.bench.arrivals import build_arrival_offsets_s
from tokenmill.bench.datasets import build_random_requests
from tokenmill.bench.serve import (
    BenchmarkError,
    ServeConfig,
    format_summary,
    run_serve_benchmark,
    save_result,
)


def _config(server, **kwargs) -> ServeConfig:
    kwargs.setdefault("show_progress", False)
    kwargs.setdefault("metrics_interval_s", 0.05)
    return ServeConfig(base_url=server.base_url, **kwargs)


def test_timings_match_the_servers_known_delays(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s, b.itl_delay_s = 0.1, 0.03
    requests = build_random_requests(6, input_len=8, output_len=5, vocab_size=100, seed=0)
    result = run_serve_benchmark(_config(fake_server, max_concurrency=2), requests)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["model_id"] == MODEL_NAME  # resolved from /v1/models
    assert result["prompt_format"] == "ids"
    # Only what holds on a busy machine: the server's delays are lower bounds on what the
    # client sees (a late read can bunch chunks, so single gaps and upper bounds are not).
    for r in result["requests"]:
        assert r["ttft_s"] >= 0.1
        assert len(r["itl_s"]) == 4 and all(gap >= 0 for gap in r["itl_s"])
        assert r["e2e_s"] >= 0.1 + 4 * 0.03
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + sum(r["itl_s"]), abs=1e-6)
        assert r["tpot_s"] == pytest.approx(sum(r["itl_s"]) / 4, abs=1e-6)
        assert (r["output_tokens"], r["output_tokens_source"]) == (5, "usage")
        assert r["prompt_tokens"] == 8
    assert result["median_ttft_ms"] >= 100
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 48
    # max_concurrency is honoured: the server never saw more than 2 in flight.
    assert b.peak_in_flight == 2
    # The probe and the warm-ups (one per concurrent request) are not counted.
    assert result["num_warmups"] == 2
    assert b.num_requests == 1 + 2 + 6


def test_result_has_every_field_and_server_figures(fake_server, tmp_path: Path) -> None:
    requests = build_random_requests(4, input_len=6, output_len=3, vocab_size=100)
    config = _config(fake_server, goodput_slos_ms={"ttft": 10_000, "tpot": 10_000}, label="fake")
    result = run_serve_benchmark(config, requests, workload={"dataset": "random"})
    for stat in ("mean", "median", "std", "p90", "p95", "p99"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert isinstance(result[f"{stat}_{metric}_ms"], float)
    for key in (
        "duration",
        "completed",
        "failed",
        "failure_reasons",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
        "requests",
        "server_metrics",
        "workload",
        "label",
    ):
        assert key in result, key
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    server = result["server_metrics"]
    assert server["available"] and server["num_scrapes"] >= 2
    assert server["num_preemptions"] == 4  # counter delta over the measured run only
    assert server["peak_kv_cache_usage"] > 0
    assert server["peak_resident_memory_bytes"] == 1048576 * 100
    path = save_result(result, tmp_path / "out" / "r.json")
    assert json.loads(path.read_text())["label"] == "fake"
    summary = format_summary(result)
    assert "Serving Benchmark Result" in summary and "Peak KV cache usage" in summary


def test_chat_endpoint_with_text_prompts(fake_server, char_tokenizer) -> None:
    b = fake_server.behavior
    b.ttft_delay_s, b.itl_delay_s, b.separate_finish_chunk = 0.08, 0.02, True
    requests = build_random_requests(3, input_len=10, output_len=4, tokenizer=char_tokenizer)
    result = run_serve_benchmark(
        _config(fake_server, endpoint="/v1/chat/completions"), requests, char_tokenizer
    )
    assert result["completed"] == 3 and result["prompt_format"] == "chat"
    for r in result["requests"]:
        # The role chunk arrives at once but is not a token; the trailing finish chunk is no ITL.
        assert r["ttft_s"] >= 0.08
        assert len(r["itl_s"]) == 3
    assert "messages" in b.bodies[-1] and b.bodies[-1]["max_tokens"] == 4


def test_auto_prompt_format_falls_back_to_text(fake_server, char_tokenizer) -> None:
    fake_server.behavior.accepts_token_ids = False
    fake_server.behavior.ttft_delay_s = fake_server.behavior.itl_delay_s = 0.0
    requests = build_random_requests(3, input_len=5, output_len=2, tokenizer=char_tokenizer)
    result = run_serve_benchmark(_config(fake_server), requests, char_tokenizer)
    assert result["prompt_format"] == "text" and result["completed"] == 3
    assert isinstance(fake_server.behavior.bodies[-1]["prompt"], str)


def test_server_refusing_ids_without_a_tokenizer_fails_clearly(fake_server) -> None:
    fake_server.behavior.accepts_token_ids = False
    requests = build_random_requests(2, input_len=5, output_len=2, vocab_size=20)
    with pytest.raises(BenchmarkError, match="--tokenizer"):
        run_serve_benchmark(_config(fake_server), requests)


def test_failures_are_counted_with_reasons(fake_server) -> None:
    b = fake_server.behavior
    b.fail_marker, b.ttft_delay_s, b.itl_delay_s = "x", 0.0, 0.0
    requests = build_random_requests(6, input_len=5, output_len=2, vocab_size=20, seed=0)
    for i in (2, 4):
        requests[i].prompt_token_ids[0] = 0  # the fake server fails prompts holding token 0
    for i in (0, 1, 3, 5):
        requests[i].prompt_token_ids = [t or 1 for t in requests[i].prompt_token_ids]
    result = run_serve_benchmark(_config(fake_server), requests)
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["failure_reasons"] == {"HTTP 500: injected failure": 2}
    assert result["errors"][2] == "HTTP 500: injected failure"


def test_without_usage_tokens_are_recounted(fake_server, char_tokenizer) -> None:
    b = fake_server.behavior
    b.sends_usage, b.ttft_delay_s, b.itl_delay_s, b.has_metrics = False, 0.0, 0.0, False
    requests = build_random_requests(2, input_len=5, output_len=3, tokenizer=char_tokenizer)
    result = run_serve_benchmark(_config(fake_server), requests, char_tokenizer)
    r = result["requests"][0]
    # "w0 w1 w2 " re-tokenized by the char tokenizer: 'w' and spaces are letters of its alphabet.
    assert r["output_tokens_source"] == "tokenizer" and r["output_tokens"] == len("w w w ")
    assert r["prompt_tokens"] == 5
    assert result["server_metrics"] == {"available": False}
    no_tok = run_serve_benchmark(_config(fake_server), requests)
    assert no_tok["requests"][0]["output_tokens_source"] == "chunks"
    assert no_tok["requests"][0]["output_tokens"] == 3


def test_request_rate_spreads_sends_on_the_schedule(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s, b.itl_delay_s = 0.0, 0.0
    requests = build_random_requests(8, input_len=4, output_len=2, vocab_size=20)
    result = run_serve_benchmark(_config(fake_server, request_rate=20.0, seed=5), requests)
    planned = build_arrival_offsets_s(8, 20.0, 1.0, seed=5)
    sent = [r["send_time_s"] for r in result["requests"]]
    # Never early, and in the planned order; how late a busy machine sends is not asserted.
    for want, got in zip(planned, sent, strict=True):
        assert got >= want - 0.001
    assert sent == sorted(sent)
    assert result["duration"] >= planned[-1]


def test_unreachable_server_fails_the_probe() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    config = ServeConfig(
        base_url=f"http://127.0.0.1:{port}",
        model="m",
        show_progress=False,
        request_timeout_s=5,
        ready_timeout_s=1.5,
    )
    with pytest.raises(BenchmarkError, match=r"still not ready after 1\.5s"):
        run_serve_benchmark(config, build_random_requests(1, 4, 2, vocab_size=10))
    with pytest.raises(BenchmarkError, match="cannot reach"):
        run_serve_benchmark(
            replace(config, model=None), build_random_requests(1, 4, 2, vocab_size=10)
        )


def test_probe_waits_while_the_server_loads(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s = b.itl_delay_s = 0.0
    b.loading_requests_left = 2  # answer 503 twice, like a server still loading its model
    result = run_serve_benchmark(
        _config(fake_server, ready_timeout_s=30), build_random_requests(2, 4, 2, vocab_size=20)
    )
    assert result["completed"] == 2 and b.loading_requests_left == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        ServeConfig(base_url="http://127.0.0.1:1", endpoint="/v1/embeddings")
    assert ServeConfig(base_url="http://127.0.0.1:1/v1/").root_url == "http://127.0.0.1:1"


def test_probe_and_warmups_never_send_a_measured_prompt(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s = b.itl_delay_s = 0.0
    requests = build_random_requests(
        4, input_len=12, output_len=3, range_ratio=0.5, vocab_size=100, seed=0
    )
    result = run_serve_benchmark(_config(fake_server, num_warmups=3), requests)
    assert result["completed"] == 4
    probe_and_warmups, measured_bodies = b.bodies[:4], b.bodies[4:]
    measured = [r.prompt_token_ids for r in requests]
    assert sorted(body["prompt"] for body in measured_bodies) == sorted(measured)
    assert not any(body["prompt"] in measured for body in probe_and_warmups)
    # Shaped like the measured requests: the probe like request 0, warm-up i like request i.
    shapes = [(len(body["prompt"]), body["max_tokens"]) for body in probe_and_warmups]
    assert shapes[0] == (requests[0].prompt_len, requests[0].output_len)
    assert sorted(shapes[1:]) == sorted((r.prompt_len, r.output_len) for r in requests[1:])


def test_api_key_reaches_requests_and_the_metrics_scrape(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s = b.itl_delay_s = 0.0
    b.required_api_key = "sekret"
    requests = build_random_requests(2, input_len=4, output_len=2, vocab_size=20)
    result = run_serve_benchmark(_config(fake_server, api_key="sekret"), requests)
    assert result["completed"] == 2 and result["model_id"] == MODEL_NAME
    assert result["server_metrics"]["available"] and result["server_metrics"]["num_scrapes"] >= 2
    with pytest.raises(BenchmarkError, match="HTTP 401"):
        run_serve_benchmark(_config(fake_server, model=MODEL_NAME), requests)


def test_request_timeout_is_a_total_deadline(fake_server) -> None:
    b = fake_server.behavior
    b.ttft_delay_s, b.itl_delay_s = 0.0, 0.05  # each read is quick; the whole stream is not
    short = build_random_requests(1, input_len=4, output_len=2, vocab_size=20, seed=0)
    long = build_random_requests(2, input_len=4, output_len=40, vocab_size=20, seed=1)
    result = run_serve_benchmark(_config(fake_server, request_timeout_s=0.6), short + long)
    assert (result["completed"], result["failed"]) == (1, 2)  # the probe is request 0's short shape
    assert result["failure_reasons"] == {"timeout": 2}
    assert result["duration"] < 0.6 + 0.5  # not 40 x 0.05 = 2 s


def test_library_log_lines_stay_out_of_the_measurement(
    fake_server, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every request at info; during the measured requests (the progress bar) it
    is held to warnings, and its level is restored afterwards."""
    import logging

    requests = build_random_requests(8, 4, 2, vocab_size=10, seed=3)
    with caplog.at_level(logging.INFO):
        run_serve_benchmark(_config(fake_server, num_warmups=0), requests)
    http_lines = [r for r in caplog.records if r.name == "httpx"]
    assert len(http_lines) < len(requests)  # the probe's, not one per measured request
    assert logging.getLogger("httpx").level == logging.NOTSET


def test_warm_ups_by_default_one_per_concurrent_request(fake_server) -> None:
    """Without --num-warmups every concurrent slot is warmed once before measuring, and the
    result records how many; 0 is a cold run, recorded as such."""
    b = fake_server.behavior
    b.ttft_delay_s = b.itl_delay_s = 0.0
    requests = build_random_requests(6, input_len=6, output_len=2, vocab_size=50, seed=5)
    result = run_serve_benchmark(_config(fake_server, max_concurrency=4), requests)
    assert result["num_warmups"] == 4
    assert len(b.bodies) == 1 + 4 + 6  # the probe, the warm-ups, the measured requests
    b.bodies.clear()
    cold = run_serve_benchmark(_config(fake_server, max_concurrency=4, num_warmups=0), requests)
    assert cold["num_warmups"] == 0 and len(b.bodies) == 1 + 6
