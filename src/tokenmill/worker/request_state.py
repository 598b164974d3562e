"""RequestStates: a worker's copy of each live sequence, kept up to date by the step diffs.

The engine sends a sequence once (``NewRequestData``) and then only what changed
(``CachedRequestData``); this table applies both and hands the runner an ordinary
``ScheduledBatch`` over its own ``Request`` mirrors (token ids, parameters, block table,
this step's draft-token count), so the runner, the sampler, the grammar matchers and the draft
model work the same in-process and in another process. A grammar that did not cross (nil)
is compiled again here, from the request's ``structured_outputs`` (``compile_grammar``).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.core.messages import NewRequestData, StepPlan, params_from_wire, pooling_from_wire
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduled_batch import ScheduledBatch


class RequestStates:
    """Request mirrors and block tables by sequence id."""

    def __init__(self, compile_grammar: Callable[[SamplingParams], object] | None = None) -> None:
        self.requests: dict[str, Request] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._compile_grammar = compile_grammar
        self._with_drafts: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def lora_ids(self) -> set[int]:
        return {r.lora_id for r in self.requests.values() if r.lora_id}

    def apply(self, plan: StepPlan) -> ScheduledBatch:
        """Forget finished sequences, take new ones, apply the diffs; the step to run."""
        requests, tables = self.requests, self.block_tables
        for rid in plan.finished_ids:
            requests.pop(rid, None)
            tables.pop(rid, None)
        for new in plan.new_requests:
            self._add(new)
        for cached in plan.cached_requests:
            rid = cached.request_id
            request = requests[rid]
            if cached.new_token_ids:
                request.output_token_ids.extend(cached.new_token_ids)
            request.num_computed_tokens = cached.num_computed_tokens
            if cached.replaces_block_ids:
                tables[rid] = list(cached.new_block_ids)
            elif cached.new_block_ids:
                tables[rid].extend(cached.new_block_ids)
        for request in self._with_drafts:  # last step's drafts are spent
            request.num_spec_tokens = 0
            request.spec_token_ids = []
        self._with_drafts = []
        for rid, num in plan.num_spec_tokens.items():  # the proposer fills them
            request = requests[rid]
            request.num_spec_tokens = num
            self._with_drafts.append(request)
        for rid, num in plan.num_draft_computed.items():
            requests[rid].num_draft_computed_tokens = num
        scheduled = [(requests[rid], n) for rid, n in plan.scheduled]
        return ScheduledBatch(
            scheduled=scheduled,
            preempted_ids=list(plan.preempted_ids),
            finished_ids=list(plan.finished_ids),
            block_tables={rid: tables[rid] for rid, _ in plan.scheduled},
            blocks_to_copy=[(s, d) for s, d in plan.blocks_to_copy],
            draft_catch_up=dict(plan.draft_catch_up),
        )

    def _add(self, new: NewRequestData) -> None:
        params = params_from_wire(new.sampling_params)
        grammar = new.grammar
        if grammar is None and params.structured_outputs is not None and self._compile_grammar:
            grammar = self._compile_grammar(params)
        request = Request(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=frozenset(new.eos_token_ids),
            max_total_tokens=new.max_total_tokens,
            index=new.index,
            lora_id=new.lora_id,
            is_beam=new.is_beam,
            grammar=grammar,
            pooling=pooling_from_wire(new.pooling),
            output_token_ids=list(new.output_token_ids),
            num_computed_tokens=new.num_computed_tokens,
            status=RequestStatus.RUNNING,
        )
        self.requests[new.request_id] = request
        self.block_tables[new.request_id] = list(new.block_ids)
