"""Flags come from the config dataclasses: every field is a flag whose default and help are the field's."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.cli import build_parser
from tokenmill.entrypoints.config_args import field_docs, flag_name
from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.openai.server import server_config_from_args
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.errors import ConfigError


def _serve(*flags: str):
    return build_parser().parse_args(["serve", "demo", *flags])


def test_defaults_on_the_command_line_are_the_configs() -> None:
    args = _serve()
    engine = engine_config_from_args(args, args.model)
    assert engine == EngineConfig(model="demo")
    server = server_config_from_args(args, engine)
    assert server == ServerConfig(max_num_seqs=engine.max_num_seqs)


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_flag_field_has_help_in_serve_help(
    cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    docs = field_docs(cls)
    not_flags = {"model", "rope_theta_override"} if cls is EngineConfig else {"max_num_seqs"}
    for field in dataclasses.fields(cls):
        if field.name in not_flags:
            continue
        assert docs.get(field.name), f"{cls.__name__}.{field.name} has no docstring"
        assert flag_name(field) in text


def test_flags_map_onto_fields_with_their_types() -> None:
    args = _serve(
        "--kv-cache",
        "static",
        "--kv-cache-memory",
        "2GiB",
        "--compile-batch-sizes",
        "1,2,4",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--served-model-name",
        "a",
        "b",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--max-request-body-bytes",
        "1MiB",
        "--request-timeout",
        "5",
        "--disable-access-log",
    )
    engine = engine_config_from_args(args, args.model)
    assert (engine.kv_cache, engine.kv_cache_memory, engine.compile_batch_sizes) == (
        "static",
        2 * 2**30,
        (1, 2, 4),
    )
    assert not engine.enable_prefix_caching and engine.enforce_eager
    server = server_config_from_args(args, engine)
    assert server.served_model_names == ("a", "b") and server.api_keys == ("k1", "k2")
    assert (
        server.max_request_body_bytes == 2**20
        and server.request_timeout_s == 5.0
        and server.disable_access_log
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port"),
        (["--max-header-count", "2"], "--max-header-count"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_bad_server_values_name_their_flag(flags: list[str], message: str) -> None:
    args = _serve(*flags)
    with pytest.raises(ConfigError, match=message):
        server_config_from_args(args, engine_config_from_args(args, args.model))


@pytest.mark.parametrize(
    ("given", "expected"), [("256MiB", 256 * 2**20), ("2G", 2e9), ("0.3", 0.3), (4096, 4096.0)]
)
def test_kv_cache_memory_in_python_takes_what_the_flag_takes(
    given: object, expected: float
) -> None:
    """``LLM(model, kv_cache_memory="256MiB")`` parses as ``--kv-cache-memory 256MiB`` does."""
    assert EngineConfig(kv_cache_memory=given).kv_cache_memory == expected  # type: ignore[arg-type]
    if isinstance(given, str):
        args = build_parser().parse_args(["serve", "m", "--kv-cache-memory", given])
        assert engine_config_from_args(args, "m").kv_cache_memory == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", [1]])
def test_bad_kv_cache_memory_in_python_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=bad)  # type: ignore[arg-type]
