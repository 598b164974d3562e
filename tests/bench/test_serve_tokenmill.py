"""``bench serve`` against a real ``tokenmill serve`` of the demo model on loopback.

The result file must carry every field, and its token counts must be the server's own:
each request's ``usage``, and in total the server's ``generation_tokens`` counter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import free_port
from tokenmill.bench.cli import register
from tokenmill.bench.datasets import build_requests
from tokenmill.bench.server_metrics import parse_prometheus_text
from tokenmill.bench.tokenization import encode_text, load_tokenizer, special_ids_of

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 180.0
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 16, 8


@pytest.fixture(scope="module")
def tokenmill_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-c",
        "from tokenmill.entrypoints.cli import main; raise SystemExit(main())",
        "serve",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "32MiB",
        "--disable-access-log",
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"tokenmill serve exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if (
                    httpx.get(f"{base_url}/v1/models", timeout=2, trust_env=False).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"tokenmill serve not ready in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _generation_tokens(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    return sum(parse_prometheus_text(text)["tokenmill:generation_tokens_total"])


def _run_cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_completions_result_has_every_field_and_the_servers_token_counts(
    tokenmill_server: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    before = _generation_tokens(tokenmill_server)
    rc = _run_cli(
        [
            "bench",
            "serve",
            "--base-url",
            tokenmill_server,
            "--model",
            "demo",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--range-ratio",
            "0.5",
            "--max-concurrency",
            "3",
            "--ignore-eos",
            "--no-progress",
            "--goodput",
            "ttft:60000",
            "--metrics-interval-s",
            "0.02",
            "--num-warmups",
            "0",  # the token count below is the measured requests' and the probe's
            "--save-result",
            str(out),
        ]
    )
    assert rc == 0
    after = _generation_tokens(tokenmill_server)
    result = json.loads(out.read_text())
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["prompt_format"] == "ids"  # tokenmill takes token-id prompts
    for key in (
        "duration",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "workload",
    ):
        assert result[key] is not None, key
    for stat in ("mean", "median", "std", "p90", "p95", "p99"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    requests = result["requests"]
    assert all(r["output_tokens_source"] == "usage" for r in requests)
    # Same seed, same workload: with --ignore-eos each request got exactly the max_tokens it asked
    # for, and the server's prompt_tokens are the token-id prompt's length.
    workload = build_requests(
        "random",
        NUM_PROMPTS,
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        range_ratio=0.5,
        seed=0,
        tokenizer=load_tokenizer("demo"),
    )
    assert result["output_lens"] == [w.output_len for w in workload]
    assert result["input_lens"] == [w.prompt_len for w in workload]
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    # The server generated the bench's tokens plus the uncounted probe (a fresh prompt shaped like request 0).
    assert after - before == result["total_output_tokens"] + requests[0]["output_tokens"]
    assert all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in requests)  # one chunk per token
    server = result["server_metrics"]
    # Whether a 20 ms poll lands while a request holds KV blocks is up to the host's scheduler, so
    # only the field's presence and range are asserted here; test_server_metrics asserts the peak.
    assert server["available"] and 0 <= server["peak_kv_cache_usage"] <= 1
    assert server["num_preemptions"] == 0
    assert server["peak_resident_memory_bytes"] > 0
    # what the server ran, so a comparison says what it compares
    assert server["engine_config"]["dtype"] == "float32"
    assert server["engine_config"]["quantization"] == "none"
    assert server["engine_config"]["kv_cache_dtype"] == "float32"
    assert int(server["engine_config"]["num_threads"]) >= 1


def test_chat_endpoint_with_text_prompts(tokenmill_server: str, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    rc = _run_cli(
        [
            "bench",
            "serve",
            "--base-url",
            tokenmill_server,
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            "demo",
            "--tokenizer",
            "demo",
            "--dataset",
            "prefix",
            "--prefix-len",
            "16",
            "--num-prefixes",
            "2",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--ignore-eos",
            "--no-progress",
            "--save-result",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["prompt_format"] == "chat"
    assert all(
        r["output_tokens"] == 4 and r["output_tokens_source"] == "usage" for r in result["requests"]
    )
    assert result["server_metrics"]["prefix_cache_hit_rate"] > 0  # the shared prefixes were reused


def test_verify_against_the_server_url(tokenmill_server: str) -> None:
    from tokenmill.bench.verify import run_server_greedy, run_verify

    report = run_verify("demo", max_tokens=6, num_prompts=3, server_url=tokenmill_server)
    assert report.passed and report.match_rate == 1.0
    # The server names tokens by id (return_tokens_as_token_ids), so the comparison is by id.
    generations = run_server_greedy(tokenmill_server, "demo", [[5, 6, 7]], 4)
    assert len(generations[0].token_ids) == 4 and all(
        isinstance(t, int) for t in generations[0].token_ids
    )
    assert report.max_logprob_diff is not None and report.max_logprob_diff < 1e-3


def test_the_servers_tokenizer_matches_the_local_one(tokenmill_server: str) -> None:
    from tokenmill.bench.target import RemoteTokenizer

    local = load_tokenizer("demo")
    remote = RemoteTokenizer.connect(tokenmill_server, "demo")
    try:
        assert remote.style == "vllm"  # tokenmill's /tokenize takes vLLM's shape
        text = "Once upon a time, in a village by the sea,"
        ids = encode_text(remote, text)
        assert ids == encode_text(local, text) and remote.decode(ids) == text
        pool = remote.sample_token_ids()
        assert len(pool) > 20 and not set(pool) & special_ids_of(local)
    finally:
        remote.close()
