"""The refinement: where no candidate meets the SLA with room, look between measured values.

Two settings of one numeric option that fall short of the SLA on different bounds bracket a
trade-off (queueing against per-token time), and a value between them may meet both: the
space holds few values of an option, and on the batch trace of 2026-12-07 none lay between
the two that missed. ``refine`` is the step the halving takes after its last cut: it adds
the value between, measures it, and cuts again. ``find_bracket`` and ``between`` choose the
pair and the value; they are pure, handed how a candidate falls short and how it scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from tokenmill.tune.candidates import Candidate
from tokenmill.tune.cut import cut
from tokenmill.tune.scoring import MEETS_WITH_ROOM, short_of_room
from tokenmill.tune.state import CandidateState, TuneState

if TYPE_CHECKING:
    from tokenmill.tune.search import Search

REFINABLE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens")
"""Numeric options whose values trade one latency bound against another (queueing against
per-token time): the refinement tries values between two measured ones."""


def refine(
    search: Search, alive: list[CandidateState], size: int, keep: int, where: str
) -> list[CandidateState]:
    """Tries values between two that fall short on different bounds; re-cuts with them.

    Runs only while no candidate measured at ``size`` meets the SLA with room, for at most
    ``refine_steps`` candidates, and (on the whole trace) only while the budget covers the
    finalists' rounds after it. Each new candidate is replayed once at ``size`` and
    ranked with the survivors of the last cut, by the same rule."""
    whole = size >= search.num_trace_requests
    tried: list[CandidateState] = []
    done: set[str] = set()
    notes: list[str] = []
    for _ in range(search.settings.refine_steps):
        # refined candidates a resumed search holds count once asked for again, so that
        # it retraces the same steps
        measured = [
            s
            for s in _measured_at(search.state, size)
            if s.origin == "space" or s.candidate.key in done
        ]
        if any(search.score(s, size)[0] == MEETS_WITH_ROOM for s in measured):
            break
        bracket = _bracket(search, measured, size, done)
        if bracket is None:
            break
        low, high, candidate = bracket
        if whole and search.short_of_time(size, search.finalist_replays() + 1):
            notes.append("stopped: the budget left was kept for the finalists' rounds")
            break
        done.add(candidate.key)
        state = search.state.candidates.get(candidate.key)
        if state is None:
            state = search.state.candidates[candidate.key] = CandidateState(
                candidate, origin="refined"
            )
        notes.append(
            f"{candidate.key} between {low.candidate.key} (short on "
            f"{_short_names(_short(search, low, size))}) and {high.candidate.key} (short on "
            f"{_short_names(_short(search, high, size))})"
        )
        if not _admit(search, state, low):
            continue
        if search.measure_once(state, size, 0):
            tried.append(state)
    if notes:
        search.state.meta["refinement"] = "; ".join(notes)
    if not tried:
        search.save_state()
        return alive
    return cut(search, [*alive, *tried], size, keep, where)


def _admit(search: Search, state: CandidateState, like: CandidateState) -> bool:
    """Plans a refined candidate (a resumed one already holds its plan) and takes the
    correctness check of the candidate it was derived from: the same precision."""
    if state.memory_bytes is None and state.status == "pending":
        fits, state.memory_bytes, why = search.plan(state.candidate)
        if not fits:
            state.status, state.reason = "pruned", f"does not fit the memory: {why}"
    state.gate = state.gate or like.gate
    return state.status == "pending"


def _measured_at(state: TuneState, size: int) -> list[CandidateState]:
    """Candidates with a replay of ``size`` requests that still count (not failed)."""
    return [
        s
        for s in state.candidates.values()
        if s.rung_figures(size) and s.status not in ("failed", "rejected", "pruned")
    ]


def _short(search: Search, s: CandidateState, size: int) -> set[str]:
    return {
        key
        for key, _, _ in short_of_room(s.rung_figures(size), search.sla, search.settings.sla_margin)
    }


def _bracket(
    search: Search, measured: list[CandidateState], size: int, done: set[str]
) -> tuple[CandidateState, CandidateState, Candidate] | None:
    return find_bracket(
        measured,
        short=lambda s: _short(search, s, size),
        score=lambda s: search.score(s, size),
        resolved=search.resolved,
        done=done,
    )


def _short_names(keys: set[str]) -> str:
    return ", ".join(sorted(keys)) or "nothing"


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
