"""StructuredOutputsParams: what a request's output must match (a JSON schema, a regex, a
choice or a grammar), with vLLM's names.

Pure data, no grammar library: ``SamplingParams`` carries it through ``core`` (which stays
free of torch and of the grammar engine), and ``tokenmill.structured`` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint; ``json`` may be a schema dict or its JSON text."""

    json: dict[str, Any] | str | bool | None = None
    """A JSON schema the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect; ``%json {...}`` embeds a JSON schema)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format: json_object``)."""

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of strings",
                    param="structured_outputs.choice",
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError(
                    "structured_outputs.choice must hold non-empty strings",
                    param="structured_outputs.choice",
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty string",
                    param=f"structured_outputs.{name}",
                )
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                param="structured_outputs.json",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text, canonical for JSON schemas (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            value = self.json
            if isinstance(value, str):
                return value
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.spec)

    @property
    def num_spec_bytes(self) -> int:
        """Size of the constraint's text, checked against the compiler's limit."""
        return len(self.spec.encode("utf-8", "surrogatepass"))
