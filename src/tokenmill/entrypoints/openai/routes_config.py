"""The routes file (``--routes-config routes.yaml``): its schema, and loading it with errors
that name the line and the field.

Owns what a valid routes file is. It is read once at start-up, before the model loads, and
any problem (YAML syntax, a duplicate key, an unknown field, a negative quota, two routes
claiming the same API key, model or header value) stops the server with one message of the
form ``routes.yaml:12: routes[1].quotas.input_tokens_per_minute: ...``. What each field
means at request time is in ``routes.py`` and docs/routes.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from tokenmill.errors import ConfigError

ROUTE_HEADER = "x-tokenmill-route"
"""The request header that selects a route by one of its ``match.headers`` values."""

QUOTA_WINDOW_S = 60.0
"""Tokens-per-minute quotas count the tokens of the last minute (a sliding window)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RouteMatch(_Strict):
    """What selects the route: any listed API key, served model name or header value."""

    api_keys: list[str] = []
    """Requests authenticated with one of these keys (each must also be an ``--api-key``)."""
    models: list[str] = []
    """Requests whose ``model`` is one of these served model names."""
    headers: list[str] = []
    """Requests sending ``X-Tokenmill-Route: <value>`` with one of these values."""

    @model_validator(mode="after")
    def _some_selector(self) -> RouteMatch:
        if not (self.api_keys or self.models or self.headers):
            raise ValueError("give at least one of api_keys, models or headers")
        return self


class RouteFeatures(_Strict):
    """Which expensive request features the route allows (all by default)."""

    logprobs: bool = True
    """``logprobs``, ``top_logprobs`` and ``prompt_logprobs``."""
    max_n: int | None = Field(default=None, ge=1)
    """Largest ``n`` (and ``best_of``); default: no route limit."""
    beam_search: bool = True
    """``use_beam_search`` requests."""


class RouteQuotas(_Strict):
    """Limits per API key within the route (all keys share one bucket without auth)."""

    max_concurrent_requests: int | None = Field(default=None, ge=1)
    input_tokens_per_minute: int | None = Field(default=None, ge=1)
    """Prompt tokens admitted in the last 60 s."""
    output_tokens_per_minute: int | None = Field(default=None, ge=1)
    """Generated tokens of requests that ended in the last 60 s."""


class SamplingDefaults(_Strict):
    """Sampling fields a request of the route gets when it does not send them."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None

    def as_body_fields(self) -> dict[str, Any]:
        """The defaults as request-body fields."""
        return self.model_dump(exclude_none=True)


class Route(_Strict):
    """One route: how requests are selected, and the limits they then run under."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    match: RouteMatch
    max_model_len: int | None = Field(default=None, ge=2)
    """Prompt plus output tokens: a request whose prompt plus ``max_tokens`` exceed it is
    refused (400), one without ``max_tokens`` may use what the prompt leaves."""
    max_input_tokens: int | None = Field(default=None, ge=1)
    """Longest prompt (400 beyond it)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Cap on ``max_tokens``: the default when a request sends none (within the context the
    prompt leaves), 400 above it."""
    defaults: SamplingDefaults = SamplingDefaults()
    features: RouteFeatures = RouteFeatures()
    priority: int | None = Field(default=None, ge=-(2**31) + 1, le=2**31 - 1)
    """The priority every request of the route runs at (needs --scheduling-policy priority)."""
    queue: Literal["standard", "beam"] = "standard"
    """Which engine queue the route's requests join (``beam``: the beam-search queue)."""
    max_in_flight: int | None = Field(default=None, ge=1)
    """The route's own queue bound: sequences (prompts x n) admitted at once, running or waiting."""
    quotas: RouteQuotas = RouteQuotas()


class RoutesConfig(_Strict):
    """The whole routes file."""

    routes: list[Route] = Field(min_length=1)
    _source: str = PrivateAttr(default="routes.yaml")
    _root: Any = PrivateAttr(default=None)

    def where(self, *loc: str | int) -> str:
        """``routes.yaml:12: routes[1].match.models[0]``: how errors found later name a field."""
        return f"{self._source}:{_line_of(self._root, loc)}: {_loc_text(loc)}"


# ---- loading, with line numbers ------------------------------------------------------------
def _mask(key: str) -> str:
    """An API key as it may appear in an error: its first 4 characters."""
    return f"{key[:4]}…" if len(key) > 4 else "…"


def _loc_text(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the node at ``loc`` (its key's line for mappings), or its nearest parent's."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((kv for kv in node.value if kv[0].value == str(part)), None)
            if match is None:
                return line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _check_duplicate_keys(node: yaml.Node | None, source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.value in seen:
                raise ConfigError(
                    f"{source}:{line}: duplicate key {key.value!r} (first on line {seen[key.value]})"
                )
            seen[key.value] = line
            _check_duplicate_keys(value, source)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(item, source)


def _check_overlaps(config: RoutesConfig, root: yaml.Node | None, source: str) -> None:
    """Each route name, API key, model and header value belongs to one route only."""
    names: dict[str, int] = {}
    owners: dict[tuple[str, str], tuple[str, int | None]] = {}
    for i, route in enumerate(config.routes):
        if route.name in names:
            line = _line_of(root, ("routes", i, "name"))
            raise ConfigError(
                f"{source}:{line}: routes[{i}].name: route name {route.name!r} is used twice "
                f"(first by routes[{names[route.name]}])"
            )
        names[route.name] = i
        for field in ("api_keys", "models", "headers"):
            for j, value in enumerate(getattr(route.match, field)):
                line = _line_of(root, ("routes", i, "match", field, j))
                other = owners.get((field, value))
                if other is not None:
                    shown = _mask(value) if field == "api_keys" else repr(value)
                    where = "again" if other[0] == route.name else f"by route {other[0]!r}"
                    raise ConfigError(
                        f"{source}:{line}: routes[{i}].match.{field}[{j}]: {shown} is already "
                        f"selected {where} (line {other[1]}); selectors must not overlap, so "
                        "every request selects one route"
                    )
                owners[(field, value)] = (route.name, line)


def parse_routes(text: str, source: str = "routes.yaml") -> RoutesConfig:
    """A validated RoutesConfig from YAML text; ConfigError naming the line and field otherwise."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            _check_duplicate_keys(root, source)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f"{mark.line + 1}" if mark is not None else "?"
        raise ConfigError(f"{source}:{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: expected a mapping with a 'routes' list")
    try:
        config = RoutesConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        loc = tuple(
            p for p in first["loc"] if not (isinstance(p, str) and re.fullmatch(r"[a-z-]+\[.*", p))
        )
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        if first["type"] == "missing":
            message = "required field is missing"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(
            f"{source}:{_line_of(root, loc)}: {_loc_text(loc)}: {message}{more}"
        ) from None
    _check_overlaps(config, root, source)
    config._source, config._root = source, root
    return config


def load_routes(path: str | Path) -> RoutesConfig:
    """Read and validate a routes file (ConfigError, naming the file, if it cannot be read)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--routes-config {path}: cannot read it ({exc})") from None
    return parse_routes(text, str(path))
