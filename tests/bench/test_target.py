"""Asking a target what it serves and borrowing its tokenizer; the CLI paths that use them."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from tests.bench.conftest import CharTokenizer
from tests.bench.fake_openai_server import MODEL_NAME
from tokenmill.bench import verify
from tokenmill.bench.cli import register
from tokenmill.bench.datasets import build_random_requests
from tokenmill.bench.target import RemoteTokenizer, TargetError, first_served_model
from tokenmill.bench.tokenization import encode_text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_first_served_model(fake_server) -> None:
    assert first_served_model(fake_server.base_url) == MODEL_NAME
    assert first_served_model(f"{fake_server.base_url}/v1/") == MODEL_NAME
    with pytest.raises(TargetError, match="cannot reach"):
        first_served_model(_closed_port_url())


@pytest.mark.parametrize("style", ["vllm", "llama.cpp"])
def test_remote_tokenizer_speaks_both_shapes(fake_server, style: str) -> None:
    fake_server.behavior.tokenize_style = style
    tokenizer = RemoteTokenizer.connect(fake_server.base_url, MODEL_NAME)
    try:
        assert tokenizer.style == style
        assert encode_text(tokenizer, "Hi there") == [ord(c) for c in "Hi there"]
        assert tokenizer.decode([ord(c) for c in "ok!"]) == "ok!"
        assert tokenizer.sample_token_ids() == sorted(set(tokenizer.sample_token_ids()))
    finally:
        tokenizer.close()
    if style == "vllm":
        assert fake_server.behavior.tokenize_bodies[0] == {
            "model": MODEL_NAME,
            "prompt": "Hello",
            "add_special_tokens": False,
        }


def test_random_prompts_from_a_remote_tokenizer_have_exact_lengths(fake_server) -> None:
    tokenizer = RemoteTokenizer.connect(fake_server.base_url, MODEL_NAME)
    try:
        requests = build_random_requests(4, input_len=12, output_len=3, seed=1, tokenizer=tokenizer)
        pool = set(tokenizer.sample_token_ids())
    finally:
        tokenizer.close()
    for r in requests:
        assert r.prompt_len == 12 and set(r.prompt_token_ids) <= pool
        assert len(r.prompt_text) == 12  # one character per token on the fake server


def test_bench_serve_random_without_a_tokenizer_asks_the_server(
    fake_server, tmp_path, capsys
) -> None:
    b = fake_server.behavior
    b.ttft_delay_s = b.itl_delay_s = 0.0
    out = tmp_path / "r.json"
    args = _parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server.base_url,
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "3",
            "--input-len",
            "6",
            "--output-len",
            "2",
            "--no-progress",
            "--save-result",
            str(out),
        ]
    )
    assert args.func(args) == 0
    assert f"prompts are tokenized by {fake_server.base_url}/tokenize" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["workload"]["tokenizer"] == "server /tokenize"
    after_warmup = 1 + result["num_warmups"]  # the probe, then the warm-ups
    measured = [body["messages"][0]["content"] for body in b.bodies[after_warmup:]]
    assert len(measured) == 3 and all(len(p) == 6 for p in measured)


def test_bench_serve_random_fails_clearly_when_nothing_can_tokenize(fake_server, capsys) -> None:
    fake_server.behavior.tokenize_style = None
    args = _parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server.base_url,
            "--num-prompts",
            "2",
            "--no-progress",
        ]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--dataset random needs token ids" in err and "/tokenize did not answer" in err
    assert "pass --tokenizer PATH or --vocab-size N" in err
    assert fake_server.behavior.bodies == []  # nothing was sent


def test_verify_asks_the_server_for_its_model_unless_told(fake_server, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(verify, "load_tokenizer", lambda model: CharTokenizer())
    monkeypatch.setattr(
        verify,
        "run_transformers_greedy",
        lambda model, prompts, *a, **k: [verify.Generation([1], [None]) for _ in prompts],
    )

    def server_greedy(base_url, model, prompts, *a, **k):
        seen.append(model)
        return [verify.Generation([1], [None]) for _ in prompts]

    monkeypatch.setattr(verify, "run_server_greedy", server_greedy)
    for flags in (
        [],
        ["--model", "/models/x"],
        ["--model", "/models/x", "--served-model-name", "x"],
    ):
        args = _parser().parse_args(["verify", "--server-url", fake_server.base_url, *flags])
        assert args.func(args) == 0
    assert seen == [MODEL_NAME, "/models/x", "x"]
