"""``tokenmill bench offline``: in-process throughput and latency of several backends.

Owns running one workload, without HTTP, through tokenmill's engine, through
``transformers.generate`` with padded static batches (the baseline the field starts
from) and through ``transformers``' continuous batching when the installed version has
it. All requests arrive at time zero, so TTFT includes waiting for a batch slot: that is
exactly the cost static batching pays. Memory is what each backend adds: RSS growth on
CPU (sampled), allocated-bytes growth on GPU. ``--compare`` loads every backend once and
runs them interleaved for several rounds, rotating the order, so the ratios survive a
noisy machine. tokenmill gives one row per KV strategy. Warm-ups use prompts of their
own (shaped like the measured ones), so no backend measures prompts it has seen.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import psutil
import torch

from tokenmill.bench.datasets import BenchRequest, build_warmup_requests
from tokenmill.bench.metrics import RequestRecord, summarize_rounds
from tokenmill.bench.offline_backends import BACKEND_NAMES, OfflineBackend, make_backend
from tokenmill.bench.tokenization import TokenizerLike

__all__ = [
    "BACKEND_NAMES",
    "KV_CACHE_KINDS",
    "OfflineConfig",
    "format_offline_table",
    "run_offline_benchmark",
]
KV_CACHE_KINDS: tuple[str, ...] = ("paged", "static")
"""tokenmill's KV strategies ``--kv-cache`` may list."""
_RSS_SAMPLE_INTERVAL_S = 0.01
_SET_BY_CONFIG = (
    "model",
    "dtype",
    "device",
    "kv_cache",
)  # LLM(...) kwargs engine_kwargs must not repeat


@dataclass(frozen=True)
class OfflineConfig:
    """One offline benchmark: which model, which backends, how to run them."""

    model: str = "demo"
    """Model folder, or ``demo``."""
    backends: tuple[str, ...] = ("tokenmill", "transformers")
    """Backends to run, in order; the first row is the ratio baseline."""
    kv_caches: tuple[str, ...] = ("paged",)
    """tokenmill's KV strategies (``paged``, ``static``): one tokenmill row, and LLM instance, each."""
    dtype: str = "float32"
    """Weights dtype for every backend."""
    engine_dtype: str | None = None
    """What tokenmill's engine is given instead, when set: ``auto`` where the user asked for
    it (``dtype`` is then what auto resolves to), so a GGUF file's blocks run as ``serve``
    runs them rather than dequantized to ``dtype``."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto``."""
    batch_size: int = 8
    """Static batch size of the ``transformers`` backend."""
    ignore_eos: bool = True
    """Generate every request's full output length, so backends do equal work."""
    compare: bool = False
    """Load every backend at once and interleave their rounds, rotating the order."""
    num_rounds: int = 1
    """Measured runs of each backend: interleaved with ``compare``, else back to back."""
    num_warmups: int = 2
    """Uncounted requests each backend runs after loading (own prompts, measured shapes)."""
    seed: int = 0
    """Seed the warm-up prompts are drawn with (the workload's seed)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``LLM(...)`` keyword arguments for tokenmill, e.g. ``compile_batch_sizes``."""

    def __post_init__(self) -> None:
        unknown = [b for b in self.backends if b not in BACKEND_NAMES]
        if unknown or not self.backends:
            raise ValueError(f"unknown backends {unknown}; choose from {', '.join(BACKEND_NAMES)}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends are listed more than once: {', '.join(self.backends)}")
        bad_kv = [k for k in self.kv_caches if k not in KV_CACHE_KINDS]
        if bad_kv or not self.kv_caches or len(set(self.kv_caches)) != len(self.kv_caches):
            raise ValueError(
                f"kv_caches must be distinct values of {', '.join(KV_CACHE_KINDS)}, got {self.kv_caches}"
            )
        repeated = sorted(set(self.engine_kwargs) & set(_SET_BY_CONFIG))
        if repeated:
            raise ValueError(
                f"engine_kwargs may not set {', '.join(repeated)}: use the offline option of that name"
            )
        if self.batch_size < 1 or self.num_rounds < 1 or self.num_warmups < 0:
            raise ValueError("batch_size and num_rounds must be >= 1, num_warmups >= 0")

    @property
    def resolved_device(self) -> str:
        """``cuda`` or ``cpu``."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def rows(self) -> list[tuple[str, str | None]]:
        """(backend, KV strategy) of each result row, in order: tokenmill once per strategy."""
        return [
            (b, kv)
            for b in self.backends
            for kv in (self.kv_caches if b == "tokenmill" else (None,))
        ]


class MemoryMeter:
    """What a backend adds to memory: RSS growth (sampled in a thread) or CUDA bytes."""

    def __init__(self, device: str) -> None:
        self.is_cuda = device.startswith("cuda")
        self._process = psutil.Process()

    @property
    def kind(self) -> str:
        """``cuda_allocated`` or ``rss``."""
        return "cuda_allocated" if self.is_cuda else "rss"

    def current_bytes(self) -> int:
        if self.is_cuda:
            return int(torch.cuda.memory_allocated())
        return int(self._process.memory_info().rss)

    @contextlib.contextmanager
    def peak_growth(self) -> Iterator[dict[str, int]]:
        """Measures the peak growth over the starting level inside the block."""
        box = {"start_bytes": self.current_bytes(), "peak_bytes": 0, "growth_bytes": 0}
        if self.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield box
            torch.cuda.synchronize()
            box["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        else:
            stop = threading.Event()
            peak = [box["start_bytes"]]

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], self.current_bytes())
                    stop.wait(_RSS_SAMPLE_INTERVAL_S)

            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            try:
                yield box
            finally:
                stop.set()
                thread.join()
            box["peak_bytes"] = max(peak[0], self.current_bytes())
        box["growth_bytes"] = max(box["peak_bytes"] - box["start_bytes"], 0)


@dataclass
class BackendResult:
    """Every measured run of one backend, and what loading it cost."""

    name: str
    label: str = ""
    kv_cache: str | None = None
    """tokenmill's KV strategy; None for other backends."""
    skipped_reason: str | None = None
    load_s: float = 0.0
    """Start-up seconds: loading the model and, for tokenmill, compiling."""
    load_figures: dict[str, Any] = field(default_factory=dict)
    """Backend-specific start-up figures, e.g. tokenmill's ``compile_time_s``."""
    load_memory_bytes: int = 0
    run_memory_bytes: int = 0
    process_peak_bytes: int = 0
    rounds: list[tuple[list[RequestRecord], float]] = field(default_factory=list)
    round_figures: list[dict[str, Any]] = field(default_factory=list)
    """The backend's ``run_figures`` after each measured round; the row shows their mean."""

    def summary(self, memory_kind: str) -> dict[str, Any]:
        """vLLM-style summary over all rounds, plus memory; ITL only where per-token times exist."""
        if self.skipped_reason is not None:
            return {
                "backend": self.name,
                "label": self.label or self.name,
                "kv_cache": self.kv_cache,
                "skipped": True,
                "note": self.skipped_reason,
            }
        result = summarize_rounds(self.rounds)
        if not any(r.itl_s for records, _ in self.rounds for r in records):
            # Without per-token times only first tokens are placed in time: no ITL, no peak rate.
            for summary in [result, *result["rounds"]]:
                for key in [k for k in summary if "_itl_" in k]:
                    summary[key] = None
                summary["max_output_tokens_per_s"] = None
        result.update(
            backend=self.name,
            label=self.label or self.name,
            kv_cache=self.kv_cache,
            skipped=False,
            load_s=self.load_s,
            **self.load_figures,
            **_mean_figures(self.round_figures),
            memory_kind=memory_kind,
            peak_memory_bytes=self.load_memory_bytes + self.run_memory_bytes,
            load_memory_bytes=self.load_memory_bytes,
            run_memory_bytes=self.run_memory_bytes,
            process_peak_bytes=self.process_peak_bytes,
            round_output_throughputs=[
                sum(r.output_tokens for r in recs if r.success) / d for recs, d in self.rounds
            ],
        )
        return result


def _mean_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the mean over the rounds that reported a number (None if none did)."""
    keys = dict.fromkeys(k for figures in rounds for k in figures)
    means: dict[str, Any] = {}
    for key in keys:
        values = [f[key] for f in rounds if isinstance(f.get(key), (int, float))]
        means[key] = sum(values) / len(values) if values else None
    return means


def _load(
    name: str,
    kv_cache: str | None,
    config: OfflineConfig,
    requests: list[BenchRequest],
    meter: MemoryMeter,
) -> tuple[OfflineBackend | None, BackendResult]:
    """Load and prepare one backend, measuring time and memory; failures become a skip note."""
    result = BackendResult(
        name, label=f"{name}[{kv_cache}]" if kv_cache else name, kv_cache=kv_cache
    )
    gc.collect()
    start_s = time.perf_counter()
    backend: OfflineBackend | None = None
    with meter.peak_growth() as box:
        try:
            backend = make_backend(name, config, kv_cache)
            skip = backend.unavailable_reason()
            if skip is None:
                backend.prepare(requests)
        except Exception as exc:  # a broken backend is reported, not fatal to the others
            skip = f"could not load: {type(exc).__name__}: {exc}"
    result.load_s = time.perf_counter() - start_s
    if skip is not None or backend is None:
        result.skipped_reason = skip
        return None, result
    result.label = backend.label
    result.load_figures = backend.load_figures()
    result.load_memory_bytes = max(meter.current_bytes() - box["start_bytes"], 0)
    return backend, result


def _measure(
    backend: OfflineBackend, requests: list[BenchRequest], result: BackendResult, meter: MemoryMeter
) -> None:
    with meter.peak_growth() as box:
        records, duration_s = backend.run(requests)
    result.run_memory_bytes = max(result.run_memory_bytes, box["growth_bytes"])
    result.process_peak_bytes = max(result.process_peak_bytes, box["peak_bytes"])
    result.rounds.append((records, duration_s))
    result.round_figures.append(backend.run_figures())


def run_offline_benchmark(
    config: OfflineConfig,
    requests: list[BenchRequest],
    workload: dict[str, Any] | None = None,
    log: Any = print,
    tokenizer: TokenizerLike | None = None,
) -> dict[str, Any]:
    """Run the backends on ``requests`` and return the offline result dict.

    Without ``compare`` each backend is loaded, measured ``num_rounds`` times and released
    before the next; with it all are loaded, then measured round-robin ``num_rounds`` times. Warm-ups
    are ``num_warmups`` requests with prompts of their own (``tokenizer`` gives them text
    when the workload has text).
    """
    meter = MemoryMeter(config.resolved_device)
    results: list[BackendResult] = []
    warmups = build_warmup_requests(requests, config.num_warmups, config.seed, tokenizer)
    if config.compare:
        loaded: list[tuple[OfflineBackend, BackendResult]] = []
        for name, kv_cache in config.rows:
            backend, result = _load(name, kv_cache, config, requests, meter)
            results.append(result)
            if backend is not None:
                if warmups:
                    backend.run(warmups)
                loaded.append((backend, result))
            else:
                log(f"[bench offline] skipping {result.label}: {result.skipped_reason}")
        for round_index in range(config.num_rounds):
            shift = round_index % max(len(loaded), 1)
            for backend, result in loaded[shift:] + loaded[:shift]:
                log(f"[bench offline] round {round_index + 1}/{config.num_rounds}: {result.label}")
                _measure(backend, requests, result, meter)
        for backend, _ in loaded:
            backend.close()
    else:
        for name, kv_cache in config.rows:
            backend, result = _load(name, kv_cache, config, requests, meter)
            results.append(result)
            if backend is None:
                log(f"[bench offline] skipping {result.label}: {result.skipped_reason}")
                continue
            if warmups:
                backend.run(warmups)
            for round_index in range(config.num_rounds):
                log(
                    f"[bench offline] measuring {result.label} (round {round_index + 1}/{config.num_rounds})"
                )
                _measure(backend, requests, result, meter)
            backend.close()
            del backend
            gc.collect()
    return _build_result(config, results, meter.kind, workload)


def _median_ratios(results: list[BackendResult]) -> dict[str, float | None]:
    """Per row label, the median over rounds of its throughput over the baseline's in that round."""
    measured = [r for r in results if r.skipped_reason is None and r.rounds]
    if not measured:
        return {}
    base = measured[0]
    ratios: dict[str, float | None] = {}
    for r in measured:
        per_round = []
        for (recs, d), (base_recs, base_d) in zip(r.rounds, base.rounds, strict=False):
            base_tps = sum(x.output_tokens for x in base_recs if x.success) / base_d
            tps = sum(x.output_tokens for x in recs if x.success) / d
            if base_tps > 0:
                per_round.append(tps / base_tps)
        ratios[r.label] = statistics.median(per_round) if per_round else None
    return ratios


def _build_result(
    config: OfflineConfig,
    results: list[BackendResult],
    memory_kind: str,
    workload: dict[str, Any] | None,
) -> dict[str, Any]:
    ratios = _median_ratios(results)
    rows = []
    for r in results:
        row = r.summary(memory_kind)
        row["throughput_ratio_vs_baseline"] = ratios.get(r.label)
        rows.append(row)
    return {
        "kind": "offline",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": config.model,
        "device": config.resolved_device,
        "dtype": config.dtype,
        "kv_cache": list(config.kv_caches),
        "batch_size": config.batch_size,
        "engine_kwargs": dict(config.engine_kwargs),
        "ignore_eos": config.ignore_eos,
        "compare": config.compare,
        "num_rounds": max((len(r.rounds) for r in results), default=0),
        "torch_num_threads": torch.get_num_threads(),
        "workload": workload or {},
        "backends": rows,
    }


def _compile_cell(compile_s: float, cache: str | None) -> str:
    """``12.3 cold`` / ``1.4 warm``: a warm start is not comparable with a cold one."""
    return f"{compile_s:.1f}" if cache in (None, "none") else f"{compile_s:.1f} {cache}"


def format_offline_table(result: dict[str, Any]) -> str:
    """One row per backend: throughput, latency, memory, start-up, and the ratio to the first."""
    header = (
        "backend",
        "out tok/s",
        "req/s",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "TPOT p50 ms",
        "TPOT p95 ms",
        "peak mem MiB",
        "KV waste",
        "load s",
        "compile s",
        "x baseline",
    )
    lines: list[tuple[str, ...]] = []  # a skipped backend's row has two cells
    for row in result["backends"]:
        if row.get("skipped"):
            lines.append((row["label"], f"skipped: {row['note']}"))
            continue
        ratio = row.get("throughput_ratio_vs_baseline")
        compile_s = row.get("compile_time_s")
        kv_waste = row.get("kv_waste")
        lines.append(
            (
                row["label"],
                f"{row['output_throughput']:.1f}",
                f"{row['request_throughput']:.2f}",
                f"{row['median_ttft_ms']:.1f}",
                f"{row['p95_ttft_ms']:.1f}",
                f"{row['median_tpot_ms']:.2f}",
                f"{row['p95_tpot_ms']:.2f}",
                f"{row['peak_memory_bytes'] / 2**20:.0f}",
                "-" if kv_waste is None else f"{100 * kv_waste:.1f}%",
                f"{row['load_s']:.1f}",
                "-" if compile_s is None else _compile_cell(compile_s, row.get("compile_cache")),
                "n/a" if ratio is None else f"{ratio:.2f}x",
            )
        )
    widths = [
        max([len(header[i])] + [len(ln[i]) for ln in lines if len(ln) == len(header)])
        for i in range(len(header))
    ]
    out = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for ln in lines:
        if len(ln) == 2:
            out.append(f"{ln[0].ljust(widths[0])}  {ln[1]}")
        else:
            out.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(ln, widths, strict=True))
                )
            )
    num_rounds = result.get("num_rounds", 1)
    mode = (
        f"interleaved, {num_rounds} rounds"
        if result.get("compare")
        else (f"sequential, {num_rounds} rounds each" if num_rounds > 1 else "sequential")
    )
    out.append(
        f"({result['device']}, {result['dtype']}, {mode}; memory = {result['backends'][0].get('memory_kind', 'rss')} "
        "growth while loading plus peak growth while running; KV waste = reserved KV slots not holding a "
        "token, averaged over steps; load s includes compiling; compile s says whether inductor's "
        "cache was warm or cold)"
    )
    for row in result["backends"]:
        if row.get("precision"):
            shown = ", ".join(f"{k}={v}" for k, v in sorted(row["precision"].items()))
            out.append(f"{row['label']} ran {shown}")
    return "\n".join(out)
