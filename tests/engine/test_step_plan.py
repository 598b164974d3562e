"""The step diff: after every step, a worker that only ever saw the msgpack-encoded diffs
holds exactly the engine's tokens, computed counts and block tables (no model needed).

Preemption (tables freed and rebuilt), prefix-cache hits, chunked prefill and finishes are
driven by a real scheduler over a tight paged KV cache; the diff is checked to be small.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.messages import decode_plan, encode
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.step_plan import StepPlanBuilder
from tokenmill.worker.request_state import RequestStates

BS = 4


def _drive(kv, specs: list[tuple[int, int]], budget: int, shared: int) -> dict[str, int]:
    sched = Scheduler(kv, 4, budget)
    builder = StepPlanBuilder(in_process=False)
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
        plan = decode_plan(encode(builder.build(out)))
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
            assert seen.block_tables[mirror.request_id] == out.block_tables[request.request_id]
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


def test_draft_tokens_cross_for_their_step_only() -> None:
    """A step's draft tokens reach the mirror with that step and are gone the next."""
    kv = PagedKVManager(16, BS)
    sched = Scheduler(kv, 4, 32)
    builder, states = StepPlanBuilder(in_process=False), RequestStates()
    request = Request("r", [2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(request)
    for drafts in ([], [7, 8], []):
        request.spec_token_ids = list(drafts)
        out = sched.schedule()
        seen = states.apply(decode_plan(encode(builder.build(out))))
        (mirror, _), (_, num_new) = seen.scheduled[0], out.scheduled[0]
        assert mirror.spec_token_ids == drafts
        sched.update_after_step(out.scheduled)
        request.append_output_token(9)
        sched.rollback_unverified(request)
        assert num_new >= 1
