"""One cut: measure the candidates still in at one request count, keep the best.

The halving's rungs, the whole-trace pass (when samples are backlogged) and the
refinement's re-cut all eliminate by this one rule, so a candidate the refinement adds is
ranked exactly as the survivors it joins were. On a sample the cut ranks by ``rung_score``;
on the whole trace by ``score_of``, keeping near ties one replay cannot separate, and
keeping the budget for the finalists' rounds when it runs short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.tune.scoring import rung_score, score_of
from tokenmill.tune.state import CandidateState

if TYPE_CHECKING:
    from tokenmill.tune.search import Search


def cut(
    search: Search,
    alive: list[CandidateState],
    size: int,
    keep: int,
    where: str,
    reserve_replays: int = 0,
) -> list[CandidateState]:
    """Measures ``alive`` once at ``size`` requests and eliminates all but the best ``keep``:
    ranked by ``rung_score`` on a sample, by ``score_of`` on the whole trace.

    ``reserve_replays``: once ``keep`` candidates are measured, one not measured yet is
    skipped (eliminated) when the budget left would no longer cover this many more
    replays of ``size`` requests: the finalists' rounds are worth more than one more
    single replay. A 1,500 s budget on the batch trace of 2026-12-07 ran out after 11 of
    12 whole-trace replays, with no finalist rounds at all."""
    measured: list[CandidateState] = []
    skipped: list[CandidateState] = []
    for s in alive:
        if (
            reserve_replays
            and not s.rung_figures(size)
            and len(measured) >= keep
            and search.short_of_time(size, reserve_replays + 1)
        ):
            skipped.append(s)
        elif s.rung_figures(size) or search.measure_once(s, size, 0):
            # figures at this size already (a finalist re-run for its spread keeps only
            # its later rounds): measured
            measured.append(s)
    for s in skipped:
        s.status = "eliminated"
        s.reason = (
            f"not replayed on {where}: the budget left was kept for "
            f"{reserve_replays} replays of the finalists"
        )
    alive = measured
    whole = size >= search.num_trace_requests
    score = score_of if whole else rung_score
    margin = search.settings.sla_margin
    ranked = sorted(
        alive, key=lambda s: score(s.rung_figures(size), search.sla, margin), reverse=True
    )
    # a cut taken again (with the refinement's candidates) says only what it kept itself
    search.state.meta.pop("near_ties", None)
    kept = ranked[:keep] + (near_ties(search, ranked, keep, size) if whole else [])
    for s in ranked[len(kept) :]:
        s.status = "eliminated"
        s.reason = f"ranked below the best {keep} on {where}"
    search.save_state()
    return kept


def near_ties(
    search: Search, ranked: list[CandidateState], keep: int, size: int
) -> list[CandidateState]:
    """The candidates after the best ``keep`` (``ranked``, best first) that one replay
    cannot tell from the last of them: see ``SearchSettings.cut_margin``."""
    settings = search.settings
    if not 0 < keep < len(ranked) or settings.cut_margin <= 0:
        return []
    standing, goodput, _ = search.score(ranked[keep - 1], size)
    near = []
    for s in ranked[keep : keep + settings.num_finalists]:
        s_standing, s_goodput, _ = search.score(s, size)
        if s_standing != standing or s_goodput < (1.0 - settings.cut_margin) * goodput:
            break
        near.append(s)
    if near:
        names = ", ".join(s.candidate.key for s in near)
        search.state.meta["near_ties"] = (
            f"{names} kept as finalists: within {settings.cut_margin:.0%} of the last "
            f"finalist's goodput ({goodput:.3g} req/s) on one replay of the whole trace"
        )
    return near
