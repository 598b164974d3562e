"""Workload traces: what requests arrived when, read from the formats teams already have.

The canonical shape is the Mooncake trace (one JSON object per line: ``timestamp`` in ms,
``input_length``, ``output_length``, optional ``hash_ids`` naming shared prefix blocks).
Lines may carry real prompts instead (``prompt`` or ``messages``); ShareGPT JSON files and
synthetic profiles (``random:N,in=..,out=..,rate=..``) are turned into the same records.
A bad line is refused with its line number, never skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.arrivals import build_arrival_offsets_s

HASH_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake format."""


class TraceError(ValueError):
    """A trace that cannot be read, with the file and line that broke it."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrived and its shape."""

    timestamp_ms: float
    """Arrival time in ms since the trace began."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...] = ()
    """Prefix blocks (``HASH_BLOCK_TOKENS`` each) shared with other requests of the same ids."""
    prompt: str | None = None
    """The prompt text, when the trace carries it."""
    messages: tuple[dict[str, Any], ...] | None = None
    """Chat messages, when the trace carries them."""

    def to_json(self) -> dict[str, Any]:
        """The Mooncake line (plus ``prompt``/``messages`` when present)."""
        out: dict[str, Any] = {
            "timestamp": round(self.timestamp_ms, 3),
            "input_length": self.input_length,
            "output_length": self.output_length,
        }
        if self.hash_ids:
            out["hash_ids"] = list(self.hash_ids)
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.messages is not None:
            out["messages"] = list(self.messages)
        return out


@dataclass(frozen=True)
class Trace:
    """A workload: requests in arrival order and where they came from."""

    requests: tuple[TraceRequest, ...]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last."""
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000

    def arrival_offsets_s(self, time_scale: float = 1.0) -> list[float]:
        """Send time of each request after the first; ``time_scale`` 2 replays twice as slow."""
        if not self.requests:
            return []
        t0 = self.requests[0].timestamp_ms
        return [(r.timestamp_ms - t0) / 1000 * time_scale for r in self.requests]

    def sample(self, num_requests: int, seed: int = 0) -> Trace:
        """A contiguous window of the trace (arrival pattern kept), rebased to start at 0."""
        if num_requests >= len(self.requests):
            return self
        rng = np.random.default_rng(seed)
        start = int(rng.integers(0, len(self.requests) - num_requests + 1))
        window = self.requests[start : start + num_requests]
        t0 = window[0].timestamp_ms
        rebased = tuple(_replace_ts(r, r.timestamp_ms - t0) for r in window)
        return Trace(rebased, self.source, {**self.meta, "sampled_from": len(self.requests)})

    def describe(self) -> dict[str, Any]:
        """Summary figures for the report."""
        ins = [r.input_length for r in self.requests]
        outs = [r.output_length for r in self.requests]
        return {
            "source": self.source,
            "num_requests": len(self.requests),
            "duration_s": round(self.duration_s, 3),
            "mean_input_length": round(float(np.mean(ins)), 1) if ins else 0,
            "mean_output_length": round(float(np.mean(outs)), 1) if outs else 0,
            "max_input_length": max(ins, default=0),
            "max_output_length": max(outs, default=0),
            "has_prompts": any(r.prompt is not None or r.messages for r in self.requests),
            "has_hash_ids": any(r.hash_ids for r in self.requests),
            **self.meta,
        }


def _replace_ts(r: TraceRequest, ts: float) -> TraceRequest:
    return TraceRequest(ts, r.input_length, r.output_length, r.hash_ids, r.prompt, r.messages)


def _positive_int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def _estimate_tokens(text: str) -> int:
    """Rough token count of text when the trace does not give one (4 characters a token)."""
    return max(1, len(text) // 4)


def parse_trace_line(obj: Any, where: str) -> TraceRequest:
    """One JSONL object into a request; ``where`` (``file:line``) names it in errors."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp", obj.get("timestamp_ms"))
    if ts is None or isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' (ms) must be a non-negative number, got {ts!r}")
    prompt = obj.get("prompt")
    messages = obj.get("messages")
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError(f"{where}: 'prompt' must be a string")
    if messages is not None and (
        not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages)
    ):
        raise TraceError(f"{where}: 'messages' must be a list of objects")
    if "input_length" in obj:
        input_length = _positive_int(obj, "input_length", where)
    elif prompt is not None:
        input_length = _estimate_tokens(prompt)
    elif messages is not None:
        input_length = _estimate_tokens(" ".join(str(m.get("content", "")) for m in messages))
    else:
        raise TraceError(f"{where}: needs 'input_length', 'prompt' or 'messages'")
    output_length = _positive_int(obj, "output_length", where)
    if output_length < 1:
        raise TraceError(f"{where}: 'output_length' must be >= 1")
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRequest(
        float(ts),
        input_length,
        output_length,
        tuple(hash_ids),
        prompt,
        tuple(messages) if messages is not None else None,
    )


def _sorted(requests: Iterable[TraceRequest]) -> tuple[TraceRequest, ...]:
    return tuple(sorted(requests, key=lambda r: r.timestamp_ms))


def load_jsonl_trace(path: str | Path) -> Trace:
    """A Mooncake-format (or prompt-carrying) JSONL trace; blank lines are allowed."""
    path = Path(path)
    requests = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            requests.append(parse_trace_line(obj, where))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return Trace(_sorted(requests), str(path), {"format": "jsonl"})


def load_sharegpt_trace(
    path: str | Path, num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0
) -> Trace:
    """A ShareGPT JSON file: first human turn as the prompt, the reply's length as the output.

    ShareGPT has no arrival times, so they are drawn (gamma gaps at ``rate`` per second).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a JSON list of conversations")
    pairs: list[tuple[str, str]] = []
    for index, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise TraceError(f"{path}: entry {index} has no 'conversations' list")
        texts = [t.get("value") for t in turns if isinstance(t, dict)]
        if len(texts) >= 2 and isinstance(texts[0], str) and isinstance(texts[1], str):
            pairs.append((texts[0], texts[1]))
        if len(pairs) >= num_requests:
            break
    if not pairs:
        raise TraceError(f"{path}: no conversation with a prompt and a reply")
    offsets = build_arrival_offsets_s(len(pairs), rate, burstiness, seed)
    requests = [
        TraceRequest(t * 1000, _estimate_tokens(p), _estimate_tokens(r), prompt=p)
        for t, (p, r) in zip(offsets, pairs, strict=True)
    ]
    return Trace(tuple(requests), str(path), {"format": "sharegpt", "rate": rate})


def _int_range(text: str, key: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise TraceError(f"synthetic profile: {key}={text!r} is not N or LOW-HIGH") from None
    if lo < 1 or hi < lo:
        raise TraceError(f"synthetic profile: {key}={text!r} must be 1 <= LOW <= HIGH")
    return lo, hi


SYNTHETIC_KEYS = ("n", "in", "out", "rate", "burstiness", "prefix", "seed")


def build_synthetic_trace(spec: str) -> Trace:
    """``random:n=200,in=32-256,out=16-128,rate=4,burstiness=1,prefix=0`` into a trace.

    Lengths are drawn uniformly; arrivals are gamma gaps (vLLM's process); ``prefix`` is
    the number of distinct shared prefixes (0: none), marked in ``hash_ids``.
    """
    _, _, body = spec.partition(":")
    values: dict[str, str] = {"n": "100", "in": "128", "out": "64", "rate": "inf"}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in SYNTHETIC_KEYS:
            raise TraceError(
                f"synthetic profile: bad term {item!r} (keys: {', '.join(SYNTHETIC_KEYS)})"
            )
        values[key] = value
    try:
        n = int(values["n"])
        rate = float(values["rate"])
        burstiness = float(values.get("burstiness", "1"))
        num_prefixes = int(values.get("prefix", "0"))
        seed = int(values.get("seed", "0"))
    except ValueError as exc:
        raise TraceError(f"synthetic profile: {exc}") from None
    if n < 1:
        raise TraceError("synthetic profile: n must be >= 1")
    in_range, out_range = _int_range(values["in"], "in"), _int_range(values["out"], "out")
    rng = np.random.default_rng(seed)
    offsets = build_arrival_offsets_s(n, rate, burstiness, seed)
    requests = []
    for t in offsets:
        input_length = int(rng.integers(in_range[0], in_range[1] + 1))
        hash_ids: tuple[int, ...] = ()
        if num_prefixes > 0:
            hash_ids = (int(rng.integers(0, num_prefixes)),)
        requests.append(
            TraceRequest(
                t * 1000, input_length, int(rng.integers(out_range[0], out_range[1] + 1)), hash_ids
            )
        )
    return Trace(tuple(requests), spec, {"format": "synthetic"})


def load_trace(spec: str, *, num_requests: int = 1000, rate: float = 1.0, seed: int = 0) -> Trace:
    """Any workload the CLI takes: ``random:...``, a ShareGPT ``.json``, or a JSONL trace."""
    if spec.startswith("random:") or spec == "random":
        return build_synthetic_trace(spec)
    path = Path(spec)
    if not path.is_file():
        raise TraceError(f"{spec}: no such trace file (or give a synthetic profile 'random:...')")
    if path.suffix == ".json":
        return load_sharegpt_trace(path, num_requests, rate, seed=seed)
    return load_jsonl_trace(path)


def write_jsonl_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as Mooncake JSONL."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in trace.requests:
            f.write(json.dumps(r.to_json()) + "\n")
    return out
