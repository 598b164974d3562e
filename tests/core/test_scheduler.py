"""Scheduler: budgets, chunked prefill, preemption and priorities, without a model.

A fake "model" makes each next token a pure function of the tokens before it, so any
schedule (chunked, preempted, recomputed) must reproduce the unpressured outputs exactly.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler

BS = 4


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 50 + 2


def run(
    specs: list[tuple[int, int, int]],
    num_blocks: int,
    max_num_seqs: int = 8,
    budget: int = 16,
    policy: str = "fcfs",
    arrivals_per_step: int = 100,
) -> tuple[dict[str, list[int]], Scheduler, list[list[tuple[str, int]]]]:
    """Drive the scheduler to completion. specs: (prompt_len, max_tokens, priority)."""
    kv = PagedKVManager(num_blocks, BS)
    sched = Scheduler(kv, max_num_seqs, budget, policy)
    pending = [
        Request(
            f"r{i}",
            [(i * 7 + j) % 40 + 2 for j in range(p)],
            SamplingParams(max_tokens=m, ignore_eos=True),
            priority=prio,
            arrival_time=float(i),
        )
        for i, (p, m, prio) in enumerate(specs)
    ]
    finished: dict[str, list[int]] = {}
    trace = []
    for step in itertools.count():
        assert step < 5000, "scheduler stalled"
        for r in pending[:arrivals_per_step]:
            sched.add_request(r)
        pending = pending[arrivals_per_step:]
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        trace.append([(r.request_id, n) for r, n in out.scheduled])
        assert out.total_num_tokens <= budget
        assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
        assert len(sched.running) <= max_num_seqs
        if sched.has_unfinished():
            assert out.scheduled or pending or out.preempted_ids, "nothing scheduled with work left"
        for r, n in out.scheduled:
            # the KV reserved covers everything computed after this step
            assert len(kv.block_table(r.request_id)) * BS >= r.num_computed_tokens + n
        sched.update_after_step(out.scheduled)
        for r, _ in out.scheduled:
            if r.num_computed_tokens == r.num_tokens:
                status = r.append_output_token(next_token(r.prompt_token_ids + r.output_token_ids))
                if status is not None:
                    finished[r.request_id] = list(r.output_token_ids)
                    sched.finish_request(r.request_id, status)
    assert kv.pool.num_free_blocks == num_blocks, "blocks leaked"
    return finished, sched, trace


def expected_outputs(specs: list[tuple[int, int, int]]) -> dict[str, list[int]]:
    out = {}
    for i, (p, m, _) in enumerate(specs):
        tokens = [(i * 7 + j) % 40 + 2 for j in range(p)]
        gen = []
        for _ in range(m):
            gen.append(next_token(tokens + gen))
        out[f"r{i}"] = gen
    return out


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    specs = [(3, 20, 0), (40, 2, 0)]
    _, _, trace = run(specs, num_blocks=64, budget=8, arrivals_per_step=1)
    # while r1's long prompt is prefilled in chunks, r0 keeps decoding in the same steps
    mixed = [s for s in trace if ("r0", 1) in s and any(rid == "r1" and n > 1 for rid, n in s)]
    assert len(mixed) >= 3


def test_preemption_under_memory_pressure_reproduces_outputs() -> None:
    specs = [(10, 30, 0) for _ in range(6)]
    finished, sched, _ = run(specs, num_blocks=24, budget=64)
    assert sched.num_preemptions > 0
    assert finished == expected_outputs(specs)


def test_priority_policy_runs_urgent_first_and_preempts_least_important() -> None:
    specs = [(8, 12, 5), (8, 12, 5), (8, 12, 0)]
    kv = PagedKVManager(10, BS)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    reqs = [
        Request(
            f"r{i}", [3] * p, SamplingParams(max_tokens=m), priority=prio, arrival_time=float(i)
        )
        for i, (p, m, prio) in enumerate(specs)
    ]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r2"]


def test_abort_frees_blocks_anywhere() -> None:
    kv = PagedKVManager(32, BS)
    sched = Scheduler(kv, 4, 64)
    a = Request("a", [1] * 10, SamplingParams(max_tokens=5))
    b = Request("b", [2] * 10, SamplingParams(max_tokens=5))
    sched.add_request(a)
    sched.schedule()
    sched.add_request(b)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert a.status is RequestStatus.FINISHED_ABORTED and b.is_finished
    assert kv.pool.num_free_blocks == 32 and not sched.has_unfinished()
    assert sched.schedule().finished_ids == ["a", "b"]


@settings(max_examples=120, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.integers(11, 40),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    policy=st.sampled_from(["fcfs", "priority"]),
    arrivals=st.integers(1, 4),
)
def test_any_workload_finishes_with_the_unpressured_outputs(
    specs, num_blocks, max_num_seqs, budget, policy, arrivals
):
    # every single request fits alone (30 + 12 tokens <= 11 blocks of 4)
    finished, _, _ = run(specs, num_blocks, max_num_seqs, budget, policy, arrivals)
    assert finished == expected_outputs(specs)


def test_priority_arrival_preempts_a_less_urgent_running_request() -> None:
    kv = PagedKVManager(32, BS)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    low = Request(
        "low", [3] * 8, SamplingParams(max_tokens=20, ignore_eos=True), priority=5, arrival_time=0.0
    )
    sched.add_request(low)
    out = sched.schedule()
    sched.update_after_step(out.scheduled)
    low.append_output_token(7)
    urgent = Request(
        "urgent",
        [4] * 8,
        SamplingParams(max_tokens=2, ignore_eos=True),
        priority=0,
        arrival_time=1.0,
    )
    sched.add_request(urgent)
    out = sched.schedule()
    assert out.preempted_ids == ["low"]
    assert [r.request_id for r, _ in out.scheduled] == ["urgent"]
    assert low.num_computed_tokens == 0 and low.output_token_ids == [
        7
    ]  # recomputed later, output kept
    # equal priority never preempts (no ping-pong)
    peer = Request("peer", [5] * 8, SamplingParams(max_tokens=2), priority=0, arrival_time=2.0)
    sched.add_request(peer)
    sched.update_after_step(out.scheduled)
    assert sched.schedule().preempted_ids == []


def test_max_loras_bounds_the_adapters_running_at_once() -> None:
    """A request on a third adapter waits (later base or known-adapter requests pass it)."""
    sched = Scheduler(PagedKVManager(64, BS), 8, 64, max_loras=2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    loras = [1, 2, 3, 0, 1]
    for i, lora in enumerate(loras):
        sched.add_request(Request(f"r{i}", [2, 3, 4], params, arrival_time=float(i), lora_id=lora))
    first = sched.schedule()
    assert [r.request_id for r, _ in first.scheduled] == ["r0", "r1", "r3", "r4"]
    sched.update_after_step(first.scheduled)
    for request_id in ("r0", "r4"):  # adapter 1 no longer runs: adapter 3 may start
        sched.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
    assert "r2" in [r.request_id for r, _ in sched.schedule().scheduled]


def test_without_chunked_prefill_a_prompt_is_prefilled_in_one_step() -> None:
    """--no-enable-chunked-prefill: a prompt that does not fit what is left of the step
    budget waits for a step with room, and is then computed whole; with chunking it is split."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    def first_steps(enable_chunked_prefill: bool) -> list[list[tuple[str, int]]]:
        sched = Scheduler(
            PagedKVManager(64, BS), 8, 16, enable_chunked_prefill=enable_chunked_prefill
        )
        sched.add_request(Request("short", [2] * 10, params, arrival_time=0.0))
        sched.add_request(Request("long", [3] * 12, params, arrival_time=1.0))
        steps = []
        for _ in range(2):
            out = sched.schedule()
            steps.append([(r.request_id, n) for r, n in out.scheduled])
            sched.update_after_step(out.scheduled)
            for r, _ in out.scheduled:
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token(5)
        return steps

    assert first_steps(True)[0] == [("short", 10), ("long", 6)]
    assert first_steps(False) == [[("short", 10)], [("short", 1), ("long", 12)]]
