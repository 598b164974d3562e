"""The scheduler's diff: after every step, a worker that only ever saw the msgpack-encoded
diffs holds exactly the scheduler's tokens, computed counts and block tables (no model).

Preemption (tables freed and rebuilt), prefix-cache hits, chunked prefill, forks with
copy-on-write, rejected drafts (truncated tables) and finishes are driven by a real
scheduler over a tight paged KV cache; the diff is checked to be small.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.messages import StepPlan, decode_plan, encode, plan_for_wire
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.worker.request_state import RequestStates

BS = 4


def _wire(plan: StepPlan) -> StepPlan:
    """The plan as a worker in another process decodes it."""
    return decode_plan(encode(plan_for_wire(plan)))


def _drive(kv, specs: list[tuple[int, int]], budget: int, shared: int) -> dict[str, int]:
    sched = Scheduler(kv, 4, budget)
    states = RequestStates()
    for i, (p, m) in enumerate(specs):
        prompt = list(range(2, 2 + shared)) + [(i * 7 + j) % 40 + 2 for j in range(p)]
        sched.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True, seed=i))
        )
    counts = {"new": 0, "cached": 0, "replaced": 0, "steps": 0}
    for step in itertools.count():
        assert step < 3000, "stalled"
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        plan = _wire(out.plan)
        seen = states.apply(plan)
        counts["steps"] += 1
        counts["new"] += len(plan.new_requests)
        counts["cached"] += len(plan.cached_requests)
        counts["replaced"] += sum(c.replaces_block_ids for c in plan.cached_requests)
        assert [(r.request_id, n) for r, n in seen.scheduled] == [
            (r.request_id, n) for r, n in out.scheduled
        ]
        for (mirror, _), (request, _) in zip(seen.scheduled, out.scheduled, strict=True):
            assert mirror.prompt_token_ids == request.prompt_token_ids
            assert mirror.output_token_ids == request.output_token_ids
            assert mirror.num_computed_tokens == request.num_computed_tokens
            assert mirror.sampling_params == request.sampling_params
            assert seen.block_tables[mirror.request_id] == kv.block_table(request.request_id)
        for c in plan.cached_requests:  # a diff carries what is new, not the history
            assert len(c.new_token_ids) <= 1
        sched.update_after_step(out.scheduled)
        for request, _ in out.scheduled:
            if request.num_computed_tokens == request.num_tokens:
                status = request.append_output_token(request.num_tokens % 37 + 2)
                if status is not None:
                    sched.finish_request(request.request_id, status)
    assert len(states) <= len(specs)
    return counts


def test_diff_rebuilds_the_engine_state_through_preemption_and_prefix_hits() -> None:
    specs = [(6 + i % 5, 10 + i % 7) for i in range(10)]
    counts = _drive(PagedKVManager(14, BS), specs, budget=12, shared=8)
    assert counts["replaced"] > 0  # preempted requests came back with new tables
    assert counts["cached"] > counts["new"]  # most steps sent only diffs


def test_diff_on_static_slots() -> None:
    kv = StaticKVManager(3, 64, BS)
    counts = _drive(kv, [(5 + i, 6) for i in range(7)], budget=16, shared=4)
    assert counts["new"] >= 7


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=8),
    num_blocks=st.integers(12, 30),
    budget=st.integers(4, 24),
    shared=st.integers(0, 9),
)
def test_diff_matches_any_schedule(specs, num_blocks: int, budget: int, shared: int) -> None:
    _drive(PagedKVManager(num_blocks, BS), specs, budget, shared)


def test_draft_counts_cross_for_their_step_only() -> None:
    """A step's draft-token count reaches the mirror with that step and is gone the next."""
    kv = PagedKVManager(16, BS)
    sched = Scheduler(kv, 4, 32)
    states = RequestStates()
    request = Request("r", [2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(request)
    for drafts in (0, 4, 0, 2, 0):
        request.num_spec_tokens = drafts
        out = sched.schedule()
        seen = states.apply(_wire(out.plan))
        (mirror, _), (_, num_new) = seen.scheduled[0], out.scheduled[0]
        assert mirror.num_spec_tokens == drafts and mirror.spec_token_ids == []
        assert seen.block_tables["r"] == kv.block_table("r")  # rejected drafts' blocks go
        sched.update_after_step(out.scheduled)
        request.append_output_token(9)
        sched.rollback_unverified(request)
        assert num_new >= 1


def test_forked_requests_and_their_copies_reach_the_workers() -> None:
    """Beams fork a parent's blocks; the first to write into the shared partly filled block
    gets a private copy. The workers learn the child whole, and the copy-on-write table."""
    kv = PagedKVManager(32, BS)
    sched = Scheduler(kv, 8, 64)
    states = RequestStates()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    parent = Request("p", [2, 3, 4, 5, 6, 7], params)
    sched.add_request(parent)
    rebuilt = 0
    for step in range(8):
        out = sched.schedule()
        plan = _wire(out.plan)
        rebuilt += sum(c.replaces_block_ids for c in plan.cached_requests)
        seen = states.apply(plan)
        assert sorted(seen.blocks_to_copy) == sorted(out.plan.blocks_to_copy)
        for request, _ in out.scheduled:
            mirror = states.requests[request.request_id]
            assert mirror.output_token_ids == request.output_token_ids
            assert seen.block_tables[request.request_id] == kv.block_table(request.request_id)
        sched.update_after_step(out.scheduled)
        for request, _ in out.scheduled:
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(step % 30 + 2)
        if step == 1:  # a beam branches off after the prompt and a token
            child = Request("c", list(parent.prompt_token_ids), params)
            child.output_token_ids = list(parent.output_token_ids)
            sched.fork_request(parent, child)
    assert rebuilt > 0  # the copy-on-write replaced a shared block in a known table
