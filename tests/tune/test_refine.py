"""The refinement between two values that fall short on different bounds, and the budget kept
for the finalists' rounds, on synthetic measurements."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tune.test_search import (
    DEFAULT,
    INT8,
    SLA,
    Recorded,
    figures,
    run_search,
    statuses,
)
from tokenmill.tune.candidates import Candidate
from tokenmill.tune.refine import between
from tokenmill.tune.search import Search, SearchSettings
from tokenmill.tune.state import TuneState

SPAN_S, BACKLOG_S = 5.0, 100.0
"""Samples arrive over 5 s and take 100 s: backlogged, so the whole trace (30 requests) ranks."""


def seqs(value: int, **other: Any) -> Candidate:
    return Candidate.of(max_num_seqs=value, **other)


def trade_off(seqs_value: int, goodput: float = 1.0) -> Any:
    """A batch-shaped trade-off: fewer sequences queue (TTFT = 4800 / seqs ms against an 800
    ms bound), more share each step (TPOT = 10 + 3 x seqs ms against 60). 4 misses TTFT, 32
    misses TPOT, 16 meets TPOT by 3% (narrowly), 8 meets both with room."""
    whole = figures(goodput, ttft=4800.0 / seqs_value, tpot=10.0 + 3.0 * seqs_value)
    timed = {"arrival_span_s": SPAN_S, "duration": BACKLOG_S}
    return lambda n, r: {**whole, **timed}


def batch_table(**other: Any) -> dict[str, Any]:
    """Measurements for every ``--max-num-seqs`` value (those the refinement may add too)."""
    return {seqs(v, **other).key: trade_off(v) for v in range(1, 257)}


def test_between_takes_the_geometric_middle_preferring_powers_of_two() -> None:
    assert between(4, 32) == 16  # 8 and 16 are equally near; the larger
    assert between(4, 16) == 8
    assert between(8, 16) == 11  # no power of two between: the rounded geometric mean
    assert between(16, 32) == 23
    assert between(32, 256) == 128  # 2^6.5: 64 and 128 equally near
    assert between(1, 3) == 2
    assert between(15, 16) is None and between(16, 17) is None and between(0, 8) is None


def test_values_short_on_different_bounds_are_bracketed_until_one_meets_with_room() -> None:
    """4 misses TTFT and 32 (and the default 256) miss TPOT: the refinement tries 16 (short on
    TPOT: 3% room), then 8 between 4 and 16, which meets the SLA with room and wins."""
    cands = [DEFAULT, seqs(4), seqs(32)]
    measure = Recorded(batch_table())
    search, decision = run_search(cands, measure, num_requests=30)
    refined = dict.fromkeys(k for k, n, r in measure.calls if k not in {c.key for c in cands})
    assert list(refined) == [seqs(16).key, seqs(8).key]
    state = search.state.candidates[seqs(8).key]
    assert state.origin == "refined" and state.status == "winner"
    assert decision["winner"] == seqs(8).key and decision["meets_sla_with_room"]
    assert sorted(r for k, n, r in measure.calls if k == seqs(8).key and n == 30) == [0, 1, 2]
    # the first cut kept all three (equal goodput: two finalists and a near tie); the cut
    # taken again with 16 and 8 eliminated them, and says nothing of near ties
    assert statuses(search)[DEFAULT.key] == "eliminated"
    assert "near_ties" not in search.state.meta
    note = search.state.meta["refinement"]
    assert "max_num_seqs=16 between max_num_seqs=4 (short on p95_ttft_ms)" in note
    assert "max_num_seqs=8 between max_num_seqs=4" in note
    assert search.state.to_json()["candidates"][-1]["origin"] == "refined"


def test_each_option_is_bracketed_with_everything_else_equal() -> None:
    """int8 at 4 and 32 is a bracket of its own; int8 at 4 and the default at 32 are not."""
    cands = [DEFAULT, seqs(4, quantization="int8"), seqs(32, quantization="int8"), seqs(32)]
    table = {**batch_table(), **batch_table(quantization="int8")}
    measure = Recorded(table)
    _, decision = run_search(cands, measure, num_requests=30)
    refined = [k for k, n, r in measure.calls if k not in {c.key for c in cands}]
    assert refined[0] == seqs(16, quantization="int8").key
    assert decision["winner"] == seqs(8, quantization="int8").key


def test_the_simpler_bracket_is_refined_first() -> None:
    """Both the plain and the int8 pair bracket the trade-off; int8's 32 has more goodput,
    but a candidate with one flag fewer is refined first."""
    cands = [
        DEFAULT,
        seqs(4),
        seqs(32),
        seqs(4, quantization="int8"),
        seqs(32, quantization="int8"),
    ]
    table = {**batch_table(), **batch_table(quantization="int8")}
    table[seqs(32, quantization="int8").key] = trade_off(32, goodput=1.5)
    measure = Recorded(table)
    _, decision = run_search(cands, measure, num_requests=30)
    refined = [k for k, n, r in measure.calls if k not in {c.key for c in cands}]
    assert refined[:2] == [seqs(16).key, seqs(8).key]
    assert decision["winner"] == seqs(8).key


def test_no_bracket_when_both_fall_short_on_the_same_bound() -> None:
    """Every value misses TPOT: a value between two of them has no trade-off to find."""
    slow = {seqs(v).key: (lambda n, r: {**figures(1.0, tpot=90.0), "arrival_span_s": SPAN_S,
                                       "duration": BACKLOG_S}) for v in (4, 32, 256)}  # fmt: skip
    measure = Recorded(slow)
    search, decision = run_search([DEFAULT, seqs(4), seqs(32)], measure, num_requests=30)
    assert {k for k, _, _ in measure.calls} == {DEFAULT.key, seqs(4).key, seqs(32).key}
    assert "refinement" not in search.state.meta and not decision["meets_sla"]


def test_nothing_is_refined_when_a_candidate_meets_with_room_or_refine_steps_is_zero() -> None:
    table = {**batch_table(), INT8.key: trade_off(8)}
    measure = Recorded(table)
    run_search([DEFAULT, seqs(4), seqs(32), INT8], measure, num_requests=30)
    assert {k for k, _, _ in measure.calls} == {DEFAULT.key, seqs(4).key, seqs(32).key, INT8.key}
    measure = Recorded(batch_table())
    _, decision = run_search([DEFAULT, seqs(4), seqs(32)], measure, num_requests=30, refine_steps=0)
    assert len({k for k, _, _ in measure.calls}) == 3 and not decision["meets_sla"]
    with pytest.raises(ValueError, match="refine_steps"):
        SearchSettings(refine_steps=-1)


def test_refine_steps_bound_the_added_candidates() -> None:
    measure = Recorded(batch_table())
    search, _ = run_search([DEFAULT, seqs(4), seqs(32)], measure, num_requests=30, refine_steps=1)
    assert [s.candidate.key for s in search.state.candidates.values() if s.origin == "refined"] == [
        seqs(16).key
    ]


def test_a_refined_candidate_that_cannot_fit_is_pruned_not_run() -> None:
    measure = Recorded(batch_table())
    search, decision = run_search(
        [DEFAULT, seqs(4), seqs(32)], measure, num_requests=30, memory={seqs(16).key: 10_000}
    )
    assert statuses(search)[seqs(16).key] == "pruned"
    assert all(k != seqs(16).key for k, _, _ in measure.calls)
    # 16 was the only value asked for between 4 and 32: the refinement ends there
    refined = [s for s in search.state.candidates.values() if s.origin == "refined"]
    assert [s.candidate.key for s in refined] == [seqs(16).key]
    assert decision["winner"] is not None and not decision["meets_sla"]


def test_resume_keeps_refined_measurements(tmp_path) -> None:
    cands = [DEFAULT, seqs(4), seqs(32)]
    first = Recorded(batch_table())
    search, _ = run_search(cands, first, num_requests=30)
    path = search.state.save(tmp_path / "result.json")
    state = TuneState.new(cands, {"model": "m", "workload": "w", "sla": SLA})
    assert state.absorb(path) == len(first.calls)
    assert state.candidates[seqs(8).key].origin == "refined"
    second = Recorded(batch_table())
    _, decision = run_search(cands, second, state=state, num_requests=30)
    assert second.calls == []
    assert decision["winner"] == seqs(8).key


def test_the_whole_trace_pass_keeps_budget_for_the_finalists_rounds() -> None:
    """Each replay takes 100 s of a 1,050 s budget. Two finalists need 2 x 2 more rounds: the
    pass stops measuring new candidates when under 5 replays (500 s) are left, and the
    finalists still get their three rounds each."""
    now = [0.0]
    cands = [DEFAULT, *(Candidate.of(block_size=b) for b in (8, 32, 64, 128, 256))]
    good = {c.key: 1.0 + i / 10 for i, c in enumerate(cands)}

    def measure(c: Candidate, n: int, r: int) -> dict[str, Any]:
        now[0] += 100.0
        return {**figures(good[c.key]), "arrival_span_s": SPAN_S, "duration": BACKLOG_S}

    settings = SearchSettings(budget_s=1050, first_sample=10, num_finalists=2, cut_margin=0.0)
    search = Search(
        TuneState.new(cands, {"model": "m", "workload": "w", "sla": SLA}), SLA, settings, 30,
        lambda c: (True, 1, ""), lambda c: {}, measure, lambda: now[0],
    )  # fmt: skip
    decision = search.run()
    skipped = [k for k, s in search.state.candidates.items() if "kept for" in s.reason]
    assert skipped == [cands[-1].key]
    assert not decision["stopped_by_budget"]
    finalists = [s for s in search.state.candidates.values() if len(s.rung_figures(30)) == 3]
    assert len(finalists) == 2
    assert decision["winner"] == cands[-2].key


def test_the_default_takes_its_place_by_what_the_server_resolves_it_to() -> None:
    """``--max-num-batched-tokens`` unset is 1024 on a CPU: 512 queueing past the TTFT bound
    and the default over the TPOT bound bracket 724, which meets both."""

    def budget(tokens: int) -> Any:
        whole = figures(1.0, ttft=500_000.0 / tokens, tpot=20.0 + tokens / 25.0)
        return lambda n, r: {**whole, "arrival_span_s": SPAN_S, "duration": BACKLOG_S}

    small = Candidate.of(max_num_batched_tokens=512)
    table = {DEFAULT.key: budget(1024), small.key: budget(512)}
    table[Candidate.of(max_num_batched_tokens=724).key] = budget(724)
    cands = [DEFAULT, small]
    _, decision = run_search(
        cands, Recorded(table), num_requests=30, resolved={"max_num_batched_tokens": 1024}
    )
    assert decision["winner"] == "max_num_batched_tokens=724"
    _, unresolved = run_search(cands, Recorded(table), num_requests=30)
    assert unresolved["winner"] != "max_num_batched_tokens=724"  # the default has no place


def test_too_few_candidates_to_halve_are_refined_between_too() -> None:
    """Two candidates and two finalists: no cut to refine after. Their first full rounds are
    taken first, and the refinement looks between them all the same."""
    measure = Recorded(batch_table())
    _, decision = run_search([seqs(4), seqs(32)], measure, num_requests=30)
    assert decision["winner"] == seqs(8).key and decision["meets_sla_with_room"]
    assert [k for k, n, r in measure.calls[:2]] == [seqs(4).key, seqs(32).key]
    assert all(n == 30 for _, n, _ in measure.calls)
