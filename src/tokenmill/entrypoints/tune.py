"""``tokenmill tune``: the CLI of the tuner, and the parts of it that need the entrypoints.

Sizing comes from ``plan`` (which lives here, beside the other commands), so this module
builds the search's ``plan`` callable and hands it, the runner and the correctness gate to
``tune.search``; it writes the outputs: the serve command line, the ``--config`` YAML,
``result.json`` and ``report.html``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from tokenmill.config import default_step_tokens
from tokenmill.entrypoints.config_args import parse_memory
from tokenmill.errors import ConfigError

DEFAULT_OUTPUT_DIR = "tune-out"


def add_tune_parser(sub: Any) -> None:
    """Register ``tokenmill tune`` on the top-level subcommands."""
    p = sub.add_parser(
        "tune",
        help="pick a serving configuration on a recorded workload, within an SLA",
        description="Replays a workload trace against candidate configurations (KV strategy, "
        "precision, batching, prefix caching, speculation, threads, replicas), rejects "
        "reduced precisions that fail a correctness check against float32 transformers, and "
        "prints the serve command of the configuration with the best goodput within the SLA. "
        "Writes result.json, report.html (with charts), the command and a --config YAML to "
        "--output-dir; running it again with the same --output-dir resumes.",
    )
    p.add_argument("model", help="Hugging Face model folder, or 'demo'")
    p.add_argument(
        "--workload",
        required=True,
        help="a JSONL trace (Mooncake format: timestamp ms, input_length, output_length, "
        "hash_ids; or prompt/messages per line), a ShareGPT .json, or a synthetic profile "
        "'random:n=200,in=32-256,out=16-128,rate=4,burstiness=1,prefix=0'",
    )
    p.add_argument(
        "--sla",
        required=True,
        help="latency bounds, e.g. ttft_p95_ms=800,tpot_p95_ms=60 (metrics ttft, tpot, itl, e2el)",
    )
    p.add_argument(
        "--memory",
        type=parse_memory,
        default=None,
        help="memory the deployment may use, e.g. 20GiB; candidates that cannot fit are "
        "dropped before anything runs (default: this machine's available memory)",
    )
    p.add_argument("--budget-s", type=float, default=1800.0, help="wall seconds for the search")
    p.add_argument(
        "--output-dir", default=DEFAULT_OUTPUT_DIR, help="where outputs go; resumes from it"
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="stretch arrival times (2: twice as slow)"
    )
    p.add_argument(
        "--min-match", type=float, default=0.9, help="top-1 agreement a reduced precision needs"
    )
    p.add_argument("--num-rounds", type=int, default=3, help="full replays per finalist (>= 3)")
    p.add_argument("--num-finalists", type=int, default=3, help="candidates replayed in full")
    p.add_argument(
        "--cut-margin",
        type=float,
        default=0.05,
        help="when finalists are chosen on one whole-trace replay each, also keep (up to "
        "--num-finalists more) those within this fraction of the last finalist's goodput",
    )
    p.add_argument(
        "--sla-margin",
        type=float,
        default=0.10,
        help="room, as a fraction of each bound, a candidate must leave under the SLA in its "
        "worst round (or its rounds' spread of that figure, if wider) to meet it with room; "
        "one that meets it by less ranks below any that meets it with room",
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=0.02,
        help="finalists whose mean goodputs differ by no more than this fraction are a tie "
        "(as are those whose rounds overlap); a tie goes to fewer flags, then less memory",
    )
    p.add_argument(
        "--refine-steps",
        type=int,
        default=4,
        help="when no candidate meets the SLA with room, up to this many candidates with a "
        "--max-num-seqs or --max-num-batched-tokens value between two measured ones that "
        "fall short on different bounds (0: none)",
    )
    p.add_argument(
        "--first-sample", type=int, default=32, help="requests in the cheapest halving rung"
    )
    p.add_argument(
        "--eta", type=int, default=3, help="halving rate: keep 1/eta, replay eta times more"
    )
    p.add_argument(
        "--options",
        default=None,
        help="comma list of the options to vary (default: all): kv_cache, dtype, quantization, "
        "kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, "
        "enable_prefix_caching, speculative_config, num_threads, data_parallel_size",
    )
    p.add_argument("--max-candidates", type=int, default=40, help="most candidates to consider")
    p.add_argument("--draft-model", default=None, help="also try speculation with this draft model")
    p.add_argument(
        "--verify-prompts", type=int, default=4, help="prompts for the correctness check"
    )
    p.add_argument(
        "--verify-tokens", type=int, default=32, help="tokens per correctness-check prompt"
    )
    p.add_argument(
        "--num-requests", type=int, default=200, help="requests taken from a ShareGPT file"
    )
    p.add_argument(
        "--request-rate", type=float, default=2.0, help="arrival rate given to a ShareGPT file"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default: the trace's longest request"
    )
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="URL",
        help="after the search, replay the trace against these running OpenAI-compatible "
        "endpoints (http://host:port) too, and report each beside the winner; one that "
        "cannot be reached is reported as failed",
    )
    p.add_argument(
        "--compare-api-key",
        default=None,
        help="bearer token for the --compare endpoints (default: none)",
    )
    p.add_argument(
        "--compare-ready-timeout-s",
        type=float,
        default=30.0,
        help="how long a --compare endpoint may refuse connections or answer 503 before it "
        "is reported as failed",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_tune)


def _plan_fn(
    model: str, max_model_len: int, num_requests: int, memory_bytes: int, mean_len: int
) -> Any:
    from tokenmill.entrypoints.plan import PlanInputs, build_plan, this_machine

    # The device the candidates' servers start on: with --memory and device auto, `plan`
    # sizes for a GPU (its CLI's meaning), which on a CPU host let static KV through with a
    # GPU's budget while the server, on the CPU's default budget, refused to start.
    device = this_machine().device

    def plan(candidate: Any) -> tuple[bool, int | None, str]:
        o = candidate.options
        # static reserves every slot of --max-num-seqs at start-up, whatever the trace sends
        concurrency = o["max_num_seqs"] if o["kv_cache"] == "static" else num_requests
        try:
            result = build_plan(
                PlanInputs(
                    model=model,
                    max_model_len=max_model_len,
                    concurrency=max(1, min(o["max_num_seqs"], concurrency)),
                    device=device,
                    dtype=o["dtype"],
                    kv_cache_dtype=o["kv_cache_dtype"],
                    quantization=o["quantization"],
                    kv_cache=o["kv_cache"],
                    block_size=o["block_size"],
                    memory_bytes=memory_bytes // max(1, o["data_parallel_size"]),
                    gpu_memory_utilization=1.0,
                    mean_seq_len=mean_len,
                )
            )
        except (ConfigError, ValueError) as exc:
            return False, None, str(exc)
        if o["kv_cache"] == "static":
            kv_bytes, fits = result.expected_bytes, result.fits  # every slot, reserved at start
        else:
            # Paged takes blocks on demand from a pool the engine sizes to fit the memory: a
            # trace whose peak wants more queues or preempts (the replay measures that), it
            # does not fail to start. Its resident KV is the smaller of the demand and the pool.
            # (Judged on the demand of every request at once, the default and every
            # quantization were pruned from a 256-request batch trace on a 24 GiB host: 256 x
            # ~1,100 tokens wanted 6.4 GB of a 4 GiB pool; its bursts held 32 at a time.)
            kv_bytes, fits = min(result.expected_bytes, result.kv_pool_bytes), result.error is None
        need = (result.weight_bytes + kv_bytes) * o["data_parallel_size"]
        why = result.error or f"needs {need} bytes of {memory_bytes}"
        return fits, need, why

    return plan


def _resolved_defaults(model: str) -> dict[str, Any]:
    """What ``serve``'s ``auto`` dtype, thread count and step budget resolve to on this
    machine."""
    from tokenmill.entrypoints.plan import _resolve_model, resolve_model_dtype, this_machine
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.thread_policy import default_thread_decision

    device = this_machine().device
    cfg = ModelConfig.from_folder(_resolve_model(model))
    resolved: dict[str, Any] = {
        "dtype": resolve_model_dtype("auto", cfg, device),
        "max_num_batched_tokens": default_step_tokens(device),
    }
    if device == "cpu":
        resolved["num_threads"] = default_thread_decision().num_threads
    return resolved


def _vocab(model: str) -> np.ndarray:
    from tokenmill.bench.tokenization import load_tokenizer, special_ids_of, vocab_size_of

    tokenizer = load_tokenizer(model)
    size = vocab_size_of(tokenizer) or 1000
    special = special_ids_of(tokenizer)
    return np.array([i for i in range(size) if i not in special])


def check_compare_urls(urls: list[str]) -> None:
    """Refuse a ``--compare`` value that is no http(s) URL before the search starts (an
    endpoint that is down is only found, and reported, after it)."""
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"--compare {url}: not an http(s) URL of an OpenAI-compatible server, "
                "e.g. http://127.0.0.1:8000"
            )


def _compare(
    urls: list[str],
    trace: Any,
    sla: dict[str, float],
    runner: Any,
    api_key: str | None,
    ready_timeout_s: float,
) -> list[dict[str, Any]]:
    """Each endpoint's figures on the whole trace, replayed as the finalists' rounds are
    (the same prompts, arrival times, warm-ups and request deadline); an endpoint that
    fails gets its error instead, and the others are still measured."""
    from tokenmill.bench.serve import (
        BenchmarkError,
        ServeConfig,
        quiet_library_loggers,
        run_serve_benchmark,
    )
    from tokenmill.bench.sla import check_sla
    from tokenmill.tune.runner import FIGURE_KEYS, build_bench_requests, goodput_slos

    out: list[dict[str, Any]] = []
    for url in urls:
        config = ServeConfig(
            base_url=url,
            api_key=api_key,
            arrival_offsets_s=tuple(trace.arrival_offsets_s(runner.time_scale)),
            goodput_slos_ms=goodput_slos(sla),
            request_timeout_s=runner.request_timeout_s,
            ready_timeout_s=ready_timeout_s,
            ignore_eos=True,
            num_warmups=runner.num_warmups,
            show_progress=False,
            label=url,
        )
        requests = build_bench_requests(trace, runner.vocab, 0, runner.seed)
        try:
            with quiet_library_loggers():
                result = run_serve_benchmark(config, requests)
        except BenchmarkError as exc:  # one endpoint down does not lose the tune
            out.append({"url": url, "error": str(exc)})
            continue
        except Exception as exc:
            out.append({"url": url, "error": f"{type(exc).__name__}: {exc}"})
            continue
        figures: dict[str, Any] = {k: result.get(k) for k in FIGURE_KEYS}
        misses = check_sla(figures, sla)
        out.append(
            {
                "url": url,
                "model_id": result.get("model_id"),
                **figures,
                "meets_sla": not misses,
                "sla_misses": misses,
            }
        )
    return out


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM as Ctrl-C while the search runs, so the candidate's server is stopped on the
    way out: by default SIGTERM ends Python at once, and a ``kill`` of the tune left its
    ``tokenmill serve`` running, holding a port, memory and the cores the next run measures
    on. Measurements saved so far stay in ``result.json`` for a resume."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_tune(args: argparse.Namespace) -> int:
    import psutil
    from tqdm.auto import tqdm

    from tokenmill.bench.sla import parse_sla
    from tokenmill.tune.candidates import default_space
    from tokenmill.tune.runner import TraceRunner, verify_precision
    from tokenmill.tune.search import Search, SearchSettings
    from tokenmill.tune.state import TuneState
    from tokenmill.tune.trace import TraceError, load_trace

    try:
        sla = parse_sla(args.sla)
        trace = load_trace(args.workload, num_requests=args.num_requests, rate=args.request_rate)
        settings = SearchSettings(
            budget_s=args.budget_s,
            first_sample=args.first_sample,
            eta=args.eta,
            num_finalists=args.num_finalists,
            cut_margin=args.cut_margin,
            sla_margin=args.sla_margin,
            tie_margin=args.tie_margin,
            refine_steps=args.refine_steps,
            num_rounds=args.num_rounds,
            min_match=args.min_match,
        )
    except (TraceError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if not sla:
        raise ConfigError("--sla needs at least one bound, e.g. ttft_p95_ms=800")
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be > 0")
    check_compare_urls(args.compare)
    if args.compare_ready_timeout_s <= 0:
        raise ConfigError("--compare-ready-timeout-s must be > 0")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    memory = int(args.memory or psutil.virtual_memory().available)
    longest = max(r.input_length + r.output_length for r in trace.requests)
    max_model_len = args.max_model_len or longest
    mean_len = int(np.mean([r.input_length + r.output_length for r in trace.requests]))
    resolved = _resolved_defaults(args.model)
    space = default_space(
        os.cpu_count() or 1, draft_model=args.draft_model, resolved_defaults=resolved
    )
    if args.options:
        wanted = {o.strip() for o in args.options.split(",") if o.strip()}
        unknown = wanted - set(space.values) - {"data_parallel_size", "num_threads"}
        if unknown:
            raise ConfigError(
                f"--options: unknown or unavailable here: {', '.join(sorted(unknown))}"
            )
        space.values.update({k: v for k, v in space.values.items() if k in wanted})
        for key in list(space.values):
            if key not in wanted:
                del space.values[key]
    candidates = space.candidates()[: args.max_candidates]
    base_args = ["--max-model-len", str(max_model_len)]
    meta = {
        "model": args.model,
        "workload": args.workload,
        "sla": sla,
        "time_scale": args.time_scale,
        "budget_s": args.budget_s,
        "memory_bytes": memory,
        "num_trace_requests": len(trace.requests),
        "workload_summary": trace.describe(),
        "base_args": base_args,
        "client_cpu_count": os.cpu_count(),
    }
    state = TuneState.new(candidates, meta)
    result_path = out_dir / "result.json"
    if result_path.exists():
        try:
            taken = state.absorb(result_path)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ConfigError(str(exc)) from None
        print(f"resuming from {result_path}: {taken} measurements kept")
    texts = [r.prompt for r in trace.requests if r.prompt][: args.verify_prompts] or None
    runner = TraceRunner(
        args.model, trace, sla, _vocab(args.model), out_dir, base_args, args.time_scale
    )
    bar = tqdm(total=round(args.budget_s), unit="s", disable=args.no_progress, desc="tune")
    started = time.monotonic() - state.elapsed_s

    def progress(what: str, left_s: float) -> None:
        bar.n = min(bar.total, round(time.monotonic() - started))
        bar.set_description(what[:60])
        bar.set_postfix_str(f"{left_s:.0f}s left")

    search = Search(
        state,
        sla,
        settings,
        len(trace.requests),
        _plan_fn(args.model, max_model_len, len(trace.requests), memory, mean_len),
        lambda c: verify_precision(args.model, c, texts, args.verify_tokens, args.verify_prompts),
        runner,
        time.monotonic,
        save=lambda s: s.save(result_path),
        progress=progress,
        resolved=resolved,
    )
    try:
        with _interrupt_on_sigterm():
            decision = search.run()
    finally:
        runner.close()
        bar.close()
    if args.compare:  # after the candidates' servers are stopped: nothing else competes
        from tokenmill.tune.report import winner_figures

        state.meta["compare"] = _compare(
            args.compare,
            trace,
            sla,
            runner,
            args.compare_api_key,
            args.compare_ready_timeout_s,
        )
        state.meta["compare_winner"] = winner_figures(state.to_json())
        state.save(result_path)
    return _write_outputs(args.model, state, base_args, decision, out_dir)


def compare_lines(result: dict[str, Any]) -> list[str]:
    """One line for the winner and one per ``--compare`` endpoint, for the terminal."""
    compare = result.get("compare") or []
    if not compare:
        return []
    winner = result.get("compare_winner")
    lines = []
    if winner:
        lines.append(
            f"compare: winner {winner['key']}: {_figures_text(winner)} "
            f"(mean of {winner['num_rounds']} replays)"
        )
    for c in compare:
        if c.get("error"):
            lines.append(f"compare: {c['url']}: failed: {c['error']}")
        else:
            verdict = "meets the SLA" if c.get("meets_sla") else "misses the SLA"
            lines.append(f"compare: {c['url']}: {_figures_text(c)}, {verdict}")
    return lines


def _figures_text(figures: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        value = figures.get(key)
        return "n/a" if value is None else f"{value:.1f} ms"

    goodput = figures.get("request_goodput")
    return (
        f"goodput {'n/a' if goodput is None else f'{goodput:.3g}'} req/s, "
        f"P95 TTFT {ms('p95_ttft_ms')}, P95 TPOT {ms('p95_tpot_ms')}"
    )


def _write_outputs(
    model: str, state: Any, base_args: list[str], decision: dict[str, Any], out_dir: Path
) -> int:
    from tokenmill.tune.report import write_report

    winner = state.candidates.get(decision.get("winner") or "")
    if winner is None:
        command, config_yaml = "", ""
        print(f"tokenmill tune: no decision: {decision.get('reason')}")
    else:
        args = [*base_args, *winner.candidate.serve_args()]
        command = shlex.join(["tokenmill", "serve", model, *args])
        extra = {"max-model-len": int(base_args[1])}
        config_yaml = winner.candidate.config_yaml(model, extra)
        (out_dir / "serve_command.txt").write_text(command + "\n", encoding="utf-8")
        (out_dir / "config.yaml").write_text(config_yaml, encoding="utf-8")
    result = state.to_json()
    report = write_report(result, out_dir, command, config_yaml)
    if winner is not None:
        if decision.get("meets_sla_with_room"):
            verdict = "meets the SLA with room"
        elif decision.get("meets_sla"):
            verdict = f"meets the SLA narrowly: {decision.get('reason')}"
        else:
            verdict = "misses the SLA (closest)"
        print(f"chosen: {winner.candidate.key} ({verdict})")
        if decision.get("tie_note"):
            print(decision["tie_note"])
        if state.meta.get("halving"):
            print(f"halving {state.meta['halving']}")
        if state.meta.get("near_ties"):
            print(f"near ties: {state.meta['near_ties']}")
        if state.meta.get("refinement"):
            print(f"refinement: {state.meta['refinement']}")
        print(command)
    for line in compare_lines(result):
        print(line)
    print(
        f"wrote {out_dir / 'result.json'}, {report}"
        + (f", {out_dir / 'config.yaml'}" if winner else "")
    )
    return 0 if winner is not None and decision.get("meets_sla") else 1
