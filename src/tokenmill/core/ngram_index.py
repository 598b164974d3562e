"""NgramIndex: prompt lookup in constant time per step instead of a scan of the history.

``ngram_propose`` (``core.speculative``) scans a request's whole prompt + output for its
last n tokens, for each n from ``prompt_lookup_max`` down, every step: a copy of the token
list and up to ``3 x len`` slice comparisons in Python, which grows with the context. This
index keeps, per request, the latest start of every n-gram seen so far (min_n <= n <=
max_n), extended by the tokens appended since the last step, so a lookup is one dict probe
per n. It proposes exactly what the scan proposes (a hypothesis test holds it to that):
the scan takes, for the longest suffix that recurs, its latest earlier occurrence, i.e.
the latest start s <= len - n - 1; the index holds exactly the n-grams ending at or before
len - 2, each at its latest start. No torch here.
"""

from __future__ import annotations


class NgramIndex:
    """The latest start of every n-gram of one growing token sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        """The sequence so far (a private copy, extended as it grows)."""
        self._latest: dict[tuple[int, ...], int] = {}
        """n-gram -> its latest start, for n-grams ending before ``_next_end``."""
        self._next_end = 0

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        recurring suffix (``ngram_propose`` on ``self.tokens``)."""
        tokens, latest = self.tokens, self._latest
        num = len(tokens)
        for end in range(self._next_end, num - 1):  # n-grams ending at or before num - 2
            for n in range(self.min_n, self.max_n + 1):
                start = end - n + 1
                if start < 0:
                    break
                latest[tuple(tokens[start : end + 1])] = start
        self._next_end = max(self._next_end, num - 1)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            found = latest.get(tuple(tokens[num - n :]))
            if found is not None:
                return tokens[found + n : found + n + k]
        return []
