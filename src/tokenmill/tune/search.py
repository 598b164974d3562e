"""The decision: prune, gate, successive halving, finalists' rounds, ties. Pure logic.

Nothing here starts a server or imports torch: measuring, verifying and sizing are
callables handed in, so the same code decides on live runs and on recorded measurements
(the tests replay those). Every measurement lands in the ``TuneState`` before the next
one starts; a state loaded from an interrupted run answers the measurements it holds, so
a resumed search runs nothing twice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.sla import check_sla
from tokenmill.tune.candidates import Candidate
from tokenmill.tune.refine import find_bracket
from tokenmill.tune.scoring import (
    GOODPUT_KEY,
    MEETS_NARROWLY,
    MEETS_WITH_ROOM,
    MISSES,
    bound_rooms,
    describe_short_of_room,
    is_backlogged,
    is_tie,
    relative_spread,
    rung_score,
    score_of,
    short_of_room,
)
from tokenmill.tune.state import CandidateState, TuneState, memory_of, simplicity_key

WALL_KEY = "tune_wall_s"
"""Seconds one replay took the search (server start and drain included), kept with its
figures: what the budget's reserve for the finalists' rounds is estimated from."""


@dataclass(frozen=True)
class SearchSettings:
    """How hard to look: sample sizes, halving rate, rounds, thresholds, the budget."""

    budget_s: float = 1800.0
    """Wall seconds for the whole search; at the end, the best so far wins."""
    first_sample: int = 32
    """Requests in the first, cheapest rung of successive halving."""
    eta: int = 3
    """Each rung keeps a 1/eta of the candidates and replays eta times more requests."""
    num_finalists: int = 3
    """Candidates replayed on the full trace for ``num_rounds`` rounds."""
    num_rounds: int = 3
    """Full replays per finalist (ties are judged on their spread: at least 3)."""
    max_spread: float = 0.10
    """A finalist whose rounds' goodput spreads more than this (relative) is re-run once, then marked unstable."""
    min_match: float = 0.9
    """Teacher-forced top-1 agreement a reduced precision needs against float32."""
    cut_margin: float = 0.05
    """Where the finalists are chosen on one replay of the whole trace each (a backlogged
    sample stopped the halving), up to ``num_finalists`` more stay finalists if their goodput
    is within this fraction of the last finalist's and they meet the SLA as it does: one
    replay cannot separate them. On the batch trace of 2026-12-05, finalists' rounds spread
    1-9%, and that cut eliminated ``--quantization int4`` 0.002 req/s (1%) behind the last
    finalist; it was tied with the winner in the earlier search."""

    tie_margin: float = 0.02
    """Finalists whose mean goodputs differ by no more than this fraction are tied even where
    their rounds do not overlap. When every request meets the SLA, goodput is the trace's
    arrival rate less the last request's latency, and steady rounds separate candidates by
    nothing a user would choose on: on a 300-request chat trace of 2026-12-07, int8 lost to
    int4 at 1.505 against 1.507 req/s, rounds 0.03% apart."""

    sla_margin: float = 0.10
    """Room a candidate must leave under every bound, as a fraction of the bound, in its
    worst round, to meet the SLA *with room*; raised to its rounds' own spread of that
    figure where that is wider. Meeting every round with less room is meeting it narrowly,
    which ranks below meeting it with room whatever the goodput: the next replay moves a
    figure by about its spread. Default: ``max_spread``, the spread a stable candidate may
    show. On the batch trace of 2026-12-06 the winner met the p95 TPOT bound by 0-1% in its
    three rounds and missed it in two of three re-measured rounds (by up to 9%), while
    ``--max-num-seqs 4 --quantization int4`` ran 84% under it at 7% less goodput."""

    refine_steps: int = 4
    """Candidates the refinement may add (0: none). Where no candidate meets the SLA with
    room, two values of one numeric option (``REFINABLE_OPTIONS``), all else equal, that fall
    short on different bounds bracket a trade-off: the value between them is tried, and the
    bracket narrowed, up to this many times. On the batch trace of 2026-12-07,
    ``--max-num-seqs 4`` missed the TTFT bound by queueing (p95 71 s against 30 s) and 32 missed
    the TPOT bound (167 against 134 ms); no value in the space lay between them."""

    def __post_init__(self) -> None:
        if self.num_rounds < 3:
            raise ValueError("num_rounds must be >= 3 (ties are judged on the spread)")
        if self.eta < 2 or self.first_sample < 1 or self.num_finalists < 1:
            raise ValueError("eta must be >= 2, first_sample and num_finalists >= 1")
        if not 0.0 <= self.cut_margin < 1.0:
            raise ValueError("cut_margin must be >= 0 and < 1")
        if not 0.0 <= self.sla_margin < 1.0:
            raise ValueError("sla_margin must be >= 0 and < 1")
        if not 0.0 <= self.tie_margin < 1.0:
            raise ValueError("tie_margin must be >= 0 and < 1")
        if self.refine_steps < 0:
            raise ValueError("refine_steps must be >= 0")


PlanFn = Callable[[Candidate], tuple[bool, int | None, str]]
"""candidate -> (fits, planned bytes, why not)."""
GateFn = Callable[[Candidate], dict[str, Any]]
"""candidate -> {"top1_agreement": .., "mean_kl": .., ...} of its precision against float32."""
MeasureFn = Callable[[Candidate, int, int], dict[str, Any]]
"""(candidate, num_requests, round) -> the replay's summary figures; raises on failure."""
ProgressFn = Callable[[str, float], None]
"""(what runs now, seconds left in the budget) -> None."""


class BudgetExhausted(Exception):
    """Raised inside the search when the budget is spent; the best so far is decided."""


@dataclass
class Search:
    """One tuning run over ``state`` with the callables that touch the world."""

    state: TuneState
    sla: dict[str, float]
    settings: SearchSettings
    num_trace_requests: int
    plan: PlanFn
    gate: GateFn
    measure: MeasureFn
    clock: Callable[[], float]
    save: Callable[[TuneState], Any] = lambda state: None
    progress: ProgressFn = lambda what, left_s: None
    resolved: dict[str, Any] = field(default_factory=dict)
    """What the server's automatic settings resolve to on this machine (``max_num_batched_tokens``
    when not given): the default's place among a refinable option's measured values."""
    _start_s: float = 0.0

    # ---- the budget ---------------------------------------------------------------------
    def elapsed_s(self) -> float:
        return self.state.elapsed_s + (self.clock() - self._start_s)

    def left_s(self) -> float:
        return self.settings.budget_s - self.elapsed_s()

    def _checkpoint(self, what: str) -> None:
        self.progress(what, max(0.0, self.left_s()))
        if self.left_s() <= 0:
            raise BudgetExhausted(what)

    def _save(self) -> None:
        """Saves the state with the search time spent so far: a search stopped by a signal
        resumes with what is left of its budget, not a fresh one."""
        now = self.clock()
        self.state.elapsed_s += now - self._start_s
        self._start_s = now
        self.save(self.state)

    # ---- the steps ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Search and decide; returns the decision (also kept in ``state.decision``)."""
        self._start_s = self.clock()
        stopped_by_budget = False
        try:
            self.prune()
            self.check_correctness()
            finalists = self.halve()
            self.replay_finalists(finalists)
        except BudgetExhausted as exc:
            stopped_by_budget = True
            self.state.meta["stopped_by_budget_at"] = str(exc)
        decision = self.decide(stopped_by_budget)
        self.state.elapsed_s = self.elapsed_s()
        self._start_s = self.clock()
        self.state.decision = decision
        self._save()
        return decision

    def alive(self) -> list[CandidateState]:
        return [s for s in self.state.candidates.values() if s.status in ("pending", "finalist")]

    def prune(self) -> None:
        """Drop, before anything runs, what ``plan`` says cannot fit the memory."""
        for s in self.state.candidates.values():
            fits, num_bytes, why = self.plan(s.candidate)
            s.memory_bytes = num_bytes
            if not fits:
                s.status, s.reason = "pruned", f"does not fit the memory: {why}"
        self._save()

    def check_correctness(self) -> None:
        """Verify each reduced precision once; reject candidates below ``min_match``."""
        by_precision: dict[tuple[Any, ...], dict[str, Any]] = {}
        for s in self.alive():
            if not s.candidate.is_reduced_precision:
                continue
            pkey = s.candidate.precision_key
            if s.gate is None:
                if pkey not in by_precision:
                    self._checkpoint(f"verify {dict(pkey)}")
                    by_precision[pkey] = self.gate(s.candidate)
                s.gate = by_precision[pkey]
            else:
                by_precision.setdefault(pkey, s.gate)
            agreement = s.gate.get("top1_agreement")
            if s.gate.get("error"):
                s.status, s.reason = "rejected", f"correctness check failed: {s.gate['error']}"
            elif agreement is None or agreement < self.settings.min_match:
                s.status = "rejected"
                s.reason = (
                    f"top-1 agreement {agreement:.3f} < --min-match {self.settings.min_match:g} "
                    f"(mean KL {s.gate.get('mean_kl', float('nan')):.4f})"
                )
            self._save()

    def _measure_once(self, s: CandidateState, num_requests: int, round_index: int) -> bool:
        key = f"{num_requests}/{round_index}"
        if key in s.runs:
            return True
        self._checkpoint(f"{s.candidate.key}: {num_requests} requests, round {round_index + 1}")
        start_s = self.clock()
        try:
            figures = dict(self.measure(s.candidate, num_requests, round_index))
            figures.setdefault(WALL_KEY, round(self.clock() - start_s, 3))
            s.runs[key] = figures
        except Exception as exc:  # a candidate that cannot serve loses, the search goes on
            s.status, s.reason = "failed", f"{type(exc).__name__}: {exc}"
            self._save()
            return False
        self._save()
        return True

    def rungs(self) -> list[int]:
        """Request counts of the halving rungs, cheapest first, ending below the full trace."""
        sizes, n = [], self.settings.first_sample
        while n < self.num_trace_requests:
            sizes.append(n)
            n *= self.settings.eta
        return sizes

    def halve(self) -> list[CandidateState]:
        """Successive halving on samples of the trace until ``num_finalists`` remain.

        A backlogged sample (see ``is_backlogged``) stops the halving: every candidate left
        is replayed once on the whole trace instead, and the finalists are the best there.
        Then the refinement (``_refine``) at the last cut's size may add finalists."""
        alive = [s for s in self.alive() if s.status == "pending" and s.origin == "space"]
        last_cut: tuple[int, int, str] | None = None
        for size in self.rungs():
            if len(alive) <= self.settings.num_finalists:
                break
            probe = self._backlogged_probe(alive, size)
            if probe is not None:
                n, figures = self.num_trace_requests, probe.rung_figures(size)[0]
                self.state.meta["halving"] = (
                    f"stopped at the {size}-request sample: {probe.candidate.key}'s replay of it "
                    f"served a backlog ({figures['duration']:.0f} s for "
                    f"arrivals over {figures['arrival_span_s']:.0f} s), "
                    "so samples under-state the whole trace's queueing; every candidate was "
                    f"replayed once on all {n} requests instead"
                )
                last_cut = (n, self.settings.num_finalists, "the whole trace")
                alive = self._cut(alive, *last_cut, reserve_replays=self._finalist_replays())
                break
            keep = max(self.settings.num_finalists, math.ceil(len(alive) / self.settings.eta))
            last_cut = (size, keep, f"a {size}-request sample")
            alive = self._cut(alive, *last_cut)
        if last_cut is None and self.settings.refine_steps > 0 and len(alive) > 1:
            # Too few candidates to halve: they are all finalists. Their first full rounds,
            # taken now, let the refinement look between them (with --options max_num_seqs
            # alone, the default, 4 and 32 are three finalists and nothing else).
            last_cut = (
                self.num_trace_requests,
                max(len(alive), self.settings.num_finalists),
                "the whole trace",
            )
            alive = self._cut(alive, *last_cut)
        if last_cut is not None:
            alive = self._refine(alive, *last_cut)
        for s in alive:
            s.status = "finalist"
        return alive

    def _backlogged_probe(self, alive: list[CandidateState], size: int) -> CandidateState | None:
        """Replays the sample with the first candidate that serves it; that candidate if the
        replay was backlogged, else None."""
        for s in alive:
            if self._measure_once(s, size, 0):
                return s if is_backlogged(s.rung_figures(size)[0]) else None
        return None

    def _cut(
        self,
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
                and self._short_of_time(size, reserve_replays + 1)
            ):
                skipped.append(s)
            elif s.rung_figures(size) or self._measure_once(s, size, 0):
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
        whole = size >= self.num_trace_requests
        score = score_of if whole else rung_score
        margin = self.settings.sla_margin
        ranked = sorted(
            alive, key=lambda s: score(s.rung_figures(size), self.sla, margin), reverse=True
        )
        # a cut taken again (with the refinement's candidates) says only what it kept itself
        self.state.meta.pop("near_ties", None)
        kept = ranked[:keep] + (self._near_ties(ranked, keep, size) if whole else [])
        for s in ranked[len(kept) :]:
            s.status = "eliminated"
            s.reason = f"ranked below the best {keep} on {where}"
        self._save()
        return kept

    def _finalist_replays(self) -> int:
        """Whole-trace replays the finalists still need after their first (the cut's)."""
        return self.settings.num_finalists * (self.settings.num_rounds - 1)

    def _replay_estimate_s(self, size: int) -> float | None:
        """Mean seconds one replay of ``size`` requests took the search so far (None: none yet)."""
        walls = [
            float(f[WALL_KEY])
            for s in self.state.candidates.values()
            for f in s.rung_figures(size)
            if f.get(WALL_KEY) is not None
        ]
        return statistics.fmean(walls) if walls else None

    def _short_of_time(self, size: int, replays: int) -> bool:
        """Whether the budget left is under ``replays`` replays of ``size`` requests."""
        estimate = self._replay_estimate_s(size)
        return estimate is not None and self.left_s() < replays * estimate

    # ---- the refinement -----------------------------------------------------------------
    def _refine(
        self, alive: list[CandidateState], size: int, keep: int, where: str
    ) -> list[CandidateState]:
        """Tries values between two that fall short on different bounds; re-cuts with them.

        Runs only while no candidate measured at ``size`` meets the SLA with room, for at most
        ``refine_steps`` candidates, and (on the whole trace) only while the budget covers the
        finalists' rounds after it. Each new candidate is replayed once at ``size`` and
        ranked with the survivors of the last cut, by the same rule."""
        whole = size >= self.num_trace_requests
        tried: list[CandidateState] = []
        done: set[str] = set()
        notes: list[str] = []
        for _ in range(self.settings.refine_steps):
            # refined candidates a resumed search holds count once asked for again, so that
            # it retraces the same steps
            measured = [
                s for s in self._measured_at(size) if s.origin == "space" or s.candidate.key in done
            ]
            if any(self._score(s, size)[0] == MEETS_WITH_ROOM for s in measured):
                break
            bracket = self._bracket(measured, size, done)
            if bracket is None:
                break
            low, high, candidate = bracket
            if whole and self._short_of_time(size, self._finalist_replays() + 1):
                notes.append("stopped: the budget left was kept for the finalists' rounds")
                break
            done.add(candidate.key)
            state = self.state.candidates.get(candidate.key)
            if state is None:
                state = self.state.candidates[candidate.key] = CandidateState(
                    candidate, origin="refined"
                )
            notes.append(
                f"{candidate.key} between {low.candidate.key} (short on "
                f"{_short_names(self._short(low, size))}) and {high.candidate.key} (short on "
                f"{_short_names(self._short(high, size))})"
            )
            if not self._admit(state, low):
                continue
            if self._measure_once(state, size, 0):
                tried.append(state)
        if notes:
            self.state.meta["refinement"] = "; ".join(notes)
        if not tried:
            self._save()
            return alive
        return self._cut([*alive, *tried], size, keep, where)

    def _admit(self, state: CandidateState, like: CandidateState) -> bool:
        """Plans a refined candidate (a resumed one already holds its plan) and takes the
        correctness check of the candidate it was derived from: the same precision."""
        if state.memory_bytes is None and state.status == "pending":
            fits, state.memory_bytes, why = self.plan(state.candidate)
            if not fits:
                state.status, state.reason = "pruned", f"does not fit the memory: {why}"
        state.gate = state.gate or like.gate
        return state.status == "pending"

    def _measured_at(self, size: int) -> list[CandidateState]:
        """Candidates with a replay of ``size`` requests that still count (not failed)."""
        return [
            s
            for s in self.state.candidates.values()
            if s.rung_figures(size) and s.status not in ("failed", "rejected", "pruned")
        ]

    def _short(self, s: CandidateState, size: int) -> set[str]:
        return {
            key
            for key, _, _ in short_of_room(s.rung_figures(size), self.sla, self.settings.sla_margin)
        }

    def _bracket(
        self, measured: list[CandidateState], size: int, done: set[str]
    ) -> tuple[CandidateState, CandidateState, Candidate] | None:
        return find_bracket(
            measured,
            short=lambda s: self._short(s, size),
            score=lambda s: self._score(s, size),
            resolved=self.resolved,
            done=done,
        )

    def _near_ties(
        self, ranked: list[CandidateState], keep: int, size: int
    ) -> list[CandidateState]:
        """The candidates after the best ``keep`` (``ranked``, best first) that one replay
        cannot tell from the last of them: see ``SearchSettings.cut_margin``."""
        if not 0 < keep < len(ranked) or self.settings.cut_margin <= 0:
            return []
        standing, goodput, _ = self._score(ranked[keep - 1], size)
        near = []
        for s in ranked[keep : keep + self.settings.num_finalists]:
            s_standing, s_goodput, _ = self._score(s, size)
            if s_standing != standing or s_goodput < (1.0 - self.settings.cut_margin) * goodput:
                break
            near.append(s)
        if near:
            names = ", ".join(s.candidate.key for s in near)
            self.state.meta["near_ties"] = (
                f"{names} kept as finalists: within {self.settings.cut_margin:.0%} of the last "
                f"finalist's goodput ({goodput:.3g} req/s) on one replay of the whole trace"
            )
        return near

    def replay_finalists(self, finalists: list[CandidateState]) -> None:
        """Full replays, ``num_rounds`` each; a spread over ``max_spread`` gets one more set."""
        n = self.num_trace_requests
        # A resumed search whose finalist was re-run already holds its steadier rounds, the
        # first ones renamed "superseded": measuring "n/0" again would run it twice.
        fresh = [s for s in finalists if not any(k.startswith(f"superseded/{n}/") for k in s.runs)]
        for s in fresh:
            for r in range(self.settings.num_rounds):
                if not self._measure_once(s, n, r):
                    break
        for s in fresh:
            if s.status != "finalist" or self._spread(s) <= self.settings.max_spread:
                continue
            extra = range(self.settings.num_rounds, 2 * self.settings.num_rounds)
            rerun_ok = all(self._measure_once(s, n, r) for r in extra)
            if rerun_ok and self._spread(s, last_only=True) <= self.settings.max_spread:
                for r in range(self.settings.num_rounds):  # keep the steadier, later rounds
                    s.runs[f"superseded/{n}/{r}"] = s.runs.pop(f"{n}/{r}")
            elif rerun_ok:
                s.status = "unstable"
                s.reason = f"goodput spread {self._spread(s):.0%} over rounds, re-run too"

    def _score(self, s: CandidateState, n: int) -> tuple[int, float, float]:
        return score_of(s.rung_figures(n), self.sla, self.settings.sla_margin)

    def _goodputs(self, s: CandidateState, n: int | None = None) -> list[float]:
        figures = s.rung_figures(n or self.num_trace_requests)
        return [float(f.get(GOODPUT_KEY) or 0.0) for f in figures]

    def _spread(self, s: CandidateState, last_only: bool = False) -> float:
        values = self._goodputs(s)
        return relative_spread(values[-self.settings.num_rounds :] if last_only else values)

    # ---- the decision -------------------------------------------------------------------
    def _best_rung(self) -> int | None:
        """The largest request count every contender was measured at (full trace first)."""
        sizes = [self.num_trace_requests, *reversed(self.rungs())]
        for n in sizes:
            if any(
                s.rung_figures(n) and s.status in ("finalist", "unstable")
                for s in self.state.candidates.values()
            ):
                return n
        for n in sizes:
            if any(s.rung_figures(n) for s in self.state.candidates.values()):
                return n
        return None

    def decide(self, stopped_by_budget: bool) -> dict[str, Any]:
        """The winner, the candidates tied with it, and why; the tie goes to the simpler one."""
        n = self._best_rung()
        base = {"stopped_by_budget": stopped_by_budget, "sla": self.sla}
        if n is None:
            return {**base, "winner": None, "reason": "nothing was measured within the budget"}
        contenders = [
            s
            for s in self.state.candidates.values()
            if s.rung_figures(n)
            and s.status in ("pending", "finalist", "unstable", "eliminated")
            and (n != self.num_trace_requests or s.status != "eliminated")
        ]
        stable = [s for s in contenders if s.status != "unstable"] or contenders
        best = max(stable, key=lambda s: self._score(s, n))
        best_goodputs = self._goodputs(best, n)
        standing = self._score(best, n)[0]
        tied = [
            s
            for s in stable
            if s is not best
            and self._score(s, n)[0] == standing
            and is_tie(self._goodputs(s, n), best_goodputs, self.settings.tie_margin)
        ]
        winner = min([best, *tied], key=simplicity_key)
        for s in contenders:
            if s.status in ("pending", "finalist"):
                s.status = "lost"
                s.reason = s.reason or self._loss_reason(s, winner, n)
        for s in tied:
            if s is not winner:
                s.status = "tied"
                s.reason = (
                    f"tied with {winner.candidate.key} (within the measured spread or "
                    f"{self.settings.tie_margin:.0%}); the simpler/cheaper one wins"
                )
        if best is not winner:
            best.status = "tied"
            best.reason = (
                f"highest mean goodput but inside {winner.candidate.key}'s spread or "
                f"{self.settings.tie_margin:.0%} of it; "
                "the tie goes to the configuration with fewer flags and less memory"
            )
        winner.status, winner.reason = "winner", ""
        note = ""
        if tied:
            names = ", ".join(s.candidate.key for s in [best, *tied] if s is not winner)
            num_bytes, what = memory_of(winner)
            note = (
                f"tied with {names} (their goodput ranges over rounds overlap, or their "
                f"means are within {self.settings.tie_margin:.0%}); chose "
                f"{winner.candidate.key}: {winner.candidate.num_non_default} non-default flags"
                + (f", {num_bytes} bytes {what}" if num_bytes else "")
            )
        figures = winner.rung_figures(n)
        if standing == MISSES:
            reason = "no candidate met the SLA; this one came closest"
        elif standing == MEETS_NARROWLY:
            short = short_of_room(figures, self.sla, self.settings.sla_margin)
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
            "sla_margin": self.settings.sla_margin,
            "tie_margin": self.settings.tie_margin,
            "sla_room": {k: round(v, 4) for k, v in bound_rooms(figures, self.sla).items()},
            "measured_on_requests": n,
            "goodput_rounds": self._goodputs(winner, n),
            "tied_with": [s.candidate.key for s in [best, *tied] if s is not winner],
            "tie_note": note,
            "serve_args": winner.candidate.serve_args(),
            "reason": reason,
        }

    def _loss_reason(self, s: CandidateState, winner: CandidateState, n: int) -> str:
        misses = [m for f in s.rung_figures(n) for m in check_sla(f, self.sla)]
        if misses:
            return "misses the SLA: " + "; ".join(sorted(set(misses))[:3])
        if self._score(s, n)[0] < self._score(winner, n)[0]:
            short = short_of_room(s.rung_figures(n), self.sla, self.settings.sla_margin)
            return (
                f"meets the SLA narrowly ({describe_short_of_room(short)}) where "
                f"{winner.candidate.key} meets it with room"
            )
        mine, theirs = self._goodputs(s, n), self._goodputs(winner, n)
        return (
            f"lower goodput ({statistics.fmean(mine):.4g} vs {statistics.fmean(theirs):.4g} req/s), "
            f"outside the winner's spread and {self.settings.tie_margin:.0%}"
        )


def _short_names(keys: set[str]) -> str:
    return ", ".join(sorted(keys)) or "nothing"
