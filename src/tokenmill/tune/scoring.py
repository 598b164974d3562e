"""How a candidate's replays stand: against the SLA (with room, narrowly, or missing it), as
sort keys for the halving and the decision, and against each other (spread, ties, backlog).

Pure functions of recorded figures (``bench serve`` summaries); the search's cuts,
refinement and decision (``cut.py``, ``refine.py``, ``decision.py``) rank with them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from tokenmill.bench.sla import check_sla

GOODPUT_KEY = "request_goodput"
"""Requests per second that met every latency bound of the SLA."""

PEAK_RSS_KEY = "peak_resident_memory_bytes"
"""The server's peak resident memory over a replay, where its ``/metrics`` reports one."""


def peak_rss(figures: Iterable[dict[str, Any]]) -> int | None:
    """The highest peak resident memory these replays report (None where none does): what a
    candidate is measured to hold, where the plan gives only an upper bound."""
    peaks = [int(f[PEAK_RSS_KEY]) for f in figures if f.get(PEAK_RSS_KEY)]
    return max(peaks) if peaks else None


MISSES, MEETS_NARROWLY, MEETS_WITH_ROOM = 0, 1, 2
"""How a candidate's rounds stand against the SLA (``sla_standing``), worst to best."""


def bound_rooms(figures: list[dict[str, Any]], sla: dict[str, float]) -> dict[str, float]:
    """Each bound's room in the worst round, as a fraction of the bound (0.3 = 30% under it,
    negative when over, -inf when a round did not measure it)."""
    rooms = {}
    for key, limit in sla.items():
        if limit <= 0 or not figures:
            continue
        if any(f.get(key) is None for f in figures):
            rooms[key] = -math.inf
        else:
            rooms[key] = (limit - max(float(f[key]) for f in figures)) / limit
    return rooms


def sla_standing(figures: list[dict[str, Any]], sla: dict[str, float], margin: float) -> int:
    """``MISSES`` unless every round meets every bound; ``MEETS_WITH_ROOM`` when each bound's
    worst round is at least ``margin`` under it and at least that figure's own spread over the
    rounds (the next replay can move it that far); ``MEETS_NARROWLY`` otherwise."""
    if not figures or any(check_sla(f, sla) for f in figures):
        return MISSES
    return MEETS_NARROWLY if short_of_room(figures, sla, margin) else MEETS_WITH_ROOM


def short_of_room(
    figures: list[dict[str, Any]], sla: dict[str, float], margin: float
) -> list[tuple[str, float, float]]:
    """``(bound, room, room needed)`` for each bound whose worst round has less room than
    ``margin`` or than that figure's spread over the rounds, tightest first."""
    short = []
    for key, room in bound_rooms(figures, sla).items():
        values = [f.get(key) for f in figures]
        spread = relative_spread([float(v) for v in values if v is not None])
        need = max(margin, spread)
        if room < need:
            short.append((key, room, need))
    return sorted(short, key=lambda t: t[1] - t[2])


def describe_short_of_room(short: list[tuple[str, float, float]]) -> str:
    """``short_of_room``'s answer in words."""
    return "; ".join(
        f"{key} {room:.1%} under its bound (needs {need:.0%})" for key, room, need in short
    )


def score_of(
    figures: list[dict[str, Any]], sla: dict[str, float], margin: float
) -> tuple[int, float, float]:
    """Sort key (higher is better): the SLA standing (``sla_standing``), mean goodput, mean
    throughput."""
    if not figures:
        return (MISSES, -math.inf, -math.inf)
    goodput = statistics.fmean(float(f.get(GOODPUT_KEY) or 0.0) for f in figures)
    throughput = statistics.fmean(float(f.get("output_throughput") or 0.0) for f in figures)
    return (sla_standing(figures, sla, margin), goodput, throughput)


def rung_score(
    figures: list[dict[str, Any]], sla: dict[str, float], margin: float
) -> tuple[int, float, int, float, float]:
    """Halving's sort key (higher is better): meets the SLA in every round, the share of
    requests that met every bound, meets it with room (``sla_standing``), the room left
    under the SLA, mean goodput.

    On a short window that every candidate serves inside its bounds, goodput in requests/s
    is the window's requests over how long the last answer took: a few seconds apart, noise.
    The room under the bounds is what predicts the next, longer rung, where the load is
    higher: on a batch trace, ``--max-num-seqs 4`` ran p95 TPOT at half the default's on a
    16-request window and lost that rung to goodputs 5-9% higher; the full trace then
    missed the TPOT bound with every candidate left."""
    if not figures:
        return (0, -math.inf, MISSES, -math.inf, -math.inf)
    standing, goodput, _ = score_of(figures, sla, margin)
    return (int(standing != MISSES), _met_share(figures), standing, _room(figures, sla), goodput)


BACKLOG_FACTOR = 2.0
"""A replay that lasted more than this many times its arrival span spent most of it draining
a queue: the sample was backlogged."""


def is_backlogged(figures: dict[str, Any]) -> bool:
    """Whether a replay served a backlog: it lasted over ``BACKLOG_FACTOR`` times the span of its
    arrivals (a burst's span is ~0). Figures without an ``arrival_span_s`` are not judged.

    A sample replayed from an empty server under-states the queueing of the whole trace,
    whose later requests wait behind the earlier ones' backlog; by how much depends on each
    candidate's capacity and admission limits, so a sample cannot rank them: on a bursty
    batch trace, ``--max-num-seqs 4`` held p95 TTFT 33% under the bound on a 16-request
    sample and went 8-16% over it on the whole trace (32 requests)."""
    span, duration = figures.get("arrival_span_s"), figures.get("duration")
    if span is None or duration is None:
        return False
    return float(duration) > BACKLOG_FACTOR * float(span)


def _met_share(figures: list[dict[str, Any]]) -> float:
    """Mean fraction of completed requests inside every bound (goodput over throughput), to
    three places so that rounds where all met compare equal."""
    shares = []
    for f in figures:
        served = float(f.get("request_throughput") or 0.0)
        shares.append(float(f.get(GOODPUT_KEY) or 0.0) / served if served > 0 else 0.0)
    return round(statistics.fmean(shares), 3)


def _room(figures: list[dict[str, Any]], sla: dict[str, float]) -> float:
    """Mean over rounds of the smallest relative margin under a bound: 0.3 = 30% under the
    tightest one, negative when over; -inf when a bound's figure is missing."""
    rooms = []
    for f in figures:
        margins = [
            (limit - float(f[key])) / limit if f.get(key) is not None else -math.inf
            for key, limit in sla.items()
            if limit > 0
        ]
        rooms.append(min(margins, default=0.0))
    return statistics.fmean(rooms)


def relative_spread(values: list[float]) -> float:
    """(max - min) / mean; 0 for fewer than two values or a zero mean."""
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean > 0 else 0.0


def is_tie(a: list[float], b: list[float], margin: float = 0.0) -> bool:
    """Two candidates' round values overlap (the difference is inside the measured spread),
    or their means are within ``margin`` (relative to the larger) of each other: below the
    resolution that matters, however steady each candidate's rounds are."""
    if not (a and b):
        return False
    if min(a) <= max(b) and min(b) <= max(a):
        return True
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    return abs(mean_a - mean_b) <= margin * max(mean_a, mean_b)
