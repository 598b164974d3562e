"""``tokenmill serve`` on a model only the Transformers fallback runs: the official OpenAI
client gets transformers' own greedy continuation, and the log says which implementation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hf_greedy
from tests.entrypoints.conftest import start_server
from tests.fallback_models import build_fallback_model
from tokenmill.tokenizer import Tokenizer


def test_served_fallback_model_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, server_log_dir: Path
) -> None:
    folder = build_fallback_model(tmp_path_factory.mktemp("gpt2"), tokenizer_dir, "gpt2")
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46]]
    expected, _ = hf_greedy(folder, prompts, 8)
    handle = start_server(server_log_dir, "--max-model-len", "128", model=str(folder))
    try:
        client = handle.openai()
        tokenizer = Tokenizer.from_pretrained(folder)
        for prompt, want in zip(prompts, expected, strict=True):
            resp = client.completions.create(
                model=str(folder),
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert resp.choices[0].text == tokenizer.decode(want)
            assert resp.usage.completion_tokens == 8
        assert "model implementation: transformers (GPT2LMHeadModel is not a native family" in (
            handle.log()
        )
    finally:
        handle.stop()
