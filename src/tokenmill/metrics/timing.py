"""What the HTTP layer saw of one request: arrival, first and last tokens, per choice.

Timed on the event loop from the outputs it receives, never from objects the engine thread
still mutates; ``ServerMetrics.observe_finished`` turns one into histogram samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChoiceTiming:
    """When one choice's first and last tokens reached the server, and how many it has."""

    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if self.first_token_time is None or self.last_token_time is None or self.num_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_tokens - 1)


@dataclass
class RequestTiming:
    """One engine request (one prompt, all its n choices) as the server saw it end."""

    arrival_time: float
    """When the HTTP request arrived (time.monotonic), so tokenization counts."""
    end_time: float
    """Its final output, or when it was aborted or timed out."""
    num_prompt_tokens: int
    finished_reason: str
    """The first choice's reason (stop, length, abort): vLLM counts requests, not choices."""
    choices: list[ChoiceTiming] = field(default_factory=list)
    first_scheduled_time: float | None = None
    """From the engine; None if it was never scheduled."""
    n: int = 1
    """The request's ``n`` (vLLM's request_params_n)."""
    max_tokens: int | None = None
    """The request's ``max_tokens`` after clamping (vLLM's request_params_max_tokens)."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache served."""
    num_preemptions: int = 0

    @property
    def first_token_time(self) -> float | None:
        times = [c.first_token_time for c in self.choices if c.first_token_time is not None]
        return min(times) if times else None

    @property
    def last_token_time(self) -> float | None:
        times = [c.last_token_time for c in self.choices if c.last_token_time is not None]
        return max(times) if times else None

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)
