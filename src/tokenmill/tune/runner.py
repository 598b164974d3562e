"""Measuring one candidate for real: start its server, replay the trace, read the figures.

A candidate's server runs as a ``tokenmill serve`` subprocess on loopback, started once and
kept for all of its replays (halving rung and rounds); the trace is replayed by ``bench
serve`` at its recorded arrival times. Each round gets prompts of its own (token ids
salted by the round), so a prefix cache shares only what the trace marks as shared
(``hash_ids``) and never carries one round's KV into the next.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.serve import ServeConfig, quiet_library_loggers, run_serve_benchmark
from tokenmill.tune.candidates import REDUCED_PRECISION_KEYS, Candidate
from tokenmill.tune.trace import HASH_BLOCK_TOKENS, Trace, TraceRequest

SLA_TO_GOODPUT = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "itl": None}

FIGURE_KEYS = (
    "request_goodput",
    "request_throughput",
    "output_throughput",
    "completed",
    "failed",
    "duration",
    "mean_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p95_tpot_ms",
    "p99_tpot_ms",
    "p95_itl_ms",
    "p95_e2el_ms",
)
"""The summary figures a replay keeps in ``result.json``."""


def goodput_slos(sla: dict[str, float]) -> dict[str, float]:
    """Per-request bounds for goodput from the SLA's percentile bounds (``p95_ttft_ms`` -> ``ttft``)."""
    out = {}
    for key, limit in sla.items():
        metric = key.split("_")[1]
        if SLA_TO_GOODPUT.get(metric):
            out[metric] = limit
    return out


def _block_tokens(hash_id: int, salt: int, vocab: np.ndarray) -> np.ndarray:
    seed = int.from_bytes(
        hashlib.blake2b(f"{hash_id}/{salt}".encode(), digest_size=8).digest(), "little"
    )
    return np.random.default_rng(seed).choice(vocab, HASH_BLOCK_TOKENS)


def build_bench_requests(
    trace: Trace, vocab: np.ndarray, round_index: int, seed: int = 0
) -> list[BenchRequest]:
    """The trace's requests as prompts: its text where it has some, else token ids.

    Requests naming the same ``hash_ids`` block start with the same tokens; the rest of
    each prompt is its own. ``round_index`` salts every token, so rounds share nothing.
    """
    rng = np.random.default_rng([seed, round_index])
    out = []
    for r in trace.requests:
        if r.prompt is not None or r.messages:
            out.append(_text_request(r, round_index))
            continue
        shared = [_block_tokens(h, round_index, vocab) for h in r.hash_ids]
        ids = np.concatenate([*shared, np.empty(0, dtype=vocab.dtype)])[: r.input_length]
        rest = rng.choice(vocab, max(0, r.input_length - len(ids)))
        prompt = np.concatenate([ids, rest]).astype(int).tolist()
        out.append(BenchRequest(len(prompt), r.output_length, prompt_token_ids=prompt))
    return out


def _text_request(r: TraceRequest, round_index: int) -> BenchRequest:
    text = r.prompt
    if text is None:
        text = "\n".join(str(m.get("content", "")) for m in r.messages or ())
    if round_index:  # keeps a prefix cache from serving one round with the previous one's KV
        text = f"[{round_index}] {text}"
    return BenchRequest(r.input_length, r.output_length, prompt_text=text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """A candidate's server exited or never became healthy."""


@dataclass
class ServerProcess:
    """One ``tokenmill serve`` subprocess on loopback."""

    model: str
    args: list[str]
    log_path: Path
    start_timeout_s: float = 600.0
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> ServerProcess:
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self._wait_healthy()
        except BaseException:  # Ctrl-C or SIGTERM while it starts: no server left behind
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-800:]
                raise ServerStartError(
                    f"server exited with {self.process.returncode}: {tail.strip()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise ServerStartError(f"server not healthy after {self.start_timeout_s:g}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class TraceRunner:
    """Measures candidates on ``trace``: the ``MeasureFn`` of the search."""

    model: str
    trace: Trace
    sla: dict[str, float]
    vocab: np.ndarray
    out_dir: Path
    base_args: list[str] = field(default_factory=list)
    """Flags every candidate's server gets (``--max-model-len``, ...)."""
    time_scale: float = 1.0
    """2 replays the trace twice as slow, 0.5 twice as fast."""
    request_timeout_s: float = 300.0
    num_warmups: int = 2
    """Uncounted requests before each replay (the first requests of a server compile kernels)."""
    seed: int = 0
    _server: ServerProcess | None = None
    _server_key: str | None = None

    def serve_args(self, candidate: Candidate) -> list[str]:
        return [*self.base_args, *candidate.serve_args()]

    def _server_for(self, candidate: Candidate) -> ServerProcess:
        if self._server is not None and self._server_key == candidate.key:
            return self._server
        self.close()
        name = candidate.key.replace("/", "_").replace(",", "+").replace(":", "-")
        server = ServerProcess(
            self.model, self.serve_args(candidate), self.out_dir / "logs" / f"{name[:120]}.log"
        )
        self._server = server.start()
        self._server_key = candidate.key
        return server

    def __call__(self, candidate: Candidate, num_requests: int, round_index: int) -> dict[str, Any]:
        server = self._server_for(candidate)
        sample = self.trace.sample(num_requests, self.seed)
        requests = build_bench_requests(sample, self.vocab, round_index, self.seed)
        config = ServeConfig(
            base_url=server.base_url,
            arrival_offsets_s=tuple(sample.arrival_offsets_s(self.time_scale)),
            goodput_slos_ms=goodput_slos(self.sla),
            request_timeout_s=self.request_timeout_s,
            ignore_eos=True,
            num_warmups=self.num_warmups,
            show_progress=False,
            label=candidate.key,
        )
        cpu_before = time.process_time()
        with quiet_library_loggers():
            result = run_serve_benchmark(config, requests)
        figures = {k: result.get(k) for k in FIGURE_KEYS}
        # how long the arrivals took: a replay lasting far longer served a backlog
        figures["arrival_span_s"] = round(max(config.arrival_offsets_s or (), default=0.0), 3)
        figures["client_cpu_s"] = round(time.process_time() - cpu_before, 3)
        metrics = result.get("server_metrics") or {}
        figures["peak_resident_memory_bytes"] = metrics.get("peak_resident_memory_bytes")
        figures["peak_kv_cache_usage"] = metrics.get("peak_kv_cache_usage")
        figures["num_preemptions"] = metrics.get("num_preemptions")
        return figures

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = self._server_key = None


def verify_precision(
    model: str,
    candidate: Candidate,
    texts: list[str] | None,
    max_tokens: int,
    num_prompts: int,
    base_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The correctness gate's figures for ``candidate``'s precision (``bench verify --precision``)."""
    from tokenmill.bench.verify import run_precision_check

    kwargs = {**(base_kwargs or {})}
    kwargs.update(
        {
            k: v
            for k, v in candidate.options.items()
            if k in REDUCED_PRECISION_KEYS and v is not None
        }
    )
    try:
        report = run_precision_check(
            model, kwargs, max_tokens=max_tokens, texts=texts, num_prompts=num_prompts, min_top1=0.0
        )
    except Exception as exc:  # a precision the engine refuses is rejected, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    data = report.to_dict()
    data.pop("passed", None)
    data.pop("min_top1", None)
    return data
