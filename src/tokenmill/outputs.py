"""Results handed back to callers: one RequestOutput per request, per step or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    """Times the request was preempted and recomputed."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first schedule."""

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time_s(self) -> float | None:
        """Time spent waiting before the first schedule."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    """``stop``, ``length`` or ``abort``; None while still running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion, if any."""
    text_delta: str = ""
    """Text added since the previous output of this request (for streaming)."""
    token_ids_delta: list[int] = field(default_factory=list)
    """Token ids added since the previous output of this request (for streaming)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: prompt, completions so far, and whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None
    """A pooling request's vector (its embedding); None for generation."""

    def copy(self) -> RequestOutput:
        """A copy whose completions' lists are its own, to fold later outputs into."""
        return replace(self, outputs=[_own_lists(c) for c in self.outputs])

    def add(self, delta: RequestOutput) -> None:
        """Fold the next DELTA output of the same request into this accumulated one."""
        mine = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            c = mine.get(new.index)
            if c is None:
                self.outputs.append(_own_lists(new))
                continue
            c.text += new.text
            c.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(new.logprobs)
            c.cumulative_logprob = new.cumulative_logprob
            c.finish_reason, c.stop_reason = new.finish_reason, new.stop_reason
            c.text_delta, c.token_ids_delta = new.text_delta, new.token_ids_delta
        self.finished = delta.finished
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.pooled is not None:
            self.pooled = delta.pooled


def _own_lists(c: CompletionOutput) -> CompletionOutput:
    return replace(
        c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs)
    )
