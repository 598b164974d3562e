"""CLI flags generated from config dataclasses: name, type, default and help in one place.

Each field of ``EngineConfig`` and ``ServerConfig`` becomes one flag: ``--field-name`` (or
the vLLM name its ``flag`` metadata gives), its type and choices from the annotation, its
default from the field, and its help from the docstring under the field, read from the
class source with ``ast`` as vLLM does. So a default is written once, and ``--help`` can
never disagree with the config. Field metadata may also name a ``parse`` function (e.g.
memory sizes), an ``action`` (``append`` for repeatable flags) and ``aliases`` (other
spellings, e.g. vLLM's ``--device-memory-utilization``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from tokenmill.sizes import parse_size


def parse_memory(text: str) -> float:
    """``0.3`` (fraction of free memory), ``4GiB``, ``512MiB``, ``2G`` or plain bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_int_list(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def parse_bytes(text: str) -> int:
    """A size in bytes: ``10MiB``, ``16KiB``, ``1000``."""
    return int(parse_memory(text))


DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other spellings of ``--dtype`` values."""


def parse_dtype(text: str) -> str:
    """A ``--dtype`` name; vLLM's ``half`` and ``float`` become float16 and float32."""
    return DTYPE_ALIASES.get(text, text)


_HUMAN_INT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)\s*")


def parse_max_model_len(text: str) -> int | None:
    """vLLM's ``--max-model-len``: ``4096``, ``32k`` (32000), ``32K`` (32768), ``1m``, ``auto``
    or ``-1`` (the model's own length)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    match = _HUMAN_INT.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid length {text!r}: use a number of tokens like 4096, 32k, 32K or auto"
        )
    number, suffix = match.groups()
    power = "kmgt".find(suffix.lower()) + 1 if suffix else 0
    value = float(number) * ((1024 if suffix.isupper() else 1000) ** power)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"invalid length {text!r}: a whole number of tokens >= 1")
    return int(value)


def parse_json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take: ``'["*"]'``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object: ``'{"temperature": 0.6}'``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


PARSERS: dict[str, Callable[[str], Any]] = {
    "json_list": parse_json_list,
    "json_object": parse_json_object,
    "memory": parse_memory,
    "bytes": parse_bytes,
    "int_list": parse_int_list,
    "dtype": parse_dtype,
    "max_model_len": parse_max_model_len,
}
"""Parsers a field's ``parse`` metadata may name."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, joined onto one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            text = str(after.value.value).replace("``", "")
            docs[node.target.id] = " ".join(text.split())
    return docs


def flag_name(field: dataclasses.Field[Any]) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def add_config_args(
    group: Any,
    cls: type,
    exclude: Iterable[str] = (),
    group_for: Callable[[str], Any] | None = None,
) -> None:
    """One flag per field of ``cls`` (except ``exclude``), with ``dest`` the field's name.

    ``group_for(flag)`` may name the help group a flag belongs in (vLLM's grouping); a
    None answer, or no ``group_for``, puts it in ``group``."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        kwargs: dict[str, Any] = {"dest": field.name, "help": docs.get(field.name, "")}
        default = field.default
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        kind = _unwrap_optional(hints[field.name])
        if "parse" in field.metadata:
            kwargs["type"] = PARSERS[field.metadata["parse"]]
            if typing.get_origin(kind) is typing.Literal:  # parsed, then checked against choices
                kwargs["choices"] = list(typing.get_args(kind))
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif typing.get_origin(kind) is tuple:
            item = typing.get_args(kind)[0]
            kwargs["type"] = parse_int_list if item is int else item
            if item is not int:
                kwargs["nargs"] = "+"
        elif kind in (int, float, str):
            kwargs["type"] = kind
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag type for {kind!r}")
        if field.metadata.get("action") == "append":
            kwargs.pop("nargs", None)
            kwargs["action"] = "append"
            default = (
                None  # argparse appends to a default list; an empty one is the field's default
            )
        name = flag_name(field)
        if "choices" not in kwargs and kwargs.get("action") is not argparse.BooleanOptionalAction:
            kwargs["metavar"] = name.removeprefix("--").replace("-", "_").upper()
        target = (group_for(name) if group_for is not None else None) or group
        aliases = field.metadata.get("aliases", ())
        target.add_argument(name, *aliases, default=default, **kwargs)


def config_kwargs(
    args: argparse.Namespace, cls: type, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """The fields of ``cls`` as parsed into ``args`` by ``add_config_args``."""
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in exclude or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if field.metadata.get("action") == "append":
            value = tuple(value or ())
        elif isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    return values


def _unwrap_optional(hint: Any) -> Any:
    """``X | None`` -> X; anything else as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
