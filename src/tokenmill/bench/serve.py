"""``tokenmill bench serve``: load-test an OpenAI-compatible endpoint and summarize it.

Owns the run: resolve the model name, send a probe request (which also decides whether
the server takes token-id prompts), warm up (probe and warm-ups use prompts of their own,
shaped like the measured ones, so a prefix cache holds nothing the measured run could
reuse), then release requests on the arrival schedule under an optional concurrency cap
while ``/metrics`` is polled, once per round, and finally build the result dict
(vLLM-compatible keys plus every round's figures and every per-request timing) and its
printed summary table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tokenmill.bench import MissingExtraError
from tokenmill.bench.arrivals import build_arrival_offsets_s
from tokenmill.bench.client import ENDPOINTS, RequestOptions, auth_headers, send_request
from tokenmill.bench.datasets import BenchRequest, build_warmup_requests
from tokenmill.bench.metrics import LATENCY_METRICS, STATS, RequestRecord, summarize_rounds
from tokenmill.bench.server_clock import clock_disagreements
from tokenmill.bench.server_metrics import DEFAULT_INTERVAL_S, MetricsScraper
from tokenmill.bench.tokenization import TokenizerLike

try:
    import httpx
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("httpx") from exc

RESULT_FORMAT_VERSION = 1
"""Bumped when the result JSON changes incompatibly; ``compare`` checks it."""
PROMPT_FORMATS: tuple[str, ...] = ("auto", "ids", "text")
"""``--prompt-format`` values: ``auto`` tries token ids and falls back to text."""
_READY_POLL_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ServeConfig:
    """Everything one serve benchmark run needs besides the workload itself."""

    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""
    endpoint: str = "/v1/completions"
    """``/v1/completions`` or ``/v1/chat/completions``."""
    model: str | None = None
    """Model name for the body; None asks ``/v1/models`` for the first one."""
    api_key: str | None = None
    """Bearer token, if the server wants one."""
    request_rate: float = math.inf
    """Mean requests per second; inf sends everything at once."""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival gaps; 1 is Poisson."""
    max_concurrency: int | None = None
    """Cap on requests in flight; None for no cap."""
    num_warmups: int | None = None
    """Uncounted requests sent after the probe, before measuring (own prompts, measured shapes).
    None: ``default_num_warmups`` of the run's concurrency; 0 measures a cold server."""
    prompt_format: str = "auto"
    """``auto``, ``ids`` or ``text`` (completions only; chat always sends text)."""
    temperature: float = 0.0
    """Sampling temperature of every request."""
    ignore_eos: bool = False
    """Ask the server to ignore EOS so every request produces its full output length."""
    request_timeout_s: float = 600.0
    """Total deadline of one request (send to last chunk); past it the request fails as ``timeout``."""
    ready_timeout_s: float = 120.0
    """How long the probe retries while the server is unreachable or answers 503 (loading)."""
    seed: int = 0
    """Seed of the arrival schedule."""
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    """``ttft``/``tpot``/``e2el`` limits for goodput."""
    scrape_metrics: bool = True
    """Poll the target's ``/metrics`` for server-side figures."""
    metrics_interval_s: float = DEFAULT_INTERVAL_S
    """Seconds between ``/metrics`` polls during the run (each costs the target CPU time)."""
    show_progress: bool = True
    """Show a tqdm bar while requests complete."""
    label: str | None = None
    """Name of this target in reports; defaults to the model name."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Extra JSON fields for every request body."""
    arrival_offsets_s: tuple[float, ...] | None = None
    """Recorded send times (seconds after the first) that replace the drawn schedule, one per request."""

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.num_warmups is not None and self.num_warmups < 0:
            raise ValueError("num_warmups must be >= 0")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def root_url(self) -> str:
        """Server root without a trailing slash or ``/v1``."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


class BenchmarkError(RuntimeError):
    """The run cannot produce meaningful numbers (e.g. the probe request failed)."""


async def _resolve_model(client: httpx.AsyncClient, config: ServeConfig) -> str:
    if config.model:
        return config.model
    headers = auth_headers(config.api_key)
    deadline_s = time.perf_counter() + config.ready_timeout_s
    while True:
        try:
            response = await client.get(f"{config.root_url}/v1/models", headers=headers)
            if response.status_code == 503 and time.perf_counter() < deadline_s:
                await asyncio.sleep(_READY_POLL_INTERVAL_S)
                continue
            models = response.json().get("data") or []
            return str(models[0]["id"])
        except httpx.ConnectError as exc:
            if time.perf_counter() >= deadline_s:
                raise BenchmarkError(f"cannot reach {config.root_url}: {exc}") from exc
            await asyncio.sleep(_READY_POLL_INTERVAL_S)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise BenchmarkError(
                f"--model not given and {config.root_url}/v1/models did not name one: {exc}"
            ) from exc


def _initial_options(
    config: ServeConfig, model: str, requests: list[BenchRequest]
) -> RequestOptions:
    is_chat = config.endpoint == "/v1/chat/completions"
    has_ids = all(r.prompt_token_ids is not None for r in requests)
    use_ids = not is_chat and (
        config.prompt_format == "ids" or (config.prompt_format == "auto" and has_ids)
    )
    return RequestOptions(
        url=f"{config.root_url}{config.endpoint}",
        model=model,
        is_chat=is_chat,
        use_token_ids=use_ids,
        api_key=config.api_key,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
        extra_body=dict(config.extra_body),
        timeout_s=config.request_timeout_s,
    )


def _is_not_ready(error: str) -> bool:
    """A server still starting: connection refused, or 503 while the model loads."""
    return error.startswith(("HTTP 503", "ConnectError", "RemoteProtocolError", "ReadError"))


async def _send_when_ready(
    client: httpx.AsyncClient,
    config: ServeConfig,
    request: BenchRequest,
    options: RequestOptions,
    tokenizer: TokenizerLike | None,
) -> RequestRecord:
    """Send one uncounted request, retrying for ``ready_timeout_s`` while the server starts."""
    deadline_s = time.perf_counter() + config.ready_timeout_s
    while True:
        record = await send_request(client, -1, request, options, time.perf_counter(), tokenizer)
        if record.success or not _is_not_ready(record.error) or time.perf_counter() >= deadline_s:
            return record
        await asyncio.sleep(_READY_POLL_INTERVAL_S)


async def _probe(
    client: httpx.AsyncClient,
    config: ServeConfig,
    options: RequestOptions,
    probe: BenchRequest,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None,
) -> RequestOptions:
    """Send ``probe`` once (waiting for the server to be ready); fall back from token ids to
    text if the server refuses ids and every measured request has text."""
    record = await _send_when_ready(client, config, probe, options, tokenizer)
    if record.success:
        return options
    has_text = all(r.prompt_text is not None for r in requests)
    is_refusal = record.error.startswith(("HTTP 400", "HTTP 422"))
    if options.use_token_ids and config.prompt_format == "auto" and is_refusal and has_text:
        text_options = replace(options, use_token_ids=False)
        retry = await send_request(client, -1, probe, text_options, time.perf_counter(), tokenizer)
        if retry.success:
            return text_options
        record = retry
    hint = ""
    if options.use_token_ids and not has_text and is_refusal:
        hint = " (the server may not take token-id prompts: pass --tokenizer to send text)"
    elif _is_not_ready(record.error):
        hint = f" (still not ready after {config.ready_timeout_s:g}s)"
    raise BenchmarkError(f"probe request to {options.url} failed: {record.error}{hint}")


async def _measure(
    client: httpx.AsyncClient,
    config: ServeConfig,
    options: RequestOptions,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None,
) -> tuple[list[RequestRecord], float]:
    """Release requests on schedule under the concurrency cap; return records and duration."""
    offsets_s = list(config.arrival_offsets_s or ()) or build_arrival_offsets_s(
        len(requests), config.request_rate, config.burstiness, config.seed
    )
    if len(offsets_s) != len(requests):
        raise BenchmarkError(f"{len(offsets_s)} arrival times for {len(requests)} requests")
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    with quiet_library_loggers():
        return await _measure_quietly(
            client, config, options, requests, tokenizer, offsets_s, semaphore
        )


QUIET_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "huggingface_hub")
"""Libraries that log a line per request (httpx: ``HTTP Request: POST ...``) or per file."""


@contextlib.contextmanager
def quiet_library_loggers(names: Sequence[str] = QUIET_LOGGERS) -> Iterator[None]:
    """Keep libraries' info lines out of the progress bar: warnings and errors still show."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


async def _measure_quietly(
    client: httpx.AsyncClient,
    config: ServeConfig,
    options: RequestOptions,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None,
    offsets_s: Sequence[float],
    semaphore: asyncio.Semaphore | None,
) -> tuple[list[RequestRecord], float]:
    bar = tqdm(
        total=len(requests), disable=not config.show_progress, desc="bench serve", unit="req"
    )
    start_s = time.perf_counter()

    async def one(index: int, request: BenchRequest) -> RequestRecord:
        if semaphore is None:
            record = await send_request(client, index, request, options, start_s, tokenizer)
        else:
            async with semaphore:
                record = await send_request(client, index, request, options, start_s, tokenizer)
        bar.update(1)
        return record

    tasks = []
    for index, (request, offset_s) in enumerate(zip(requests, offsets_s, strict=True)):
        delay_s = start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(index, request)))
    records = list(await asyncio.gather(*tasks))
    duration_s = time.perf_counter() - start_s
    bar.close()
    return records, duration_s


async def arun_serve_benchmark(
    config: ServeConfig,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None = None,
    workload: dict[str, Any] | None = None,
    later_rounds: Sequence[list[BenchRequest]] = (),
) -> dict[str, Any]:
    """Run one serve benchmark and return its result dict (see ``build_result``).

    ``later_rounds`` are measured after ``requests``, one round each, on the same
    connection pool and metrics scrape; each round should bring prompts of its own, or a
    prefix cache would serve it from the previous round's KV.
    """
    if not requests or not all(later_rounds):
        raise BenchmarkError("no requests to send")
    cpu_before_s = time.process_time()
    limit = config.max_concurrency or len(requests)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await _resolve_model(client, config)
        num_warmups = resolved_num_warmups(config, len(requests))
        probe, *warmups = build_warmup_requests(requests, 1 + num_warmups, config.seed, tokenizer)
        options = await _probe(
            client, config, _initial_options(config, model, requests), probe, requests, tokenizer
        )
        if warmups:
            warm_cap = asyncio.Semaphore(limit)

            async def warm(request: BenchRequest) -> None:
                async with warm_cap:
                    await send_request(client, -1, request, options, time.perf_counter(), tokenizer)

            await asyncio.gather(*(warm(r) for r in warmups))
        scraper = MetricsScraper(
            client, f"{config.root_url}/metrics", config.metrics_interval_s, options.headers
        )
        if config.scrape_metrics:
            await scraper.start()
        try:
            rounds = [
                await _measure(client, config, options, r, tokenizer)
                for r in [requests, *later_rounds]
            ]
        finally:
            await scraper.stop()
    result = build_result(config, options, rounds, scraper.report(), workload)
    result["num_warmups"] = num_warmups
    result["client_cpu_s"] = time.process_time() - cpu_before_s
    result["clock_disagreements"] = clock_disagreements(result, result["server_metrics"])
    return result


def run_serve_benchmark(
    config: ServeConfig,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None = None,
    workload: dict[str, Any] | None = None,
    later_rounds: Sequence[list[BenchRequest]] = (),
) -> dict[str, Any]:
    """Blocking wrapper of ``arun_serve_benchmark`` for the CLI and comparisons."""
    return asyncio.run(arun_serve_benchmark(config, requests, tokenizer, workload, later_rounds))


MAX_DEFAULT_WARMUPS = 16


def default_num_warmups(concurrency: int) -> int:
    """Warm-ups when none are asked for: one per concurrent slot (2 at least, 16 at most), so
    every batch size the run will see has been through the server once before measuring.
    A cold first request pays for kernel builds, allocator growth and first-touch pages, and
    on a small machine that alone can move P95 TTFT by several times."""
    return max(2, min(concurrency, MAX_DEFAULT_WARMUPS))


def resolved_num_warmups(config: ServeConfig, num_requests: int) -> int:
    """The warm-ups this run sends: as given, else ``default_num_warmups``."""
    if config.num_warmups is not None:
        return config.num_warmups
    return default_num_warmups(config.max_concurrency or num_requests)


def build_result(
    config: ServeConfig,
    options: RequestOptions,
    rounds: list[tuple[list[RequestRecord], float]],
    server_metrics: dict[str, Any],
    workload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The saved result: run settings, summary, server figures and per-request timings.

    Top-level keys follow vLLM's result files (``request_throughput``, ``p99_ttft_ms``,
    ``ttfts``, ``itls``...) so those files and these can be compared by the same tools.
    With several rounds (``records`` and duration of each) the summary pools them and
    ``rounds`` keeps each one's figures; every request says which round it was in.
    """
    result: dict[str, Any] = {
        "format_version": RESULT_FORMAT_VERSION,
        "kind": "serve",
        "label": config.label or options.model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": config.root_url,
        "endpoint": config.endpoint,
        "model_id": options.model,
        "prompt_format": "chat"
        if options.is_chat
        else ("ids" if options.use_token_ids else "text"),
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "seed": config.seed,
        "workload": workload or {},
    }
    result.update(summarize_rounds(rounds, config.goodput_slos_ms or None))
    records = [r for round_records, _ in rounds for r in round_records]
    result["server_metrics"] = server_metrics
    result["input_lens"] = [r.prompt_tokens for r in records]
    result["output_lens"] = [r.output_tokens for r in records]
    result["ttfts"] = [r.ttft_s for r in records]
    result["itls"] = [r.itl_s for r in records]
    result["generated_texts"] = [r.generated_text for r in records]
    result["errors"] = [r.error for r in records]
    result["requests"] = [
        {**r.to_dict(), "round": i}
        for i, (round_records, _) in enumerate(rounds)
        for r in round_records
    ]
    return result


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    """Write the result JSON (creating parent folders) and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_summary(result: dict[str, Any]) -> str:
    """The end-of-run table, laid out like vLLM's so eyes trained on it find things."""
    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<40}{_fmt(value):>10}")

    row("Target:", result.get("label"))
    row("Successful requests:", result.get("completed"))
    row("Failed requests:", result.get("failed"))
    row("Max request concurrency:", result.get("max_concurrency"))
    row("Benchmark duration (s):", result.get("duration"))
    row("Total input tokens:", result.get("total_input_tokens"))
    row("Total generated tokens:", result.get("total_output_tokens"))
    row("Request throughput (req/s):", result.get("request_throughput"))
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result.get("request_goodput"))
    row("Output token throughput (tok/s):", result.get("output_throughput"))
    rounds = result.get("rounds") or []
    if len(rounds) > 1:
        per_round = [r["output_throughput"] for r in rounds]
        row(f"  min-max over {len(rounds)} rounds:", f"{min(per_round):.2f}-{max(per_round):.2f}")
    row("Peak output token throughput (tok/s):", result.get("max_output_tokens_per_s"))
    row("Peak requests in flight:", result.get("max_in_flight_requests"))
    row("Requests active in the busiest second:", result.get("max_concurrent_requests"))
    row("Total token throughput (tok/s):", result.get("total_token_throughput"))
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for metric in LATENCY_METRICS:
        lines.append("{s:{c}^{n}}".format(s=f" {titles[metric]} ", n=width, c="-"))
        for stat in STATS:
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            row(f"{label} {metric.upper()} (ms):", result.get(f"{stat}_{metric}_ms"))
    server = result.get("server_metrics") or {}
    if server.get("available"):
        lines.append("{s:{c}^{n}}".format(s=" Server /metrics ", n=width, c="-"))
        kv = server.get("peak_kv_cache_usage")
        row("Peak KV cache usage (%):", None if kv is None else kv * 100)
        row("Preemptions:", server.get("num_preemptions"))
        hit_rate = server.get("prefix_cache_hit_rate")
        row("Prefix cache hit rate (%):", None if hit_rate is None else hit_rate * 100)
        rss = server.get("peak_resident_memory_bytes")
        row("Peak server RSS (MiB):", None if rss is None else rss / 2**20)
        for key in (
            "server_mean_ttft_ms",
            "server_p95_ttft_ms",
            "server_mean_tpot_ms",
            "server_p95_tpot_ms",
        ):
            if server.get(key) is not None:
                stat, metric = key.split("_")[1:3]
                row(f"Server-clock {stat} {metric.upper()} (ms):", server[key])
        if server.get("spec_mean_accepted_length") is not None:
            rate = server.get("spec_acceptance_rate")
            row("Spec decode acceptance rate (%):", None if rate is None else rate * 100)
            row("Spec decode mean accepted length:", server.get("spec_mean_accepted_length"))
        for key, value in sorted((server.get("engine_config") or {}).items()):
            lines.append(f"{'Server ' + key.replace('_', ' ') + ':':<40}{value:>10}")
        startup = server.get("startup")
        if startup:
            cache = startup.get("compile_cache") or "unknown"
            row(f"Start-up, {cache} compile cache (s):", startup.get("startup_s"))
            row("  model load (s):", startup.get("model_load_s"))
            row("  KV allocation (s):", startup.get("kv_allocation_s"))
            row("  compile (s):", startup.get("compile_s"))
    if result.get("client_cpu_s") is not None:
        row("Benchmark client CPU time (s):", result["client_cpu_s"])
    for note in result.get("clock_disagreements") or ():
        lines.append(f"Client and server clocks disagree: {note}")
    if result.get("failure_reasons"):
        lines.append("{s:{c}^{n}}".format(s=" Failures ", n=width, c="-"))
        for reason, count in result["failure_reasons"].items():
            lines.append(f"{count:>6} x {reason}")
    lines.append("=" * width)
    return "\n".join(lines)
