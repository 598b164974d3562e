"""The search loop: prune, gate, successive halving, finalists' rounds, the budget. Pure logic.

Nothing here starts a server or imports torch: measuring, verifying and sizing are
callables handed in, so the same code decides on live runs and on recorded measurements
(the tests replay those). Every measurement lands in the ``TuneState`` before the next
one starts; a state loaded from an interrupted run answers the measurements it holds, so
a resumed search runs nothing twice. The loop owns the clock and the record; the steps
that only rank or choose live beside it: ``cut`` (who goes on at a request count),
``refine`` (values between two that fall short on different bounds) and ``decision``
(the winner and the ties), with the knobs in ``settings``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tune.candidates import Candidate
from tokenmill.tune.cut import cut
from tokenmill.tune.decision import decide
from tokenmill.tune.refine import refine
from tokenmill.tune.scoring import GOODPUT_KEY, is_backlogged, relative_spread, score_of
from tokenmill.tune.settings import SearchSettings
from tokenmill.tune.state import CandidateState, TuneState

WALL_KEY = "tune_wall_s"
"""Seconds one replay took the search (server start and drain included), kept with its
figures: what the budget's reserve for the finalists' rounds is estimated from."""


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

    def save_state(self) -> None:
        """Saves the state with the search time spent so far: a search stopped by a signal
        resumes with what is left of its budget, not a fresh one."""
        now = self.clock()
        self.state.elapsed_s += now - self._start_s
        self._start_s = now
        self.save(self.state)

    def finalist_replays(self) -> int:
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

    def short_of_time(self, size: int, replays: int) -> bool:
        """Whether the budget left is under ``replays`` replays of ``size`` requests."""
        estimate = self._replay_estimate_s(size)
        return estimate is not None and self.left_s() < replays * estimate

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
        decision = decide(self, stopped_by_budget)
        self.state.elapsed_s = self.elapsed_s()
        self._start_s = self.clock()
        self.state.decision = decision
        self.save_state()
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
        self.save_state()

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
            self.save_state()

    def measure_once(self, s: CandidateState, num_requests: int, round_index: int) -> bool:
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
            self.save_state()
            return False
        self.save_state()
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
        Then the refinement (``refine.refine``) at the last cut's size may add finalists."""
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
                alive = cut(self, alive, *last_cut, reserve_replays=self.finalist_replays())
                break
            keep = max(self.settings.num_finalists, math.ceil(len(alive) / self.settings.eta))
            last_cut = (size, keep, f"a {size}-request sample")
            alive = cut(self, alive, *last_cut)
        if last_cut is None and self.settings.refine_steps > 0 and len(alive) > 1:
            # Too few candidates to halve: they are all finalists. Their first full rounds,
            # taken now, let the refinement look between them (with --options max_num_seqs
            # alone, the default, 4 and 32 are three finalists and nothing else).
            last_cut = (
                self.num_trace_requests,
                max(len(alive), self.settings.num_finalists),
                "the whole trace",
            )
            alive = cut(self, alive, *last_cut)
        if last_cut is not None:
            alive = refine(self, alive, *last_cut)
        for s in alive:
            s.status = "finalist"
        return alive

    def _backlogged_probe(self, alive: list[CandidateState], size: int) -> CandidateState | None:
        """Replays the sample with the first candidate that serves it; that candidate if the
        replay was backlogged, else None."""
        for s in alive:
            if self.measure_once(s, size, 0):
                return s if is_backlogged(s.rung_figures(size)[0]) else None
        return None

    def replay_finalists(self, finalists: list[CandidateState]) -> None:
        """Full replays, ``num_rounds`` each; a spread over ``max_spread`` gets one more set."""
        n = self.num_trace_requests
        # A resumed search whose finalist was re-run already holds its steadier rounds, the
        # first ones renamed "superseded": measuring "n/0" again would run it twice.
        fresh = [s for s in finalists if not any(k.startswith(f"superseded/{n}/") for k in s.runs)]
        for s in fresh:
            for r in range(self.settings.num_rounds):
                if not self.measure_once(s, n, r):
                    break
        for s in fresh:
            if s.status != "finalist" or self._spread(s) <= self.settings.max_spread:
                continue
            extra = range(self.settings.num_rounds, 2 * self.settings.num_rounds)
            rerun_ok = all(self.measure_once(s, n, r) for r in extra)
            if rerun_ok and self._spread(s, last_only=True) <= self.settings.max_spread:
                for r in range(self.settings.num_rounds):  # keep the steadier, later rounds
                    s.runs[f"superseded/{n}/{r}"] = s.runs.pop(f"{n}/{r}")
            elif rerun_ok:
                s.status = "unstable"
                s.reason = f"goodput spread {self._spread(s):.0%} over rounds, re-run too"

    # ---- how a candidate stands: read by the cut, the refinement and the decision ----------
    def score(self, s: CandidateState, n: int) -> tuple[int, float, float]:
        """``score_of`` its replays of ``n`` requests under this search's SLA and margin."""
        return score_of(s.rung_figures(n), self.sla, self.settings.sla_margin)

    def goodputs(self, s: CandidateState, n: int | None = None) -> list[float]:
        """Its goodput per round of ``n`` requests (default: the whole trace)."""
        figures = s.rung_figures(n or self.num_trace_requests)
        return [float(f.get(GOODPUT_KEY) or 0.0) for f in figures]

    def _spread(self, s: CandidateState, last_only: bool = False) -> float:
        values = self.goodputs(s)
        return relative_spread(values[-self.settings.num_rounds :] if last_only else values)
