"""StepPlanBuilder: the scheduler's output turned into the diff the workers need.

It remembers, per sequence, how many tokens and which block ids the workers already hold,
so a step sends a new sequence whole once and afterwards only its appended tokens and new
block ids. A block table that no longer extends what was sent (preemption, copy-on-write of
a shared last block) is sent whole again; a sequence whose tokens shrank is sent as new.
The scheduler stays as it is: this is the one place that knows the wire format.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.messages import (
    CachedRequestData,
    NewRequestData,
    StepPlan,
    params_to_wire,
    pooling_to_wire,
)
from tokenmill.core.request import Request
from tokenmill.core.scheduler import SchedulerOutput


@dataclass
class _Sent:
    num_tokens: int
    block_ids: list[int]


class StepPlanBuilder:
    """Turns each ``SchedulerOutput`` into a ``StepPlan`` relative to what was sent before."""

    def __init__(self, in_process: bool = True) -> None:
        """``in_process``: hand parameters and grammars over as objects (nothing is encoded)."""
        self._sent: dict[str, _Sent] = {}
        self._in_process = in_process

    @property
    def num_known(self) -> int:
        """Sequences the workers hold state for."""
        return len(self._sent)

    def build(self, sched: SchedulerOutput) -> StepPlan:
        for rid in sched.finished_ids:
            self._sent.pop(rid, None)
        plan = StepPlan(
            scheduled=[(r.request_id, n) for r, n in sched.scheduled],
            finished_ids=list(sched.finished_ids),
            preempted_ids=list(sched.preempted_ids),
            blocks_to_copy=list(sched.blocks_to_copy),
            draft_catch_up=dict(sched.draft_catch_up),
        )
        for request, _ in sched.scheduled:
            rid = request.request_id
            table = sched.block_tables[rid]
            if request.spec_token_ids:
                plan.spec_token_ids[rid] = list(request.spec_token_ids)
            if rid in sched.draft_catch_up:
                plan.num_draft_computed[rid] = request.num_draft_computed_tokens
            sent = self._sent.get(rid)
            if sent is None or request.num_tokens < sent.num_tokens:
                if sent is not None:  # taken again from scratch
                    plan.finished_ids.append(rid)
                plan.new_requests.append(self._new(request, table))
                self._sent[rid] = _Sent(request.num_tokens, list(table))
                continue
            num_known = len(sent.block_ids)
            extends = len(table) >= num_known and table[:num_known] == sent.block_ids
            new_blocks = table[num_known:] if extends else list(table)
            plan.cached_requests.append(
                CachedRequestData(
                    rid,
                    request.num_computed_tokens,
                    request.token_slice(sent.num_tokens, request.num_tokens),
                    new_blocks,
                    not extends,
                )
            )
            sent.num_tokens = request.num_tokens
            if extends:
                sent.block_ids.extend(new_blocks)
            else:
                sent.block_ids = list(table)
        return plan

    def _new(self, request: Request, table: list[int]) -> NewRequestData:
        params = request.sampling_params
        inproc = self._in_process
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=params if inproc else params_to_wire(params),
            block_ids=list(table),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=sorted(request.eos_token_ids),
            index=request.index,
            lora_id=request.lora_id,
            max_total_tokens=request.max_total_tokens,
            pooling=request.pooling if inproc else pooling_to_wire(request.pooling),
            grammar=request.grammar if inproc else None,
        )
