"""Scheduler: decides, every step, how many tokens of which requests to compute.

The output is ``{request_id: num_tokens}``: prefill, chunked prefill, decode and recompute
after preemption are one mechanism (a request simply has ``num_tokens -
num_computed_tokens`` tokens left to compute, plus any speculative tokens proposed after its
last one, which are scheduled with it whole or dropped when the budget or KV is short;
with a draft model, the draft's own tokens are charged to the same budget, see
``_fit_draft``). Running requests are served first, in
policy order, then waiting ones are admitted while the token budget, ``max_num_seqs`` and
KV memory allow. When memory runs out the lowest-priority, most recently arrived running
request is preempted (its KV freed, recomputed later). Beams of beam searches are a class
of their own: ``max_num_seqs`` bounds standard and beam sequences apart (so beams never
take a standard request's place in the batch), and beams come after standard requests of
the same priority, so they get the token budget last and are preempted first. No torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.core.kv.base import Allocation, KVCacheManager
from tokenmill.core.messages import CachedRequestData, NewRequestData, StepPlan
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduled_batch import ScheduledCounts


@dataclass
class SchedulerOutput(ScheduledCounts):
    """One step: the diff the workers take (``plan``) and the engine's view of it.

    ``plan`` is what vLLM v1's scheduler output is: a request new to the workers once
    (prompt, parameters, whole block table), then per step only what changed (tokens
    appended since, block ids the KV manager's ``allocate`` added), the preempted and
    finished ids and the block copies. ``scheduled`` keeps the engine's own ``Request``s for
    its bookkeeping after the step; it never crosses to a worker."""

    plan: StepPlan = field(default_factory=StepPlan)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, number of tokens to compute this step), running ones first."""
    num_draft_model_tokens: int = 0
    """Tokens the draft model computes this step (catch-up plus draft inputs), charged to
    the token budget with the target's."""

    @property
    def preempted_ids(self) -> list[str]:
        return self.plan.preempted_ids

    @property
    def finished_ids(self) -> list[str]:
        """Requests finished since the previous step (the workers drop their state)."""
        return self.plan.finished_ids

    @property
    def draft_catch_up(self) -> dict[str, int]:
        """Speculation with a draft model, per request the draft runs on this step: how many
        tokens it reads from its valid count on (all of its lag when it then proposes the
        request's ``num_spec_tokens``; part of it, and no proposal, when the budget is short)."""
        return self.plan.draft_catch_up


class Scheduler:
    """Continuous batching over a KVCacheManager, FCFS or priority."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_loras: int | None = None,
        enable_chunked_prefill: bool = True,
        draft_model: bool = False,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.kv = kv_manager
        self.max_loras = max_loras
        """Most LoRA adapters among running requests (the device slots); None: no LoRA."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        """Off: a waiting request is admitted only when its whole prompt fits this step's budget."""
        self.draft_model = draft_model
        """Speculation by a draft model: its catch-up and drafting count in the token budget."""
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._num_tokens_sent: dict[str, int] = {}
        """Per request the workers hold: how many of its tokens they have (a request not
        here is sent whole the next time it is scheduled)."""
        self.num_preemptions = 0

    # ---- ordering --------------------------------------------------------------------
    def _key(self, request: Request) -> tuple[int, bool, float, str]:
        """Sort key: earlier means more important (beams after standard requests)."""
        priority = request.priority if self.policy == "priority" else 0
        return (priority, request.is_beam, request.arrival_time, request.request_id)

    def _num_running(self, is_beam: bool) -> int:
        """Running sequences of one class (standard or beam): each has ``max_num_seqs``."""
        return sum(1 for r in self.running if r.is_beam == is_beam)

    # ---- public API ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._insert_waiting(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length or abort) a request wherever it is; frees its KV."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.metrics.finished_time = time.monotonic()
        self._finished_ids.append(request_id)
        self._num_tokens_sent.pop(request_id, None)
        return request

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add ``child`` sharing all of ``parent``'s KV (copy-on-write), next to it in its
        queue: a beam that branches off another is not a new arrival."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = parent.status
        self.requests[child.request_id] = child
        is_running = parent.status is RequestStatus.RUNNING
        self._insert_sorted(self.running if is_running else self.waiting, child)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(StepPlan(finished_ids=self._finished_ids))
        self._finished_ids = []
        allocations: dict[str, Allocation] = {}
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        if self.policy == "priority":
            self._preempt_for_urgent_waiting(out)

        # 1. Running requests, most important first; preempt from the back when full.
        is_memory_tight = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_left = request.num_tokens - request.num_computed_tokens
            catch_up = 0
            if request.num_spec_tokens and self.draft_model:
                catch_up = self._fit_draft(request, num_left, budget)
            elif request.num_spec_tokens:  # they fit after the last token, or are cut
                request.num_spec_tokens = min(request.num_spec_tokens, max(0, budget - num_left))
            num_new = min(num_left + request.num_spec_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while (allocation := self.kv.allocate(request, num_new)) is None:
                if request.num_spec_tokens:  # drop the guesses before anyone's KV
                    num_new -= request.num_spec_tokens
                    request.num_spec_tokens = 0
                    catch_up = min(catch_up, request.num_draft_lag - 1)  # no proposal now
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.plan.preempted_ids.append(victim.request_id)
                is_memory_tight = True
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                allocations[request.request_id] = allocation
                budget -= num_new
                if catch_up > 0:
                    draft_tokens = catch_up + max(0, request.num_spec_tokens - 1)
                    out.plan.draft_catch_up[request.request_id] = catch_up
                    out.num_draft_model_tokens += draft_tokens
                    budget -= draft_tokens
                i += 1
                continue
            break  # the current request itself was preempted: nothing after it fits

        # 2. Waiting requests, unless this step had to preempt (memory is tight). One whose
        # adapter would exceed max_loras among running requests waits; later ones may pass it.
        active_loras = {r.lora_id for r in self.running if r.lora_id}
        index = 0
        num_running = {False: self._num_running(False), True: self._num_running(True)}
        while index < len(self.waiting) and budget > 0 and not is_memory_tight:
            if min(num_running.values()) >= self.max_num_seqs:
                break
            request = self.waiting[index]
            if num_running[request.is_beam] >= self.max_num_seqs:
                index += 1  # its class is full; one of the other class may still start
                continue
            if (
                request.lora_id
                and request.lora_id not in active_loras
                and len(active_loras) >= (self.max_loras or 0)
            ):
                index += 1
                continue
            if not self.kv.can_admit(request):
                break
            prefix = self.kv.lookup_prefix(request) if request.num_computed_tokens == 0 else None
            num_cached = prefix.num_tokens if prefix else 0
            num_left = request.num_tokens - request.num_computed_tokens - num_cached
            if not self.enable_chunked_prefill and num_left > budget:
                break  # it waits for a step with room for its whole prompt
            num_new = min(num_left, budget)
            allocation = self.kv.allocate(request, num_new, prefix)
            if allocation is None:
                break
            allocations[request.request_id] = allocation
            self.waiting.pop(index)
            if request.lora_id:
                active_loras.add(request.lora_id)
            request.num_computed_tokens += num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.metrics.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self._insert_running(request)
            num_running[request.is_beam] += 1
            out.scheduled.append((request, num_new))
            budget -= num_new
        self._emit_diff(out, allocations)
        return out

    def _emit_diff(self, out: SchedulerOutput, allocations: dict[str, Allocation]) -> None:
        """Fill ``out.plan`` for the scheduled requests: new to the workers, whole; known,
        only their appended tokens and the blocks ``allocate`` added (the whole table where
        it was rebuilt: preemption, copy-on-write, truncation)."""
        plan = out.plan
        sent = self._num_tokens_sent
        for request, num_new in out.scheduled:
            rid = request.request_id
            plan.scheduled.append((rid, num_new))
            if request.num_spec_tokens:
                plan.num_spec_tokens[rid] = request.num_spec_tokens
            if rid in plan.draft_catch_up:
                plan.num_draft_computed[rid] = request.num_draft_computed_tokens
            num_sent = sent.get(rid)
            if num_sent is None:
                plan.new_requests.append(new_request_data(request, self.kv.block_table(rid)))
            else:
                allocation = allocations[rid]
                plan.cached_requests.append(
                    CachedRequestData(
                        rid,
                        request.num_computed_tokens,
                        request.token_slice(num_sent, request.num_tokens),
                        allocation.block_ids,
                        allocation.replaces,
                    )
                )
            sent[rid] = request.num_tokens
        plan.blocks_to_copy = self.kv.take_block_copies()

    def update_after_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Advance computed-token counts once the runner has written their KV."""
        for request, num_new in scheduled:
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += num_new

    def rollback_unverified(self, request: Request) -> None:
        """After a step that verified speculative tokens (and appended the accepted ones):
        only tokens before the last one have valid KV now, so the computed count steps
        back and the KV blocks past it are released (rejected tokens' slots, no copy)."""
        request.num_spec_tokens = 0
        if request.is_finished:
            return
        num_valid = min(request.num_computed_tokens, request.num_tokens - 1)
        request.num_computed_tokens = num_valid
        self.kv.truncate(request, num_valid)

    def _fit_draft(self, request: Request, num_left: int, budget: int) -> int:
        """How many tokens the draft model reads for ``request`` this step; trims its
        ``num_spec_tokens`` to what fits the budget with them.

        The policy: the draft's tokens cost the budget as the target's do, in the request's
        own turn. Proposing d tokens costs the target num_left + d and the draft its lag
        (every token it has not read: after a prefill, the whole prompt) plus d - 1 inputs,
        so d is the most that fits. When not even one fits, the draft reads what the budget
        leaves (short of the last token) and proposes nothing: a long prompt is caught up
        in chunks, like a chunked prefill, and speculation starts once it is.
        """
        lag = request.num_draft_lag
        fit = (budget - num_left - lag + 1) // 2
        request.num_spec_tokens = min(request.num_spec_tokens, max(0, fit))
        if request.num_spec_tokens:
            return lag
        return max(0, min(lag - 1, budget - num_left))

    # ---- internals -------------------------------------------------------------------
    def _preempt_for_urgent_waiting(self, out: SchedulerOutput) -> None:
        """Make room for a waiting request more urgent than the least urgent running one.

        Runs before anything is scheduled, so a victim never holds KV for this step.
        """
        while self.waiting and self.running:
            urgent, victim = self.waiting[0], self.running[-1]
            if victim.priority <= urgent.priority:
                return
            first_chunk = min(urgent.num_tokens, self.max_num_batched_tokens)
            has_room = self._num_running(urgent.is_beam) < self.max_num_seqs
            if has_room and self.kv.can_admit(urgent, first_chunk):
                return
            self._preempt(victim)
            out.plan.preempted_ids.append(victim.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.reset_for_recompute()
        self.num_preemptions += 1
        self._insert_waiting(request)

    def _insert_waiting(self, request: Request) -> None:
        self._insert_sorted(self.waiting, request)

    def _insert_running(self, request: Request) -> None:
        self._insert_sorted(self.running, request)

    def _insert_sorted(self, queue: list[Request], request: Request) -> None:
        key = self._key(request)
        lo, hi = 0, len(queue)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(queue[mid]) <= key:
                lo = mid + 1
            else:
                hi = mid
        queue.insert(lo, request)


def new_request_data(request: Request, block_ids: list[int]) -> NewRequestData:
    """A request as the workers first take it (objects as they are: an executor that crosses
    a process turns them into builtins, ``messages.plan_for_wire``)."""
    return NewRequestData(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        block_ids=list(block_ids),
        num_computed_tokens=request.num_computed_tokens,
        eos_token_ids=sorted(request.eos_token_ids),
        index=request.index,
        lora_id=request.lora_id,
        max_total_tokens=request.max_total_tokens,
        is_beam=request.is_beam,
        pooling=request.pooling,
        grammar=request.grammar,
    )
