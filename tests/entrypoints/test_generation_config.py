"""--generation-config auto|vllm|FOLDER and --override-generation-config, as vLLM reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.entrypoints.openai.generation_config import (
    load_generation_defaults,
    with_generation_defaults,
)
from tokenmill.errors import ConfigError


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_models_sampling_fields(tmp_path: Path) -> None:
    model = _folder(
        tmp_path,
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2, "do_sample": True},
    )
    assert load_generation_defaults("auto", model, None) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    assert load_generation_defaults("vllm", model, None) == {}
    assert load_generation_defaults("vllm", model, {"max_new_tokens": 9}) == {"max_tokens": 9}
    merged = load_generation_defaults("auto", model, {"temperature": 0.1, "min_p": 0.05})
    assert merged["temperature"] == 0.1 and merged["min_p"] == 0.05


def test_a_folder_must_hold_a_generation_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no generation_config\.json there"):
        load_generation_defaults(str(tmp_path), Path("/nowhere"), None)
    other = _folder(tmp_path, {"repetition_penalty": 1.1})
    assert load_generation_defaults(str(other), Path("/nowhere"), None) == {
        "repetition_penalty": 1.1
    }
    with pytest.raises(ConfigError, match="temperature must be a number"):
        load_generation_defaults("vllm", other, {"temperature": "hot"})


def test_defaults_fill_only_unset_fields() -> None:
    """``max_new_tokens`` is no body default: the engine applies it as a cap
    (tests/engine/test_request_limits.py)."""
    defaults = {"temperature": 0.6, "max_tokens": 32}
    assert with_generation_defaults({"temperature": 1.0}, defaults) == {"temperature": 1.0}
    assert with_generation_defaults({"top_p": 0.5}, defaults) == {"top_p": 0.5, "temperature": 0.6}
