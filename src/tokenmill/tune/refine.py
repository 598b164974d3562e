"""Where to look between measured values: two settings of one numeric option that fall short
of the SLA on different bounds bracket a trade-off, and a value between them may meet both.
Pure: the search hands in how a candidate falls short and how it scores."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any

from tokenmill.tune.candidates import Candidate
from tokenmill.tune.state import CandidateState

REFINABLE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens")
"""Numeric options whose values trade one latency bound against another (queueing against
per-token time): the refinement tries values between two measured ones."""


def find_bracket(
    measured: list[CandidateState],
    short: Callable[[CandidateState], set[str]],
    score: Callable[[CandidateState], tuple[Any, ...]],
    resolved: Mapping[str, Any],
    done: set[str],
) -> tuple[CandidateState, CandidateState, Candidate] | None:
    """A pair of neighbouring values of one option (all other settings equal) that fall
    short on disjoint sets of bounds, and the candidate with the value between; None when no
    such pair has an untried value between. Of several, the one whose new candidate has
    the fewest non-default flags, then whose better member scores higher: on the batch
    trace ``--max-num-seqs`` 4 and 32 bracket alone and with ``--quantization int8``,
    whose 32 had 1% more goodput in one replay, and a tie would go to the plain flag."""
    best: tuple[Any, ...] | None = None
    for option in REFINABLE_OPTIONS:
        groups: dict[tuple[tuple[str, Any], ...], list[tuple[int, CandidateState]]] = {}
        for s in measured:
            value = s.candidate.options.get(option)
            if value is None:  # the server decides: what it decides here
                value = resolved.get(option)
            if isinstance(value, int) and not isinstance(value, bool):
                rest = tuple(kv for kv in s.candidate.settings if kv[0] != option)
                groups.setdefault(rest, []).append((value, s))
        for members in groups.values():
            members.sort(key=lambda m: m[0])
            for (a, low), (b, high) in pairwise(members):
                short_low, short_high = short(low), short(high)
                if not short_low or not short_high or short_low & short_high:
                    continue
                value = between(a, b)
                if value is None:
                    continue
                candidate = low.candidate.replace(**{option: value})
                if candidate.key in done:
                    continue
                # the simpler candidate first (a tie would go to it), then the pair's best
                rank = (
                    -candidate.num_non_default,
                    max(score(low), score(high)),
                )
                if best is None or rank > best[0]:
                    best = (rank, low, high, candidate)
    return None if best is None else (best[1], best[2], best[3])


def between(low: int, high: int) -> int | None:
    """A value strictly between two integers, near their geometric mean: the power of two
    closest to it (the larger on a tie), else the mean rounded; None when none lies between.
    Batch sizes and token budgets scale by factors, so the middle of 4 and 32 is 16 (or 8),
    not 18."""
    if high - low < 2 or low < 1:
        return None
    middle = math.log2(math.sqrt(low * high))
    powers = [1 << e for e in range(int(math.log2(low)) + 1, int(math.log2(high)) + 1)]
    powers = [p for p in powers if low < p < high]
    if powers:
        return min(powers, key=lambda p: (abs(math.log2(p) - middle), -p))
    value = round(math.sqrt(low * high))
    return value if low < value < high else None
