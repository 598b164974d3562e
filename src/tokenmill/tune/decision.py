"""The decision: the winner of what the search measured, the candidates tied with it, and why.

It reads only the record, so it decides the same way whether the search ran to the end or
the budget stopped it mid-halving: it ranks on the largest request count the contenders
were measured at.
A tie (inside the measured spread, or within ``tie_margin``) goes to the simpler, cheaper
configuration: a flag the user need not set is worth more than goodput no replay can
separate. Each candidate that lost is told why, in the words ``result.json`` and the report
show.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from tokenmill.bench.sla import check_sla
from tokenmill.tune.scoring import (
    MEETS_NARROWLY,
    MEETS_WITH_ROOM,
    MISSES,
    bound_rooms,
    describe_short_of_room,
    is_tie,
    short_of_room,
)
from tokenmill.tune.state import CandidateState, memory_of, simplicity_key

if TYPE_CHECKING:
    from tokenmill.tune.search import Search


def decide(search: Search, stopped_by_budget: bool) -> dict[str, Any]:
    """The winner, the candidates tied with it, and why; the tie goes to the simpler one."""
    settings = search.settings
    n = _best_rung(search)
    base = {"stopped_by_budget": stopped_by_budget, "sla": search.sla}
    if n is None:
        measured = any(
            s.rung_figures(m) for s in search.state.candidates.values() for m in _sizes(search)
        )
        reason = (
            "no candidate measured is left to choose: each failed a later run or lost on "
            "the whole trace to one that then failed"
            if measured
            else "nothing was measured within the budget"
        )
        return {**base, "winner": None, "reason": reason}
    contenders = _contenders(search, n)
    stable = [s for s in contenders if s.status != "unstable"] or contenders
    best = max(stable, key=lambda s: search.score(s, n))
    best_goodputs = search.goodputs(best, n)
    standing = search.score(best, n)[0]
    tied = [
        s
        for s in stable
        if s is not best
        and search.score(s, n)[0] == standing
        and is_tie(search.goodputs(s, n), best_goodputs, settings.tie_margin)
    ]
    winner = min([best, *tied], key=simplicity_key)
    for s in contenders:
        if s.status in ("pending", "finalist"):
            s.status = "lost"
            s.reason = s.reason or _loss_reason(search, s, winner, n)
    for s in tied:
        if s is not winner:
            s.status = "tied"
            s.reason = (
                f"tied with {winner.candidate.key} (within the measured spread or "
                f"{settings.tie_margin:.0%}); the simpler/cheaper one wins"
            )
    if best is not winner:
        best.status = "tied"
        best.reason = (
            f"highest mean goodput but inside {winner.candidate.key}'s spread or "
            f"{settings.tie_margin:.0%} of it; "
            "the tie goes to the configuration with fewer flags and less memory"
        )
    winner.status, winner.reason = "winner", ""
    note = ""
    if tied:
        names = ", ".join(s.candidate.key for s in [best, *tied] if s is not winner)
        num_bytes, what = memory_of(winner)
        note = (
            f"tied with {names} (their goodput ranges over rounds overlap, or their "
            f"means are within {settings.tie_margin:.0%}); chose "
            f"{winner.candidate.key}: {winner.candidate.num_non_default} non-default flags"
            + (f", {num_bytes} bytes {what}" if num_bytes else "")
        )
    figures = winner.rung_figures(n)
    if standing == MISSES:
        reason = "no candidate met the SLA; this one came closest"
    elif standing == MEETS_NARROWLY:
        short = short_of_room(figures, search.sla, settings.sla_margin)
        reason = (
            f"met every bound in every round, but narrowly: {describe_short_of_room(short)}; "
            "no candidate met the SLA with room, and a re-measure may miss it"
        )
    else:
        reason = ""
    return {
        **base,
        "winner": winner.candidate.key,
        "meets_sla": standing != MISSES,
        "meets_sla_with_room": standing == MEETS_WITH_ROOM,
        "sla_margin": settings.sla_margin,
        "tie_margin": settings.tie_margin,
        "sla_room": {k: round(v, 4) for k, v in bound_rooms(figures, search.sla).items()},
        "measured_on_requests": n,
        "goodput_rounds": search.goodputs(winner, n),
        "tied_with": [s.candidate.key for s in [best, *tied] if s is not winner],
        "tie_note": note,
        "serve_args": winner.candidate.serve_args(),
        "reason": reason,
    }


def _contenders(search: Search, n: int) -> list[CandidateState]:
    """The candidates measured at ``n`` requests that may still win: not failed, and not
    eliminated by the whole trace (one eliminated on a sample rung may, if nothing measured
    on more requests stands)."""
    return [
        s
        for s in search.state.candidates.values()
        if s.rung_figures(n)
        and s.status in ("pending", "finalist", "unstable", "eliminated")
        and (n != search.num_trace_requests or s.status != "eliminated")
    ]


def _sizes(search: Search) -> list[int]:
    """The request counts a decision may rank on, largest first: the full trace, then the
    rungs."""
    return [search.num_trace_requests, *reversed(search.rungs())]


def _best_rung(search: Search) -> int | None:
    """The largest request count every contender was measured at (full trace first), among
    those where a contender stands; None where none does (nothing measured, or every
    candidate measured failed later: a count whose only figures are a failed candidate's
    has nobody to rank)."""
    sizes = _sizes(search)
    for n in sizes:
        if any(s.status in ("finalist", "unstable") for s in _contenders(search, n)):
            return n
    for n in sizes:
        if _contenders(search, n):
            return n
    return None


def _loss_reason(search: Search, s: CandidateState, winner: CandidateState, n: int) -> str:
    misses = [m for f in s.rung_figures(n) for m in check_sla(f, search.sla)]
    if misses:
        return "misses the SLA: " + "; ".join(sorted(set(misses))[:3])
    if search.score(s, n)[0] < search.score(winner, n)[0]:
        short = short_of_room(s.rung_figures(n), search.sla, search.settings.sla_margin)
        return (
            f"meets the SLA narrowly ({describe_short_of_room(short)}) where "
            f"{winner.candidate.key} meets it with room"
        )
    mine, theirs = search.goodputs(s, n), search.goodputs(winner, n)
    return (
        f"lower goodput ({statistics.fmean(mine):.4g} vs {statistics.fmean(theirs):.4g} req/s), "
        f"outside the winner's spread and {search.settings.tie_margin:.0%}"
    )
