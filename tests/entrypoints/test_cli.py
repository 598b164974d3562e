"""The ``tokenmill`` parser: version, help with defaults, errors from the right subcommand."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import pytest

from tokenmill.entrypoints.cli import build_parser, main, package_version


def _walk(
    parser: argparse.ArgumentParser, path: str = "tokenmill"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenmill {package_version()}"
    assert package_version()[0].isdigit()


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi", "--bogus"],
        ["verify", "--bogus"],
        ["bench", "serve", "--bogus", "1"],
        ["bench", "compare", "a.json", "--bogus"],
    ],
)
def test_unknown_flag_is_reported_with_the_subcommand_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    command = " ".join(a for a in argv if not a.startswith("-") and a not in ("hi", "1", "a.json"))
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tokenmill {command} ")
    assert f"tokenmill {command}: error: unrecognized arguments: --bogus" in err


def test_every_option_has_help_and_help_shows_defaults() -> None:
    parser = build_parser()
    for path, sub in _walk(parser):
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, (
                    f"{path} {'/'.join(action.option_strings) or action.dest} has no help"
                )
    helps = {path: " ".join(sub.format_help().split()) for path, sub in _walk(parser)}
    assert "most tokens to generate per completion (default: 64)" in helps["tokenmill generate"]
    assert "sampling temperature; 0 is greedy (default: 0.0)" in helps["tokenmill generate"]
    assert "greedy tokens per prompt (EOS ignored) (default: 32)" in helps["tokenmill verify"]
    assert "server root (default: http://127.0.0.1:8000)" in helps["tokenmill bench serve"]
    # No default to show, or the help already explains it: nothing is appended.
    assert "(default: None)" not in " ".join(helps.values())
    assert "(default: False)" not in " ".join(helps.values())


def test_generate_sizes_the_kv_pool_for_its_prompts(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two prompts of at most 64 tokens need 128 KV slots, not 256 sequences' worth."""
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        code = main(["generate", "a", "b", "--max-tokens", "1", "--max-model-len", "64"])
    assert code == 0 and capsys.readouterr().out.count("--- prompt:") == 2
    loaded = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    assert ": 128 tokens in 8 blocks of 16" in loaded
