"""The two workloads of the tune benchmark, written as Mooncake-format JSONL traces.

``interactive``: chat turns: short prompts, Poisson arrivals, answers of a few sentences (tight
TTFT and TPOT: the user reads the answer as it streams). ``batch``: long prompts sharing a few
document prefixes (``hash_ids``), arriving in bursts, short answers (loose latency). Seeded, so
every run tunes on the same traffic.

    python benchmarks/tune_traces.py --out-dir /tmp/tune-traces [--num-requests 100] [--batch-requests 64]
        [--interactive-rate 0.4] [--burst-size 16] [--burst-gap-s 30]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tokenmill.tune.trace import Trace, TraceRequest, write_jsonl_trace


def interactive_trace(
    num_requests: int,
    rate: float = 0.4,
    input_range: tuple[int, int] = (16, 128),
    output_range: tuple[int, int] = (96, 192),
    seed: int = 1,
) -> Trace:
    """Poisson arrivals at ``rate``/s, ``input_range`` prompt tokens, ``output_range`` answer
    tokens: about two streams at once on a 2-core machine, where decode speed decides TPOT.

    Short answers (16-64 tokens) made a trace where prefill decided everything and no setting
    beat the default; a higher rate ran two cores at capacity, where p95 TPOT moved 3x between
    windows of one trace (docs/benchmarks.md)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, num_requests))
    t -= t[0]
    requests = tuple(
        TraceRequest(
            float(ts * 1000),
            int(rng.integers(input_range[0], input_range[1] + 1)),
            int(rng.integers(output_range[0], output_range[1] + 1)),
        )
        for ts in t
    )
    return Trace(requests, "interactive", {"rate": rate})


def batch_trace(
    num_requests: int,
    burst_size: int = 16,
    burst_gap_s: float = 30.0,
    input_range: tuple[int, int] = (512, 1536),
    output_range: tuple[int, int] = (32, 128),
    seed: int = 2,
) -> Trace:
    """Bursts of ``burst_size`` requests every ``burst_gap_s``: prompts of ``input_range``
    tokens over four shared 512-token document prefixes, ``output_range`` output tokens."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num_requests):
        burst, within = divmod(i, burst_size)
        ts_ms = burst * burst_gap_s * 1000 + within * float(rng.uniform(0, 40))
        doc = int(rng.integers(0, 4))
        input_length = int(rng.integers(input_range[0], input_range[1] + 1))
        output_length = int(rng.integers(output_range[0], output_range[1] + 1))
        requests.append(TraceRequest(ts_ms, input_length, output_length, (doc,)))
    requests.sort(key=lambda r: r.timestamp_ms)
    return Trace(tuple(requests), "batch", {"burst_size": burst_size})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--batch-requests", type=int, default=64)
    parser.add_argument("--interactive-rate", type=float, default=0.4, help="arrivals per second")
    parser.add_argument("--burst-size", type=int, default=16, help="batch requests per burst")
    parser.add_argument("--burst-gap-s", type=float, default=30.0, help="seconds between bursts")
    args = parser.parse_args()
    for name, trace in (
        ("interactive", interactive_trace(args.num_requests, rate=args.interactive_rate)),
        ("batch", batch_trace(args.batch_requests, args.burst_size, args.burst_gap_s)),
    ):
        path = write_jsonl_trace(trace, args.out_dir / f"{name}.jsonl")
        print(f"{path}: {trace.describe()}")


if __name__ == "__main__":
    main()
