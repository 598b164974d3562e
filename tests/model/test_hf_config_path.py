"""``--hf-config-path``: a local config.json used instead of the model's own (for a GGUF
file, instead of the one its metadata gives), checked against the weights; a Hub id is
refused in one line, as is a config of another model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.entrypoints.conftest import free_port
from tests.gguf_fixture import model_overrides, write_gguf
from tokenmill.entrypoints.cli import main
from tokenmill.errors import ConfigError
from tokenmill.model.config import ModelConfig
from tokenmill.model.source import resolve_model_path

pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""

HUB_ID = "meta-llama/Llama-3.2-1B-Instruct"


@pytest.fixture
def gguf_file(make_model, tmp_path: Path) -> Path:
    folder = make_model("llama", **model_overrides("llama", "Q4_0"))
    return write_gguf(folder, tmp_path / "llama-Q4_0.gguf", "llama", "Q4_0")


def _config_from_metadata(path: Path) -> dict:
    """The config.json tokenmill derived from the GGUF file's metadata."""
    return json.loads((resolve_model_path(str(path)) / "config.json").read_text())


def _write_config(folder: Path, change: Callable[[dict], None], base: dict) -> Path:
    folder.mkdir()
    config = dict(base)
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_given_config_is_the_one_the_engine_runs(gguf_file: Path, tmp_path: Path) -> None:
    from tokenmill import LLM, SamplingParams

    own = _config_from_metadata(gguf_file)
    own_eos = own["eos_token_id"]
    assert own["max_position_embeddings"] != 96

    def change(config: dict) -> None:
        config.update(
            max_position_embeddings=96,
            rope_parameters={"rope_theta": 12345.0, "rope_type": "default"},
            eos_token_id=[*(own_eos if isinstance(own_eos, list) else [own_eos]), 7],
        )

    folder = _write_config(tmp_path / "cfg", change, own)
    llm = LLM(str(gguf_file), hf_config_path=str(folder))
    engine = llm.engine
    assert engine.max_model_len == 96  # the default context length is the config's
    assert engine.model_config.rope_theta == 12345.0
    assert engine.executor.driver_worker.model_config.rope_theta == 12345.0  # the worker's too
    assert 7 in engine.eos_token_ids
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].token_ids  # it runs
    # The config.json file itself names it as well as its folder.
    by_file = ModelConfig.from_folder(
        resolve_model_path(str(gguf_file)), hf_config_path=str(folder / "config.json")
    )
    assert by_file.max_position_embeddings == 96
    # Without the flag, the metadata's config as before.
    plain = ModelConfig.from_folder(resolve_model_path(str(gguf_file)))
    assert plain.max_position_embeddings == own["max_position_embeddings"]


MISMATCHES = {
    "hidden_size": (lambda c: c.update(hidden_size=c["hidden_size"] * 2), "hidden_size is"),
    "layers": (
        lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1),
        "num_hidden_layers is",
    ),
    "tied head": (
        lambda c: c.update(tie_word_embeddings=not c.get("tie_word_embeddings", False)),
        "lays out tensor lm_head.weight",
    ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_config_of_other_weights_is_refused_in_one_line(
    case: str, gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, expected = MISMATCHES[case]
    folder = _write_config(tmp_path / "cfg", change, _config_from_metadata(gguf_file))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_folder(resolve_model_path(str(gguf_file)), hf_config_path=str(folder))
    message = str(info.value)
    assert "\n" not in message and expected in message and "--hf-config-path" in message
    argv = ["serve", str(gguf_file), "--hf-config-path", str(folder)]
    capsys.readouterr()  # the conversion's progress bars
    assert main([*argv, "--port", str(free_port()), "--num-threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: error: --hf-config-path"), err
    assert expected in err[0]


def test_a_hub_id_is_refused_in_one_line(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    argv = ["serve", str(gguf_file), "--hf-config-path", HUB_ID]
    resolve_model_path(str(gguf_file))  # converted first: its progress bars are not the error
    capsys.readouterr()
    assert main([*argv, "--port", str(free_port()), "--num-threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"tokenmill: error: --hf-config-path {HUB_ID}: no such local")
    assert "Hugging Face Hub id" in err[0] and "does not download" in err[0]
    with pytest.raises(ConfigError, match="Hub id"):
        from tokenmill import LLM

        LLM(str(gguf_file), hf_config_path=HUB_ID)
    with pytest.raises(ConfigError, match="no such file or folder"):
        ModelConfig.from_folder(resolve_model_path(str(gguf_file)), hf_config_path="missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"the folder has no config\.json"):
        ModelConfig.from_folder(resolve_model_path(str(gguf_file)), hf_config_path="empty")


def test_an_hf_folder_takes_it_too(make_model, tmp_path: Path) -> None:
    """Not only GGUF files: a model folder's own config.json is replaced the same way."""
    model = make_model("llama")
    own = json.loads((model / "config.json").read_text())
    folder = _write_config(tmp_path / "cfg", lambda c: c.update(max_position_embeddings=77), own)
    assert ModelConfig.from_folder(model, hf_config_path=str(folder)).max_position_embeddings == 77
    bad = _write_config(tmp_path / "bad", lambda c: c.update(vocab_size=c["vocab_size"] + 1), own)
    with pytest.raises(ConfigError, match="vocab_size is"):
        ModelConfig.from_folder(model, hf_config_path=str(bad))
