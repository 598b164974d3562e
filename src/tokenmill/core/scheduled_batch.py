"""ScheduledBatch: one step as a model runner reads it.

The scheduler's diff (``core/messages.StepPlan``) is applied by a worker's
``RequestStates`` to its own mirrors of the requests; what comes out is this: the scheduled
requests with their token counts, each one's whole block table, the block copies to make
first, and what the draft model reads. The runner, sampler, grammar matchers and draft
model read only this, in one process or many. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.request import Request


class ScheduledCounts:
    """What the scheduler's output and a worker's batch both read off ``scheduled``."""

    scheduled: list[tuple[Request, int]]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {req.request_id: n for req, n in self.scheduled}

    @property
    def total_num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ScheduledBatch(ScheduledCounts):
    """One step's requests (the worker's mirrors) and their KV layout."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, number of tokens to compute this step), in the scheduler's order."""
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests finished since the previous step (the runner drops their state)."""
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    """Per scheduled request, the block ids holding its KV in token order."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV blocks to copy before the forward: copy-on-write of blocks shared by forks."""
    draft_catch_up: dict[str, int] = field(default_factory=dict)
    """Speculation with a draft model, per request the draft runs on this step: how many
    tokens it reads from its valid count on (see ``Scheduler._fit_draft``)."""
