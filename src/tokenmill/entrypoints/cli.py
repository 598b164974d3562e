"""The ``tokenmill`` command: generate, serve, bench and verify."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling import SamplingParams

    llm = LLM(config=engine_config_from_args(args, args.model))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed, n=args.n,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        for completion in out.outputs:
            print(f"--- prompt: {prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]")
            print(completion.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.openai.server import run_server

    if args.num_threads is None and (os.cpu_count() or 1) > 1:
        # Leave one core to the HTTP event loop: with every core given to torch's OpenMP
        # pool, its threads spin-wait on each other whenever the loop runs (seen in our
        # server tests on 2 cores: 4 x 64 tokens took 8.5-21 s with 2 threads, 0.6 s with 1).
        args.num_threads = (os.cpu_count() or 2) - 1
        logging.getLogger(__name__).info("using %d torch threads (one core left to the server)", args.num_threads)
    return run_server(args, engine_config_from_args(args, args.model))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--model", default="demo", help="Hugging Face model folder, or 'demo'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model", nargs="?", default="demo", help="Hugging Face model folder, or 'demo'")
    add_engine_args(serve)
    try:
        from tokenmill.entrypoints.openai.server import add_server_args
    except ImportError:  # the server module is optional at import time for the other commands
        add_server_args = None
    if add_server_args is not None:
        add_server_args(serve)
    serve.set_defaults(func=_serve)

    try:
        from tokenmill.bench.cli import register as register_bench
    except ImportError:
        register_bench = None
    if register_bench is not None:
        register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error, not a traceback, for expected failures
        from tokenmill.errors import TokenmillError

        if isinstance(exc, TokenmillError):
            print(f"tokenmill: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
