"""BeamSearch's ranking and stopping rules (transformers' semantics) on hand-made logprobs."""

from __future__ import annotations

import math

import pytest

from tokenmill.core.beam_search import BeamSearch

STOP = 9
# Step 1: the stop token is the best first token; the best running beam is worse.
FIRST = [{STOP: -1.0, 1: -1.5}]
# Step 2: from beam [1], the stop token again: -1.7 over 2 tokens beats -1.0 under length_penalty 1.
SECOND = [{STOP: -0.2, 2: -2.0}]


def _search(early_stopping: bool | str, length_penalty: float = 1.0) -> BeamSearch:
    return BeamSearch(
        width=1,
        max_tokens=10,
        stop_token_ids=frozenset({STOP}),
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )


@pytest.mark.parametrize("early_stopping", [True, False])
def test_stops_once_no_running_beam_can_win(early_stopping: bool) -> None:
    search = _search(early_stopping)
    assert search.step(FIRST) == []
    assert search.is_done
    (best,) = search.best(1)
    assert best.token_ids == [STOP] and best.finish_reason == "stop" and best.stop_reason == STOP


def test_never_assumes_a_running_beam_may_reach_max_tokens() -> None:
    search = _search("never")
    (nxt,) = search.step(FIRST)  # -1.5 / 10 could still beat -1.0
    assert (nxt.parent, nxt.token_id, nxt.cum_logprob) == (0, 1, -1.5)
    search.step(SECOND)
    (best,) = search.best(1)
    assert best.token_ids == [1, STOP] and best.score == pytest.approx(-1.7 / 2)


def test_length_penalty_zero_ranks_by_sum_and_width_keeps_the_best() -> None:
    search = BeamSearch(width=2, max_tokens=2, stop_token_ids=frozenset({STOP}), length_penalty=0.0)
    beams = search.step([{3: -0.1, 4: -0.2, STOP: -3.0, 5: -4.0}])
    assert [(b.parent, b.token_id) for b in beams] == [(0, 3), (0, 4)]
    assert search.num_candidates == 4  # max(2, 1 + one stop token) x width
    assert (
        search.step([{6: -0.5, 7: -0.6, STOP: -0.7, 8: -9.0}, {6: -0.1, 7: -5.0, 8: -6.0, 5: -7.0}])
        == []
    )
    # max_tokens: the two best of the 2 x 4 continuations finish as 'length'.
    assert [(h.token_ids, h.finish_reason) for h in search.best(2)] == [
        ([4, 6], "length"),
        ([3, 6], "length"),
    ]


def test_only_the_top_width_candidates_may_finish() -> None:
    search = BeamSearch(width=1, max_tokens=5, stop_token_ids=frozenset({STOP}), length_penalty=0.0)
    (nxt,) = search.step(
        [{1: -0.1, STOP: -0.2}]
    )  # the stop token is second: a spare, not a hypothesis
    assert nxt.token_id == 1 and search.finished == []


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0, 1e308, -1e308])
def test_extreme_finite_length_penalties_rank_instead_of_overflowing(
    length_penalty: float,
) -> None:
    """``gen_len ** 1000`` overflowed a Python float and killed the engine."""
    search = BeamSearch(
        width=2, max_tokens=4, stop_token_ids=frozenset({STOP}), length_penalty=length_penalty
    )
    steps = 0
    while not search.is_done and steps < 4:
        num_live = len(search.live_scores)
        search.step([{STOP: -0.5, 1: -0.1, 2: -0.2, 3: -0.3}] * num_live)
        steps += 1
    best = search.best(2)
    assert len(best) == 2
    assert all(not math.isnan(h.score) for h in best)
    assert [h.score for h in best] == sorted((h.score for h in best), reverse=True)
