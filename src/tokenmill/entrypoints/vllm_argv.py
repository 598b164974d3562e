"""vLLM's command-line spellings, rewritten into plain flags before ``serve`` parses them.

vLLM's parser (``FlexibleArgumentParser``) accepts more than argparse does, and copied
command lines use it: ``--max_model_len`` (underscores), ``-O3`` (``--optimization-level 3``),
dotted config keys (``--compilation-config.mode 3``, ``-cc.cudagraph_mode=FULL``, merged
into one JSON object per flag) and ``--config FILE.yaml`` (flags from a YAML mapping, the
command line winning). This module does the same rewriting, so each reaches the flag it
means, which then does what ``vllm_compat`` says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError

_COMMANDS = frozenset({"generate", "serve", "plan", "bench", "verify"})
"""``tokenmill``'s subcommands: the first of these in argv is the command."""
_NAME = re.compile(r"(?<=--)[^.=]*")
"""A long flag's name: between ``--`` and the first ``.`` or ``=``."""


def normalize_serve_argv(argv: list[str]) -> list[str]:
    """``argv`` with the ``serve`` command's vLLM spellings rewritten; other commands untouched."""
    command = next((i for i, a in enumerate(argv) if a in _COMMANDS), None)
    if command is None or argv[command] != "serve":
        return argv
    start = command + 1
    args = _expand_config_file(argv[start:])
    return [*argv[:start], *_merge_dotted(_plain_names(args))]


def _plain_names(args: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and arg != "--":
            out.append(_NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1))
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
        i += 1
    return out


def _merge_dotted(args: list[str]) -> list[str]:
    """``--flag.a.b VALUE`` and ``--flag.c=VALUE`` become ``--flag '{"a": {"b": ..}, "c": ..}'``."""
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not (arg.startswith("-") and "." in name and not _is_number(arg)):
            out.append(arg)
            i += 1
            continue
        if "=" in arg:
            value_text = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(args):
            value_text = args[i + 1]
            i += 2
        else:
            raise ConfigError(f"{arg} needs a value")
        flag, *keys = name.split(".")
        if flag not in merged:
            merged[flag] = {}
        node = merged[flag]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = _json_or_text(value_text)
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out


def _expand_config_file(args: list[str]) -> list[str]:
    """``--config FILE``: the YAML mapping's flags first, so the command line's win."""
    if "--config" not in args:
        return args
    index = args.index("--config")
    if index + 1 >= len(args):
        raise ConfigError("--config needs a YAML file")
    path = Path(args[index + 1])
    rest = args[:index] + args[index + 2 :]
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    given = {a.split("=", 1)[0].replace("_", "-") for a in rest if a.startswith("--")}
    from_file: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in given:
            continue
        if value is True:
            from_file.append(flag)
        elif value is False:
            if _is_negatable(flag):
                from_file.append("--no-" + flag[2:])
        elif isinstance(value, list):
            from_file += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            from_file += [flag, json.dumps(value)]
        else:
            from_file += [flag, str(value)]
    positional = [rest[0]] if rest and not rest[0].startswith("-") else []
    return positional + from_file + rest[len(positional) :]


def _is_negatable(flag: str) -> bool:
    """Whether ``--no-<flag>`` exists: every vLLM on/off flag but the plain store_true ones."""
    from tokenmill.entrypoints.vllm_compat import vllm_flags

    kinds = {f.flag: f.kind for f in vllm_flags()}
    return kinds.get(flag, "bool") != "flag"


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
