"""The incremental n-gram index proposes exactly what the scan of the history proposes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.ngram_index import NgramIndex
from tokenmill.core.speculative import ngram_propose


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=60),
    growth=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 5),
)
def test_index_matches_the_scan_as_the_sequence_grows(
    tokens: list[int], growth: list[int], bounds: tuple[int, int], k: int
) -> None:
    """Grown by a few tokens at a time (as steps append accepted runs), after every growth
    the index proposes what ``ngram_propose`` proposes over the whole sequence."""
    min_n, extra = bounds
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    seen = 0
    for step in growth:
        upto = min(len(tokens), seen + step)
        index.extend(tokens[seen:upto])
        seen = upto
        assert index.propose(k) == ngram_propose(tokens[:seen], k, min_n, max_n)
        if seen == len(tokens):
            break
