"""Command-line front of the measurement tools: ``tokenmill bench {serve,offline,compare}``
and ``tokenmill verify``.

Owns the flags (vLLM's ``bench serve`` names where one exists), turning them into the
configs of ``serve``, ``offline``, ``compare``/``report`` and ``verify``, and the exit
codes: 0 on success, 1 when ``verify`` fails or every request of a run failed, 2 for
bad input. ``register`` is called by ``tokenmill.entrypoints.cli`` to add the parsers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from tokenmill.bench import MissingExtraError
from tokenmill.bench.cli_workload import (
    _add_workload_args,
    _build_served_workload,
    _build_workload,
    _log,
    _parse_key_values,
    _try_tokenizer,
    _workload,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


# ---- bench serve -----------------------------------------------------------------------
def _add_serve_target_args(parser: argparse.ArgumentParser, with_base_url: bool) -> None:
    group = parser.add_argument_group("target")
    if with_base_url:
        group.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server root")
    group.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
        help="API to load (chat sends text prompts)",
    )
    group.add_argument("--model", help="model name in requests (default: the first of /v1/models)")
    group.add_argument("--api-key", help="bearer token")
    group.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="completions prompts as token ids or text (auto: ids if the server takes them)",
    )
    group.add_argument("--extra-body", help="JSON object merged into every request body")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="mean req/s; inf sends all at once"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson"
    )
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument(
        "--num-warmups",
        type=int,
        default=None,
        help="uncounted requests after the probe (default: one per concurrent request, "
        "2 to 16); 0 measures a cold server, which bench compare will not pick a winner from",
    )
    load.add_argument(
        "--num-rounds",
        type=int,
        default=1,
        help="measured runs, each with prompts of its own (seed, seed+1, ...); "
        "bench compare only calls a difference when it exceeds their spread",
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS (fixed output lengths)",
    )
    load.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of every request"
    )
    load.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="deadline of one request, send to last chunk; past it the request fails",
    )
    load.add_argument(
        "--ready-timeout-s",
        type=float,
        default=120.0,
        help="how long to wait for a starting server (connection refused or 503)",
    )
    load.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50"
    )
    load.add_argument(
        "--no-server-metrics", action="store_true", help="do not poll the target's /metrics"
    )
    load.add_argument(
        "--metrics-interval-s",
        type=float,
        default=5.0,
        help="seconds between /metrics polls during the run; each poll costs the target CPU "
        "time (at 0.5 s, +12%% one-stream TPOT on 2 cores); counter deltas are exact at any "
        "interval",
    )
    load.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _serve_config(
    args: argparse.Namespace, base_url: str, label: str | None, max_concurrency: int | None
) -> Any:
    from tokenmill.bench.metrics import parse_goodput
    from tokenmill.bench.serve import ServeConfig

    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ServeConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=max_concurrency,
        num_warmups=args.num_warmups,
        prompt_format=args.prompt_format,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout_s,
        ready_timeout_s=args.ready_timeout_s,
        seed=args.seed,
        goodput_slos_ms=parse_goodput(args.goodput),
        scrape_metrics=not args.no_server_metrics,
        metrics_interval_s=args.metrics_interval_s,
        show_progress=not args.no_progress,
        label=label,
        extra_body=extra,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """``tokenmill bench serve``."""
    from tokenmill.bench.serve import format_summary, run_serve_benchmark, save_result

    rounds, tokenizer, workload = _build_served_workload(args, args.base_url)
    config = _serve_config(args, args.base_url, args.label, args.max_concurrency)
    metadata = _parse_key_values(args.metadata, "--metadata")
    result = run_serve_benchmark(config, rounds[0], tokenizer, workload, rounds[1:])
    if metadata:
        result["metadata"] = metadata
    print(format_summary(result))
    if args.save_result:
        _log(f"[bench serve] saved {save_result(result, args.save_result)}")
    return 1 if result["completed"] == 0 else 0


# ---- bench offline ---------------------------------------------------------------------
def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _offline_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-arg`` pairs, plus ``compile_batch_sizes`` from its own flag."""
    engine_kwargs = _parse_key_values(args.engine_arg, "--engine-arg")
    if args.compile_batch_sizes:
        try:
            sizes = tuple(int(b) for b in _comma_list(args.compile_batch_sizes))
        except ValueError:
            raise ValueError(
                f"--compile-batch-sizes expects integers like 1,2,4,8, got {args.compile_batch_sizes!r}"
            ) from None
        engine_kwargs["compile_batch_sizes"] = sizes
    return engine_kwargs


def cmd_offline(args: argparse.Namespace) -> int:
    """``tokenmill bench offline``."""
    from tokenmill.bench.offline import OfflineConfig, format_offline_table, run_offline_benchmark
    from tokenmill.bench.serve import save_result

    engine_dtype = None
    if args.dtype == "auto":
        from tokenmill.bench.verify import served_dtype

        args.dtype, engine_dtype = served_dtype(args.model, "auto", args.device), "auto"
        _log(f"[bench offline] --dtype auto is {args.dtype} here, as `serve` would run it")
    config = OfflineConfig(
        model=args.model,
        backends=_comma_list(args.backends),
        kv_caches=_comma_list(args.kv_cache),
        dtype=args.dtype,
        engine_dtype=engine_dtype,
        device=args.device,
        batch_size=args.batch_size,
        ignore_eos=args.ignore_eos,
        compare=args.compare,
        num_rounds=args.num_rounds or (3 if args.compare else 1),
        num_warmups=args.num_warmups,
        seed=args.seed,
        engine_kwargs=_offline_engine_kwargs(args),
    )
    tokenizer = _try_tokenizer(args.tokenizer or args.model, is_required=False)
    requests = _build_workload(args, tokenizer)
    result = run_offline_benchmark(config, requests, _workload(args), log=_log, tokenizer=tokenizer)
    print(format_offline_table(result))
    if args.save_result:
        _log(f"[bench offline] saved {save_result(result, args.save_result)}")
    return 0


# ---- bench compare ---------------------------------------------------------------------
_OFFLINE_RUN_KEYS = ("model", "dtype", "device", "batch_size", "engine_kwargs", "workload")
"""Settings of an offline file that every one of its rows ran with."""


def _named_results_from_files(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``[NAME=]FILE`` specs as (target name, result); an offline file gives one per row.

    A name given is kept; results named by their own label that share it but not their
    config are told apart by what differs (``name_by_config``), e.g. ``demo[static]``.
    """
    from tokenmill.bench.results import load_result, name_by_config

    loaded: list[tuple[str, dict[str, Any], bool]] = []  # name, result, is the name given
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or (not Path(path).exists() and Path(spec).exists()):
            name, path = "", spec
        if not Path(path).is_file():
            raise FileNotFoundError(f"result file {path!r} not found")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("kind") == "offline":
            run = {k: data[k] for k in _OFFLINE_RUN_KEYS if k in data}
            for row in data.get("backends", []):
                if not row.get("skipped"):
                    row_name = f"{name}/{row['label']}" if name else row["label"]
                    loaded.append((row_name, {**run, **row, "source": path}, bool(name)))
            continue
        result = load_result(path)
        loaded.append((name or result["label"], result, bool(name)))
    renamed = iter(name_by_config([(n, r) for n, r, is_given in loaded if not is_given]))
    return [(n, r) if is_given else next(renamed) for n, r, is_given in loaded]


def _run_targets(args: argparse.Namespace, out_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    from tokenmill.bench.serve import format_summary, run_serve_benchmark, save_result

    targets = []
    for spec in args.target:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--target expects NAME=URL, got {spec!r}")
        targets.append((name, url))
    levels: list[int | None] = (
        [int(c) for c in args.concurrency.split(",") if c.strip()]
        if args.concurrency
        else [args.max_concurrency]
    )
    rounds, tokenizer, workload = _build_served_workload(args, targets[0][1])
    named = []
    for name, url in targets:
        for level in levels:
            _log(f"[bench compare] {name} at max concurrency {level or 'unbounded'}")
            config = _serve_config(args, url, name, level)
            result = run_serve_benchmark(config, rounds[0], tokenizer, workload, rounds[1:])
            print(format_summary(result))
            save_result(result, out_dir / "results" / f"{name}_c{level or 'inf'}.json")
            named.append((name, result))
    return named


def cmd_compare(args: argparse.Namespace) -> int:
    """``tokenmill bench compare``."""
    from tokenmill.bench.compare import build_comparison, format_comparison
    from tokenmill.bench.report import write_report
    from tokenmill.bench.sla import parse_sla

    if not args.results and not args.target:
        raise ValueError("give result files (NAME=FILE or FILE) or --target NAME=URL endpoints")
    sla = parse_sla(args.sla)
    out_dir = Path(args.output_dir)
    named = _named_results_from_files(args.results or [])
    if args.target:
        named += _run_targets(args, out_dir)
    comparison = build_comparison(
        named, baseline=args.baseline, sla=sla, allow_cold=args.allow_cold
    )
    print(format_comparison(comparison))
    files = write_report(comparison, out_dir)
    _log(f"[bench compare] wrote {files['html']} and {len(files) - 1} plots in {out_dir}")
    return 0


# ---- verify ----------------------------------------------------------------------------
def _read_prompt_texts(path: str | None) -> list[str] | None:
    if not path:
        return None
    texts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            texts.append(item if isinstance(item, str) else item.get("prompt", item.get("text")))
    return texts


def cmd_verify(args: argparse.Namespace) -> int:
    """``tokenmill verify``."""
    from tokenmill.bench.tokenization import load_tokenizer
    from tokenmill.bench.verify import (
        format_verify_report,
        run_verify,
        save_verify_report,
        served_dtype,
    )

    if args.dtype == "auto" and args.server_url:
        args.dtype = "float32"  # the reference; the server runs whatever it was started with
    elif args.dtype == "auto":
        args.dtype = served_dtype(args.model or "demo", "auto", args.device)
        args.engine_dtype = "auto"  # a GGUF file's blocks then run as in `serve`
        _log(f"[verify] tokenmill runs as `serve` would here: --dtype auto is {args.dtype}")
    if args.quantization or args.kv_cache_dtype or args.dtype != "float32":
        # Reduced precision is judged on distributions: exact greedy text is no fair test.
        return _verify_precision(args)
    min_match = args.min_match if args.min_match is not None else 1.0
    # A --model given names the served model too (vLLM serves a folder under its path);
    # without one the reference runs demo and the server is asked what it serves.
    served_model = args.served_model_name or args.model
    report = run_verify(
        args.model or "demo",
        max_tokens=args.max_tokens,
        texts=_read_prompt_texts(args.prompts_file),
        num_prompts=args.num_prompts,
        dtype=args.dtype,
        device=args.device,
        server_url=args.server_url,
        server_model=served_model,
        api_key=args.api_key,
        min_match=min_match,
        engine_kwargs=_parse_key_values(args.engine_arg, "--engine-arg"),
    )
    decode = None
    if not report.passed:  # the text beside the ids of each mismatch, where a tokenizer loads
        try:
            tokenizer = load_tokenizer(args.model or "demo")
            decode = lambda ids: str(tokenizer.decode(ids))  # noqa: E731
        except Exception as exc:  # only for display: the report stands without it
            _log(f"[verify] no tokenizer to show the text ({exc})")
    print(format_verify_report(report, decode=decode))
    if args.save_result:
        save_verify_report(report, args.save_result)
    return 0 if report.passed else 1


def _verify_precision(args: argparse.Namespace) -> int:
    """``tokenmill verify --quantization/--kv-cache-dtype``: distributions against fp32."""
    from tokenmill.bench.verify import format_precision_report, run_precision_check

    engine_kwargs = {
        "dtype": getattr(args, "engine_dtype", args.dtype),  # the resolved one is in the report
        "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size,
        "kv_cache_dtype": args.kv_cache_dtype or "auto",
        **_parse_key_values(args.engine_arg, "--engine-arg"),
    }
    if args.server_url:
        raise ValueError(
            "--quantization/--kv-cache-dtype are checked in-process; drop --server-url"
        )
    report = run_precision_check(
        args.model or "demo",
        engine_kwargs,
        max_tokens=args.max_tokens,
        texts=_read_prompt_texts(args.prompts_file),
        num_prompts=args.num_prompts,
        device=args.device,
        min_top1=args.min_match if args.min_match is not None else DEFAULT_MIN_TOP1,
    )
    print(format_precision_report(report))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.passed else 1


DEFAULT_MIN_TOP1 = 0.9
"""Required top-1 agreement with fp32 for ``verify --quantization`` (see docs/benchmarks.md)."""


# ---- registration ----------------------------------------------------------------------
CLIENT_LIBRARY_LOGGERS = ("httpx", "httpcore", "urllib3", "openai", "anthropic")
"""Libraries that log a line per HTTP request at INFO: a benchmark's thousands of requests
would bury its report."""


def quiet_client_libraries() -> None:
    """Keep the HTTP client libraries' INFO lines out of the benchmark's output (warnings stay)."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return  # --log-level debug asked for everything
    for name in CLIENT_LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        if library.getEffectiveLevel() < logging.WARNING:
            library.setLevel(logging.WARNING)


def _guard(func: Any) -> Any:
    """Turn expected user errors into a one-line message and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        quiet_client_libraries()
        try:
            return func(args)
        except (
            MissingExtraError,
            ValueError,
            FileNotFoundError,
            RuntimeError,
        ) as exc:  # BenchmarkError too
            _log(f"error: {exc}")
            return 2

    run.__doc__ = func.__doc__
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` (serve, offline, compare) and ``verify`` to the tokenmill CLI."""
    bench = subparsers.add_parser(
        "bench", help="measure serving and offline performance, compare backends"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bench_sub.add_parser("serve", help="load-test any OpenAI-compatible endpoint")
    _add_serve_target_args(serve, with_base_url=True)
    _add_workload_args(serve, num_prompts=200)
    serve.add_argument("--label", help="name of this target in reports (default: model name)")
    serve.add_argument(
        "--metadata",
        nargs="+",
        metavar="KEY=VALUE",
        help="settings of the target saved in the result, e.g. kv_cache=static; "
        "bench compare names unlabelled targets by the ones that differ",
    )
    serve.add_argument(
        "--save-result", metavar="FILE.json", help="write the summary and every request's timings"
    )
    serve.set_defaults(func=_guard(cmd_serve))

    offline = bench_sub.add_parser(
        "offline", help="in-process throughput and latency, without HTTP"
    )
    offline.add_argument("--model", default="demo", help="local model folder, or 'demo'")
    offline.add_argument(
        "--backends",
        default="tokenmill,transformers",
        help="comma list of tokenmill, transformers, transformers-cb (first is the baseline)",
    )
    offline.add_argument(
        "--kv-cache",
        default="paged",
        help="tokenmill's KV strategies, comma list of paged, static (one tokenmill row each)",
    )
    offline.add_argument(
        "--compile-batch-sizes",
        metavar="N,N,...",
        help="decode batch sizes tokenmill compiles for the static strategy, e.g. 1,2,4,8",
    )
    offline.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights dtype of every backend (auto: what `serve` runs here; the CPU dtype rule)",
    )
    offline.add_argument("--device", default="auto", help="cpu, cuda or auto")
    offline.add_argument(
        "--batch-size", type=int, default=8, help="static batch size of the transformers backend"
    )
    offline.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate full output lengths so backends do equal work (default on)",
    )
    offline.add_argument(
        "--compare", action="store_true", help="interleave backends over several rounds"
    )
    offline.add_argument(
        "--num-rounds",
        type=int,
        help="measured runs of each backend (default: 3 with --compare, else 1); "
        "bench compare only calls a difference when it exceeds their spread",
    )
    offline.add_argument(
        "--num-warmups",
        type=int,
        default=2,
        help="uncounted requests per backend (prompts of their own, shaped like the measured ones)",
    )
    offline.add_argument(
        "--engine-arg", action="append", metavar="KEY=VALUE", help="extra tokenmill LLM(...) kwarg"
    )
    offline.add_argument("--save-result", metavar="FILE.json", help="write every backend's summary")
    _add_workload_args(offline, num_prompts=32, has_server=False)
    offline.set_defaults(func=_guard(cmd_offline))

    compare = bench_sub.add_parser(
        "compare", help="side-by-side report of results or endpoints, with an SLA verdict"
    )
    compare.add_argument(
        "results", nargs="*", metavar="[NAME=]FILE", help="result JSON files (serve or offline)"
    )
    compare.add_argument(
        "--target", action="append", metavar="NAME=URL", help="endpoint to benchmark (repeatable)"
    )
    compare.add_argument(
        "--concurrency", help="sweep of max concurrency for --target runs, e.g. 1,4,16,64"
    )
    compare.add_argument("--baseline", help="target the ratios are against (default: the first)")
    compare.add_argument("--sla", help="latency limits, e.g. ttft_p95_ms=800,tpot_p95_ms=50")
    compare.add_argument(
        "--output-dir", default="bench-report", help="where report.html and the PNGs go"
    )
    compare.add_argument(
        "--allow-cold",
        action="store_true",
        help="call a winner even from results measured without warm-ups (--num-warmups 0)",
    )
    _add_serve_target_args(compare, with_base_url=False)
    _add_workload_args(compare, num_prompts=100)
    compare.set_defaults(func=_guard(cmd_compare))

    verify = subparsers.add_parser(
        "verify", help="check tokenmill's greedy tokens against transformers"
    )
    verify.add_argument(
        "--model", help="local model folder the reference runs, or 'demo' (default: demo)"
    )
    verify.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per prompt (EOS ignored)"
    )
    verify.add_argument("--num-prompts", type=int, help="repeat the prompts up to this many")
    verify.add_argument("--prompts-file", help='JSONL of prompts (strings or {"prompt": ...})')
    verify.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="tokenmill's weights dtype (auto: what `serve` runs here; see the CPU dtype rule). "
        "float32 is checked token for token against transformers; a reduced precision by "
        "teacher-forced top-1 agreement and KL against float32 transformers",
    )
    verify.add_argument("--device", default="cpu", help="torch device of both sides (cpu or cuda)")
    verify.add_argument(
        "--server-url", help="verify a running server instead of in-process tokenmill"
    )
    verify.add_argument(
        "--served-model-name",
        help="model name the server expects (default: --model if given, else the first of /v1/models)",
    )
    verify.add_argument("--api-key", help="bearer token for --server-url")
    verify.add_argument(
        "--quantization",
        choices=("int8", "int4"),
        help="check a weight-quantized engine: top-1 agreement and KL against float32",
    )
    verify.add_argument(  # serve's default (model.sizing.INT4_GROUP_SIZE)
        "--quantization-group-size", type=int, default=32, help="int4 group size"
    )
    verify.add_argument(
        "--kv-cache-dtype",
        choices=("bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"),
        help="check a reduced-precision KV cache the same way",
    )
    verify.add_argument(
        "--min-match",
        type=float,
        help="float32: the required exact-match rate (default 1.0); a reduced precision "
        f"(dtype, --quantization, --kv-cache-dtype): the required top-1 agreement (default {DEFAULT_MIN_TOP1})",
    )
    verify.add_argument(
        "--engine-arg",
        action="append",
        metavar="KEY=VALUE",
        help="extra LLM(...) kwarg, e.g. rope_theta_override=5000",
    )
    verify.add_argument(
        "--save-result", metavar="FILE.json", help="write every token of both sides"
    )
    verify.set_defaults(func=_guard(cmd_verify))
