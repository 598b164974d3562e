"""The model as resolved once at start-up: its folder, config, tokenizer and stop ids.

The engine, each worker and the server used to read ``config.json``, the tokenizer and the
EOS ids for themselves, and the copies disagreed: a worker process built its grammars'
EOS set without ``generation_config.json``, so a structured-output request stopped on
different tokens under the ``mp`` executor than in one process. ``resolve_model`` does that
work once; the engine hands the result to its executor, which hands it to every worker
(across a process as plain data, ``to_wire``/``from_wire``: the tokenizer is then loaded
again in that process only if something there asks for it, a grammar compiled locally).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.model.config import ModelConfig
from tokenmill.model.host_memory import trim_freed_heap
from tokenmill.model.source import resolve_model_path
from tokenmill.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModel:
    """Everything start-up decides about the model, decided once (immutable)."""

    model_path: Path
    """The model's folder (a GGUF file's converted folder, a packaged model's path)."""
    tokenizer_path: Path
    """Where the tokenizer comes from: ``--tokenizer``, else the model's folder."""
    model_config: ModelConfig
    """``config.json`` read for the chosen implementation (``--model-impl``), overrides applied."""
    eos_token_ids: frozenset[int]
    """Every id that ends generation: ``config.json``'s, ``generation_config.json``'s and the
    tokenizer's EOS token. Requests stop on these and grammars may end on these."""

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer (loaded on first use where the object crossed a process)."""
        return read_tokenizer(self.tokenizer_path)

    @property
    def chat_template(self) -> str | None:
        """The default chat template the tokenizer carries (None: the model has none)."""
        return self.tokenizer.chat_template

    def to_wire(self) -> bytes:
        """Plain data for another process (msgpack; never pickle)."""
        return msgspec.msgpack.encode(
            {
                "model_path": str(self.model_path),
                "tokenizer_path": str(self.tokenizer_path),
                "model_config": self.model_config,
                "eos_token_ids": sorted(self.eos_token_ids),
            }
        )

    @classmethod
    def from_wire(cls, data: bytes) -> ResolvedModel:
        values: dict[str, Any] = msgspec.msgpack.decode(data)
        return cls(
            model_path=Path(values["model_path"]),
            tokenizer_path=Path(values["tokenizer_path"]),
            model_config=msgspec.convert(values["model_config"], ModelConfig),
            eos_token_ids=frozenset(values["eos_token_ids"]),
        )


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of ``path``, with what parsing it freed handed back to the OS.

    Parsing ``tokenizer.json`` builds its whole JSON tree and frees it once the vocabulary
    and merges are built; glibc keeps those holes resident. For Gemma 3's 262,144-entry
    vocabulary (a 33 MB file), 290 MiB resident after the parse, 96 MiB after the trim. A
    process that holds only the tokenizer (the data-parallel front end) kept that for good;
    an engine's load reuses some of the holes and trims at its end, so its peak moved inside
    the noise (Gemma 3 int8: 707-750 MiB before, 713-759 after, three loads each)."""
    tokenizer = Tokenizer.from_pretrained(path)
    trim_freed_heap()
    return tokenizer


def generation_eos_ids(folder: Path) -> set[int]:
    """``generation_config.json``'s EOS ids (none when absent or unreadable)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        logger.warning("ignoring unreadable %s", path)
        return set()
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def resolve_model(config: EngineConfig) -> ResolvedModel:
    """Read the model's folder once: its config (``--hf-config-path``'s where given, the
    test-only RoPE override applied), its tokenizer and the union of its EOS ids."""
    model_path = resolve_model_path(config.model)
    model_config = ModelConfig.from_folder(model_path, config.model_impl, config.hf_config_path)
    if config.rope_theta_override is not None:
        model_config = replace(model_config, rope_theta=config.rope_theta_override)
    tokenizer_path = resolve_model_path(config.tokenizer) if config.tokenizer else model_path
    tokenizer = read_tokenizer(tokenizer_path)
    eos = set(model_config.eos_token_ids) | generation_eos_ids(model_path)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    resolved = ResolvedModel(model_path, tokenizer_path, model_config, frozenset(eos))
    resolved.__dict__["tokenizer"] = tokenizer  # already loaded: the cached property's slot
    return resolved
