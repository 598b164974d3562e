"""The workload half of ``tokenmill bench``'s command line: dataset flags and tokenizers.

Owns the flags every bench command shares to describe its prompts (dataset, lengths,
counts, seeds), turning them into ``BenchRequest``s, and choosing the tokenizer that
builds them: ``--tokenizer``, a local model folder, the served model's name, or the
server's own ``/tokenize``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokenmill.bench.datasets import (
    DATASET_NAMES,
    BenchRequest,
    Length,
    build_requests,
    parse_length,
)
from tokenmill.bench.tokenization import TokenizerLike, load_tokenizer


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parse_key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["max_num_seqs=16", "enforce_eager=true"]`` into a dict, values parsed as JSON when they can be."""
    result: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            result[key] = json.loads(raw)
        except json.JSONDecodeError:
            result[key] = raw
    return result


def _length_arg(text: str) -> Length:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_workload_args(
    parser: argparse.ArgumentParser, num_prompts: int, has_server: bool = True
) -> None:
    tokenizer_default = (
        "--model, or the served model, if local; else the server's /tokenize"
        if has_server
        else "--model's"
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=DATASET_NAMES, default="random", help="prompt source")
    group.add_argument("--dataset-path", help="file for --dataset sharegpt (JSON) or jsonl")
    group.add_argument("--num-prompts", type=int, default=num_prompts, help="requests to measure")
    group.add_argument(
        "--input-len",
        type=_length_arg,
        default=256,
        help="prompt tokens (random; or a uniform range LOW:HIGH, e.g. 16:1024); "
        "unique suffix tokens (prefix)",
    )
    group.add_argument(
        "--output-len",
        type=_length_arg,
        default=None,
        help="max_tokens of every request (default 128; random also takes LOW:HIGH; "
        "sharegpt keeps each reply's length)",
    )
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths are uniform in len*[1-r, 1+r]",
    )
    group.add_argument(
        "--prefix-len", type=int, default=256, help="shared prefix tokens (--dataset prefix)"
    )
    group.add_argument(
        "--num-prefixes", type=int, default=4, help="distinct shared prefixes (--dataset prefix)"
    )
    group.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    group.add_argument(
        "--tokenizer",
        help=f"local tokenizer folder or tokenizer.json (default: {tokenizer_default})",
    )
    group.add_argument(
        "--vocab-size", type=int, help="token-id range of random prompts when there is no tokenizer"
    )


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len if args.output_len is not None else 128,
        "range_ratio": args.range_ratio,
        "seed": args.seed,
        **(
            {"prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes}
            if args.dataset == "prefix"
            else {}
        ),
    }


def _try_tokenizer(name: str | None, is_required: bool) -> TokenizerLike | None:
    if not name:
        return None
    try:
        return load_tokenizer(name)
    except (FileNotFoundError, OSError, ValueError) as exc:
        if is_required:
            raise
        _log(
            f"[bench] no local tokenizer for {name!r} ({exc}); prompts stay token ids, counts come from usage"
        )
        return None


def _build_workload(
    args: argparse.Namespace, tokenizer: TokenizerLike | None, seed: int | None = None
) -> list[BenchRequest]:
    return build_requests(
        args.dataset,
        args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len if args.output_len is not None else 128,
        range_ratio=args.range_ratio,
        seed=args.seed if seed is None else seed,
        dataset_path=args.dataset_path,
        tokenizer=tokenizer,
        vocab_size=args.vocab_size,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        output_len_is_set=args.output_len is not None,
    )


def _local_tokenizer(name: str) -> tuple[TokenizerLike | None, str]:
    """The local tokenizer of ``name``, or None and why not."""
    try:
        return load_tokenizer(name), ""
    except (FileNotFoundError, OSError, ValueError) as exc:
        return None, str(exc)


def _serve_tokenizer(args: argparse.Namespace, base_url: str) -> tuple[TokenizerLike | None, bool]:
    """The tokenizer the workload is built with, and whether it is the server's.

    In order: ``--tokenizer``; ``--model`` when it resolves locally; the served model's
    name (first of ``/v1/models``) when it resolves locally (e.g. ``demo``); the server's
    ``/tokenize``. The server is asked only when random or prefix prompts have no other
    way to pick token ids (no ``--vocab-size``); other datasets count without one.
    """
    if args.tokenizer:
        return _try_tokenizer(args.tokenizer, is_required=True), False
    from tokenmill.bench.target import RemoteTokenizer, TargetError, first_served_model

    model, why_not = args.model, []
    if model:
        tokenizer, reason = _local_tokenizer(model)
        if tokenizer is not None:
            return tokenizer, False
        why_not.append(reason)
    if args.dataset not in ("random", "prefix") or args.vocab_size is not None:
        if why_not:
            _log(
                f"[bench] no local tokenizer for {model!r} ({why_not[0]}); prompts stay as given, counts come from usage"
            )
        return None, False
    try:
        if not model:
            model = first_served_model(base_url, args.api_key, args.ready_timeout_s)
            tokenizer, reason = _local_tokenizer(model)
            if tokenizer is not None:
                return tokenizer, False
            why_not.append(reason)
        remote = RemoteTokenizer.connect(base_url, model, args.api_key, args.ready_timeout_s)
    except TargetError as exc:
        raise ValueError(
            f"--dataset {args.dataset} needs token ids, and neither a local tokenizer nor the server gave them "
            f"({'; '.join([*why_not, str(exc)])}); pass --tokenizer PATH or --vocab-size N"
        ) from None
    _log(
        f"[bench] no local tokenizer for {model!r}: prompts are tokenized by {remote.root_url}/tokenize"
    )
    return remote, True


def _build_served_workload(
    args: argparse.Namespace, base_url: str
) -> tuple[list[list[BenchRequest]], TokenizerLike | None, dict[str, Any]]:
    """Each round's requests, the tokenizer the run may count with, and the workload's description.

    Round ``k`` draws the dataset with seed ``--seed + k``: prompts of its own, so a prefix
    cache cannot serve it from the round before (a jsonl file has one order, so its rounds
    repeat). The run only gets a local tokenizer: the server's would put blocking HTTP
    calls inside the measured run (and servers report usage anyway).
    """
    if args.num_rounds < 1:
        raise ValueError(f"--num-rounds must be >= 1, got {args.num_rounds}")
    if args.dataset == "jsonl" and args.num_rounds > 1:
        _log(
            "[bench] --dataset jsonl has one order: every round sends the same prompts, "
            "which a prefix cache may serve from the round before"
        )
    tokenizer, is_remote = _serve_tokenizer(args, base_url)
    rounds = [_build_workload(args, tokenizer, seed=args.seed + k) for k in range(args.num_rounds)]
    workload = _workload(args)
    if is_remote:
        tokenizer.close()  # type: ignore[union-attr]
        tokenizer = None
        workload["tokenizer"] = "server /tokenize"
    return rounds, tokenizer, workload
