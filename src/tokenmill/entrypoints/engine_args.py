"""Engine CLI flags: one flag per EngineConfig field, generated from the field (config_args)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.config_args import add_config_args, config_kwargs

_NOT_FLAGS = ("model", "rope_theta_override")
"""The model is a positional argument; the RoPE override is for tests only."""


def add_engine_args(
    parser: argparse.ArgumentParser, group_for: Callable[[str], Any] | None = None
) -> None:
    """Flags shared by every command that builds an engine (``group_for``: vLLM's help groups)."""
    add_config_args(
        parser.add_argument_group("engine"), EngineConfig, exclude=_NOT_FLAGS, group_for=group_for
    )


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Map parsed flags 1:1 onto EngineConfig."""
    return EngineConfig(model=model, **config_kwargs(args, EngineConfig, exclude=_NOT_FLAGS))
