"""vLLM's command-line spellings reach the flags they mean: underscores, -O3, dotted keys, --config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import build_parser, main
from tokenmill.entrypoints.vllm_argv import normalize_serve_argv
from tokenmill.entrypoints.vllm_compat import check_vllm_compat_args


def _parse(*argv: str):
    return build_parser().parse_args(normalize_serve_argv(["serve", *argv]))


def test_underscores_in_flag_names_are_dashes() -> None:
    args = _parse("demo", "--max_model_len", "128", "--max_num_seqs=3", "--enable_prefix_caching")
    assert (args.max_model_len, args.max_num_seqs, args.enable_prefix_caching) == (128, 3, True)
    assert _parse("--chat-template", "a_b.jinja").chat_template == "a_b.jinja"  # values untouched


def test_optimization_level_shorthand_is_known_and_ignored() -> None:
    for argv in (["-O3"], ["-O", "3"], ["-O=3"]):
        assert normalize_serve_argv(["serve", *argv]) == ["serve", "--optimization-level", "3"]
    warnings: list[str] = []
    check_vllm_compat_args(_parse("-O3"), warn=warnings.append)
    assert warnings == [
        "--optimization-level is ignored: a CUDA compilation level; see --enforce-eager"
    ]


def test_dotted_config_keys_merge_into_one_json_object() -> None:
    argv = normalize_serve_argv(
        [
            "serve",
            "--compilation-config.mode",
            "3",
            "--compilation-config.cudagraph_mode=FULL",
            "-x",
        ]
    )
    assert argv[:2] == ["serve", "-x"] and argv[2] == "--compilation-config"
    assert json.loads(argv[3]) == {"mode": 3, "cudagraph_mode": "FULL"}
    warnings: list[str] = []
    check_vllm_compat_args(_parse("-cc.mode=3"), warn=warnings.append)
    assert warnings and warnings[0].startswith("--compilation-config is ignored")
    assert normalize_serve_argv(["serve", "--temperature", "-0.5"]) == [
        "serve",
        "--temperature",
        "-0.5",
    ]  # a negative number is a value, not a dotted flag


def test_config_file_gives_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "max_num_seqs: 4\nmax-model-len: 256\nenable_prefix_caching: false\n"
        "served_model_name: [a, b]\nheadless: false\nport: 9000\n"
    )
    args = _parse("demo", "--config", str(config), "--port", "8123")
    assert (args.model, args.max_num_seqs, args.max_model_len) == ("demo", 4, 256)
    assert args.enable_prefix_caching is False and args.served_model_names == ["a", "b"]
    assert args.port == 8123


def test_a_bad_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: error: --config ")


def test_only_the_serve_command_is_rewritten() -> None:
    for argv in (["bench", "serve", "--max_concurrency", "2"], ["generate", "serve", "--x_y"]):
        assert normalize_serve_argv(argv) == argv
    assert normalize_serve_argv(["--log-level", "info", "serve", "--max_num_seqs", "2"]) == [
        "--log-level",
        "info",
        "serve",
        "--max-num-seqs",
        "2",
    ]
