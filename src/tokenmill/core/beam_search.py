"""BeamSearch: the per-request beam bookkeeping, step by step, with Transformers' semantics.

Owns which beams live on, which finish and when the search stops; it never sees KV or
tensors (no torch here). Each step, every live beam brings the top-K log-probabilities of
its next token (K = max(2, 1 + number of stop tokens) x width, as in ``generate``); the K
best continuations over all beams are ranked by accumulated log-probability, the ones
among the first ``width`` that end (a stop token, or ``max_tokens``) join the finished
hypotheses with score ``sum logprobs / generated_len ** length_penalty``, and the ``width``
best that do not end become the next live beams. Stopping follows
``GenerationMixin._beam_search`` (``early_stopping`` True, False or ``"never"``).
Arithmetic is rounded to float32 as transformers does it on float32 tensors, so the same
log-probabilities rank the same way; like tensors it overflows to infinity instead of
raising, so any finite ``length_penalty`` (1e308, -1000) is a ranking, never a crash.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field


def f32(value: float) -> float:
    """``value`` rounded to float32 (sums and quotients of float32s then round as torch's);
    beyond float32's range it is infinite, as a float32 tensor's would be."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def length_denominator(gen_len: int, length_penalty: float) -> float:
    """``gen_len ** length_penalty`` in float32: infinite or zero where it leaves the range."""
    try:
        return f32(gen_len**length_penalty)
    except OverflowError:
        return math.inf


def penalised_score(cum_logprob: float, denominator: float) -> float:
    """``cum_logprob / denominator`` in float32 with IEEE semantics instead of exceptions
    (x / 0 is infinite); an undefined score (0 / 0, inf / inf) ranks last."""
    if denominator == 0.0:
        score = math.copysign(math.inf, cum_logprob) if cum_logprob != 0.0 else math.nan
    else:
        score = cum_logprob / denominator
    return -math.inf if math.isnan(score) else f32(score)


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and how it is ranked."""

    token_ids: list[int]
    cum_logprob: float
    """Sum of the generated tokens' log-probabilities."""
    score: float
    """``cum_logprob / len(token_ids) ** length_penalty``: what beams are ranked by."""
    finish_reason: str
    """``stop`` (a stop or EOS token, kept as the last token) or ``length``."""
    stop_reason: int | None = None


@dataclass(frozen=True)
class Continuation:
    """A live beam of the next step: which current beam it extends, with what token."""

    parent: int
    """Index of the extended beam in the previous step's live list."""
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearch:
    """The state of one beam search request: live beams' scores and finished hypotheses."""

    width: int
    max_tokens: int
    """Generated tokens at which every beam ends (``length``)."""
    stop_token_ids: frozenset[int]
    """Tokens that end a beam (EOS unless ignored, plus ``stop_token_ids``)."""
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    live_scores: list[float] = field(default_factory=lambda: [0.0])
    """Accumulated log-probability per live beam (one beam, the prompt, to start with)."""
    live_tokens: list[list[int]] = field(default_factory=lambda: [[]])
    """Generated tokens per live beam."""
    finished: list[Hypothesis] = field(default_factory=list)
    """At most ``width``, best first."""
    is_done: bool = False

    @property
    def num_candidates(self) -> int:
        """K: continuations ranked per step, enough that ``width`` of them do not stop."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    @property
    def num_generated(self) -> int:
        """Tokens generated so far by every live beam (they advance in lockstep)."""
        return len(self.live_tokens[0])

    def step(self, top_logprobs: list[dict[int, float]]) -> list[Continuation]:
        """Advance by one token given each live beam's top-K next-token log-probabilities;
        returns the next live beams (empty once the search is done)."""
        if self.is_done:
            raise RuntimeError("the beam search is already done")
        if len(top_logprobs) != len(self.live_scores):
            raise ValueError(f"{len(self.live_scores)} beams, {len(top_logprobs)} logprob rows")
        ranked = sorted(
            (
                (f32(self.live_scores[i] + f32(lp)), i, token)
                for i, row in enumerate(top_logprobs)
                for token, lp in row.items()
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: self.num_candidates]
        gen_len = self.num_generated + 1
        is_length = gen_len >= self.max_tokens
        ends = [is_length or token in self.stop_token_ids for _, _, token in ranked]

        # Only the first ``width`` candidates may finish (the rest are spares to keep going).
        denominator = length_denominator(gen_len, self.length_penalty)
        for (score, parent, token), is_end in zip(ranked[: self.width], ends, strict=False):
            if is_end:
                self.finished.append(
                    Hypothesis(
                        token_ids=[*self.live_tokens[parent], token],
                        cum_logprob=score,
                        score=penalised_score(score, denominator),
                        finish_reason="length" if token not in self.stop_token_ids else "stop",
                        stop_reason=token if token in self.stop_token_ids else None,
                    )
                )
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

        running = [c for c, is_end in zip(ranked, ends, strict=True) if not is_end][: self.width]
        if not running:
            self.is_done = True
            return []
        nexts = [Continuation(parent, token, score) for score, parent, token in running]
        self.live_tokens = [[*self.live_tokens[c.parent], c.token_id] for c in nexts]
        self.live_scores = [c.cum_logprob for c in nexts]
        self.is_done = self._should_stop(gen_len)
        return [] if self.is_done else nexts

    def _should_stop(self, gen_len: int) -> bool:
        """transformers' stopping rules, once ``width`` hypotheses are finished."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        best_len = gen_len
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        best_possible = penalised_score(
            self.live_scores[0], length_denominator(best_len, self.length_penalty)
        )
        return best_possible <= self.finished[-1].score

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses; live beams (as ``length``) fill in if fewer finished."""
        hyps = list(self.finished)
        if len(hyps) < n:
            denominator = length_denominator(max(1, self.num_generated), self.length_penalty)
            hyps += sorted(
                (
                    Hypothesis(list(tokens), score, penalised_score(score, denominator), "length")
                    for tokens, score in zip(self.live_tokens, self.live_scores, strict=True)
                    if tokens
                ),
                key=lambda h: -h.score,
            )
        return hyps[:n]
