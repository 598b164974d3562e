"""Arrival schedules: the mean rate holds, burstiness shapes the spread, seeds replay."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tokenmill.bench.arrivals import build_arrival_offsets_s, build_inter_arrival_gaps_s


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_rate_is_the_requested_rate(burstiness: float) -> None:
    rate = 5.0
    gaps = np.array(build_inter_arrival_gaps_s(20001, rate, burstiness, seed=1))
    # Standard error of the mean gap is 0.2/sqrt(burstiness * 20000) <= 0.002, so 4% is > 4 sigma.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    # Gamma(k): coefficient of variation 1/sqrt(k); Poisson (k=1) has exponential gaps.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_poisson_counts_per_second_have_mean_equal_variance() -> None:
    rate = 8.0
    offsets = np.array(build_arrival_offsets_s(40000, rate, 1.0, seed=3))
    counts = np.bincount(offsets.astype(int))[:-1]  # drop the partial last second
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() == pytest.approx(rate, rel=0.08)


def test_offsets_start_at_zero_and_never_go_back() -> None:
    offsets = build_arrival_offsets_s(100, 10.0, 1.0, seed=0)
    assert offsets[0] == 0.0 and len(offsets) == 100
    assert all(b >= a for a, b in itertools.pairwise(offsets))


def test_seed_replays_and_differs() -> None:
    assert build_arrival_offsets_s(50, 3.0, seed=7) == build_arrival_offsets_s(50, 3.0, seed=7)
    assert build_arrival_offsets_s(50, 3.0, seed=7) != build_arrival_offsets_s(50, 3.0, seed=8)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert build_arrival_offsets_s(5, math.inf) == [0.0] * 5
    assert build_arrival_offsets_s(0, 1.0) == []


@pytest.mark.parametrize(
    ("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)]
)
def test_bad_parameters_are_rejected(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        build_inter_arrival_gaps_s(10, rate, burstiness)
