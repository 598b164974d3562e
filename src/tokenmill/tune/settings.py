"""How hard ``tokenmill tune`` looks: the search's sample sizes, rounds, margins and budget.

``entrypoints/tune.py`` builds them from its flags and every step of the search reads them,
so they stand apart from the loop. The margins' defaults name the measured runs behind
them, to be checked again when the machines or the workloads change.
"""

from __future__ import annotations

from dataclasses import dataclass


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
