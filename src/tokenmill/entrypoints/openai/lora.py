"""The server's LoRA adapters by name: ``--lora-modules``, and loads/unloads at run time.

Owns the mapping from the name a client puts in ``model`` to a ``LoRARequest`` (with an
id that is never reused, so an adapter unloaded and loaded again under the same name
shares no KV and no cached weights with its predecessor), and parsing ``--lora-modules``
entries in vLLM's two forms: ``name=path`` and ``{"name": .., "path": .., "base_model_name": ..}``.
Only the event loop touches the registry.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from tokenmill.errors import ConfigError, InvalidRequestError
from tokenmill.lora_request import LoRARequest

MAX_LORA_NAME_CHARS = 256


def check_lora_name(name: str, base_names: tuple[str, ...]) -> None:
    """An adapter name is what clients put in ``model``: not empty, not a path (it is shown
    in /v1/models and logs), and never one of the base model's names, which it would shadow.
    InvalidRequestError (param ``lora_name``) otherwise."""

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"lora_name {name!r} {why}", param="lora_name")

    if not name.strip():
        raise bad("must not be empty")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise bad(f"is longer than {MAX_LORA_NAME_CHARS} characters")
    if "/" in name or "\\" in name or set(name) <= {"."} or not name.isprintable():
        raise bad("must be a name, not a path (no '/', '\\', control characters or only dots)")
    if name in base_names:
        raise bad("is the base model's name")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or the JSON object form; ConfigError naming the flag otherwise."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules: invalid JSON {text!r}: {exc}") from None
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ConfigError(
                f"--lora-modules: {text!r} needs string 'name' and 'path' "
                "(and optionally 'base_model_name'), nothing else"
            )
        base = raw.get("base_model_name")
        module = LoRAModule(raw["name"], raw["path"], str(base) if base is not None else None)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ConfigError(f"--lora-modules: empty name or path in {text!r}")
    return module


class LoRARegistry:
    """Adapters clients can name, in the order they were added."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register a name (the caller checked it is free and the adapter loads)."""
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name
