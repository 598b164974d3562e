"""``--generation-config`` and ``--override-generation-config``: the model's default sampling.

As in vLLM, ``auto`` reads the model folder's ``generation_config.json`` and its sampling
fields become the defaults of requests that do not set them; ``vllm`` uses none; a folder
reads that folder's file. The override JSON is merged over what was read. ``max_new_tokens``
caps ``max_tokens``: the engine takes the smallest of the request's, the context left and
it (``engine/request_limits.py``, as vLLM does), from the request's ``RequestCaps``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

from tokenmill.entrypoints.openai.protocol import RequestBody, SamplingFields, StreamOptions
from tokenmill.errors import ConfigError

BodyT = TypeVar("BodyT", bound=RequestBody)

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""generation_config.json fields that become request defaults (vLLM's list), besides max_new_tokens."""


def load_generation_defaults(
    mode: str, model_folder: Path, overrides: dict[str, Any] | None
) -> dict[str, Any]:
    """Request-field defaults (``temperature``... and ``max_tokens``) from the chosen config."""
    config: dict[str, Any] = {}
    if mode != "vllm":
        folder = model_folder if mode == "auto" else Path(mode)
        path = folder / GENERATION_CONFIG_FILE
        if mode != "auto" and not path.is_file():
            raise ConfigError(f"--generation-config {mode}: no {GENERATION_CONFIG_FILE} there")
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{path}: not a readable JSON file ({exc})") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{path}: not a JSON object")
    config = {**config, **(overrides or {})}
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = config["max_new_tokens"]
    for name, value in defaults.items():
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (name in ("top_k", "max_tokens") and not isinstance(value, int)):
            raise ConfigError(f"generation config: {name} must be a number, got {value!r}")
    if defaults:
        logger.info(
            "default sampling parameters from the generation config (%s): %s; "
            "--generation-config vllm turns them off",
            "overrides" if mode == "vllm" else mode,
            defaults,
        )
    return defaults


def with_generation_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A request body with the defaults under the fields it leaves unset (or null)."""
    values = {k: v for k, v in defaults.items() if k != "max_tokens" and data.get(k) is None}
    return {**data, **values} if values else data


def with_server_defaults(body: BodyT, force_include_usage: bool) -> BodyT:
    """A validated body with, under ``--enable-force-include-usage``, a stream's usage chunk
    asked for. Bodies that sample nothing (embeddings, pooling) pass through."""
    if not isinstance(body, SamplingFields):
        return body
    if force_include_usage and body.stream and not body.include_usage:
        options = body.stream_options or StreamOptions()
        update = {"stream_options": options.model_copy(update={"include_usage": True})}
        return body.model_copy(update=update)
    return body
