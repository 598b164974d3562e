"""Request arrival schedules: when each benchmark request is sent.

Same process as vLLM's ``bench serve``: inter-arrival gaps are drawn from a gamma
distribution with shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so the mean
rate is ``rate`` whatever the burstiness. Burstiness 1 is a Poisson process (exponential
gaps); below 1 requests come in bursts, above 1 they are more evenly spaced. An infinite
rate sends everything at once. Seeded, so a workload replays identically.
"""

from __future__ import annotations

import math

import numpy as np


def build_inter_arrival_gaps_s(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Gaps in seconds before each request after the first (``num_requests - 1`` values)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    num_gaps = max(num_requests - 1, 0)
    if math.isinf(request_rate):
        return [0.0] * num_gaps
    rng = np.random.default_rng(seed)
    scale_s = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=scale_s, size=num_gaps).tolist()


def build_arrival_offsets_s(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Send time of each request in seconds after the start; the first is sent at 0."""
    if num_requests == 0:
        return []
    gaps_s = build_inter_arrival_gaps_s(num_requests, request_rate, burstiness, seed)
    return [0.0, *np.cumsum(gaps_s).tolist()]
