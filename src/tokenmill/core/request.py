"""Request: the scheduler's view of one sequence being generated (no torch here).

A request owns its token ids (prompt + output), how many of them already have KV in the
cache (``num_computed_tokens``), and its life-cycle status. One user request with
``n > 1`` becomes n of these, sharing a ``cache_salt`` so their prompt blocks are shared.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.outputs import RequestMetrics
from tokenmill.pooling_params import PoolingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life cycle."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return self.value if self.is_finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)
class Request:
    """One sequence: prompt tokens, generated tokens and scheduling state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 2**31
    """Hard cap on prompt + output length (the context limit)."""
    priority: int = 0
    """Lower runs first under the priority policy."""
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Requests share prefix-cache blocks only when their salts are equal."""
    parent_id: str | None = None
    """The user-visible request this one belongs to (n > 1 fans out into children)."""
    index: int = 0
    """Position among the parent's n completions."""
    lora_id: int = 0
    """The LoRA adapter it runs with (``LoRARequest.lora_int_id``); 0: the base model."""
    grammar: object | None = None
    """The compiled structured-output grammar, opaque here; the worker keeps its matcher."""
    is_beam: bool = False
    """A beam of a beam search: it yields to standard requests (scheduled after them,
    preempted first) and counts against its own bound, not ``max_num_seqs``."""
    pooling: PoolingParams | None = None
    """Set for a pooling request: prefilled, then its hidden states pooled instead of sampled."""

    output_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0
    """Speculative tokens scheduled after the last output token this step (a count: the
    engine asks for them, the scheduler trims them to the budget; the proposer on the
    workers holds the tokens themselves)."""
    num_proposable: int = 0
    """How many tokens the workers' proposer has ready for this request's next step (its
    last ``StepOutput.num_proposable``)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """On a worker's mirror: this step's ``num_spec_tokens`` draft tokens, filled by the
    proposer before the forward, then verified (accepted into ``output_token_ids`` or
    dropped). Never set on the engine's side."""
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0
    """Speculation with a draft model: tokens whose draft-model KV was written (those past
    ``num_computed_tokens`` were rejected drafts, so only the smaller count is valid)."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.parent_id is None:
            self.parent_id = self.request_id

    # ---- token views -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, position: int) -> int:
        """Token at absolute position (prompt first, then output)."""
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens in [start, end) over prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_output_tokens(self) -> int:
        """Tokens this request may produce in total: its ``max_tokens``, which the input
        processor resolved within the context (``engine/request_limits.py``); None (the
        engine's own requests) runs to the context's end, where every request stops."""
        max_tokens = self.sampling_params.max_tokens
        return self.max_total_tokens - self.num_prompt_tokens if max_tokens is None else max_tokens

    # ---- transitions -------------------------------------------------------------
    def append_output_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status it causes, if any."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        num_out = len(self.output_token_ids)
        if num_out >= params.min_tokens:
            if token_id in (params.stop_token_ids or ()):
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_output_tokens or self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def num_draft_lag(self) -> int:
        """Tokens the draft model must read before it can propose after the last one."""
        return self.num_tokens - min(self.num_draft_computed_tokens, self.num_computed_tokens)

    def reset_for_recompute(self) -> None:
        """Preempted: its KV is dropped, so every token must be computed again."""
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0
        self.num_spec_tokens = 0
        self.num_proposable = 0
        self.spec_token_ids = []
        self.status = RequestStatus.PREEMPTED
        self.metrics.num_preemptions += 1
