"""The KVCacheManager contract, run against both implementations (paged and static)."""

from __future__ import annotations

import pytest

from tokenmill.core.kv.base import KVCacheManager
from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler

BS = 4
MAX_LEN = 32
SLOTS = 3


def make(kind: str) -> KVCacheManager:
    if kind == "paged":
        return PagedKVManager(num_blocks=SLOTS * MAX_LEN // BS, block_size=BS)
    return StaticKVManager(num_slots=SLOTS, max_model_len=MAX_LEN, block_size=BS)


def req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_total_tokens=MAX_LEN,
    )


KINDS = ["paged", "static"]


@pytest.mark.parametrize("kind", KINDS)
def test_block_table_covers_allocated_tokens(kind: str) -> None:
    kv = make(kind)
    r = req("a", list(range(10)))
    assert kv.allocate(r, 10)
    table = kv.block_table("a")
    assert len(table) * BS >= 10 and len(set(table)) == len(table)
    assert all(0 <= b < kv.num_blocks for b in table)
    r.num_computed_tokens = 10
    r.output_token_ids.append(7)
    assert kv.allocate(r, 1)
    assert kv.block_table("a")[: len(table)] == table  # growing never moves earlier tokens


@pytest.mark.parametrize("kind", KINDS)
def test_live_requests_never_share_writable_blocks(kind: str) -> None:
    kv = make(kind)
    tables = []
    for i in range(SLOTS):
        r = req(f"r{i}", [100 + i] * 9)
        assert kv.allocate(r, 9)
        tables.append(set(kv.block_table(f"r{i}")[:3]))
    for i in range(SLOTS):
        for j in range(i + 1, SLOTS):
            assert not tables[i] & tables[j]


@pytest.mark.parametrize("kind", KINDS)
def test_free_returns_everything(kind: str) -> None:
    kv = make(kind)
    rs = [req(f"r{i}", [i] * 12) for i in range(SLOTS)]
    for r in rs:
        assert kv.allocate(r, 12)
    assert kv.usage > 0
    for r in rs:
        r.num_computed_tokens = 12
        kv.free(r)
    assert kv.usage == 0.0
    assert kv.num_reserved_token_slots == 0
    assert all(kv.block_table(r.request_id) == [] for r in rs)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_of_a_finished_request_is_reused(kind: str) -> None:
    kv = make(kind)
    a = req("a", list(range(20)))
    assert kv.allocate(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    b = req("b", list(range(16)) + [99, 98])
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens >= 16 - (16 % BS)
    assert kv.allocate(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.stats.num_hit_tokens == hit.num_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_drives_either_manager_to_completion(kind: str) -> None:
    kv = make(kind)
    sched = Scheduler(kv, max_num_seqs=SLOTS, max_num_batched_tokens=16)
    rs = [
        req(f"r{i}", [i + 5] * (3 + i), max_tokens=6) for i in range(8)
    ]  # more requests than slots
    for r in rs:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert len(sched.running) <= SLOTS
        sched.update_after_step(out.scheduled)
        for r, _ in out.scheduled:
            if r.num_computed_tokens == r.num_tokens:
                status = r.append_output_token(3)
                if status:
                    sched.finish_request(r.request_id, status)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in rs)
    assert kv.usage == 0.0


def test_static_admission_waits_for_a_slot_and_never_preempts() -> None:
    kv = make("static")
    sched = Scheduler(kv, max_num_seqs=10, max_num_batched_tokens=100)
    rs = [req(f"r{i}", [1] * 5) for i in range(5)]
    for r in rs:
        sched.add_request(r)
    out = sched.schedule()
    assert len(out.scheduled) == SLOTS and sched.num_waiting == 2 and not out.preempted_ids
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    sched.update_after_step(out.scheduled)
    out = sched.schedule()
    assert "r3" in out.num_scheduled_tokens  # the aborted request's slot went to the next one


@pytest.mark.parametrize("kind", KINDS)
def test_fork_is_declared_honestly(kind: str) -> None:
    """A strategy either forks (the child reads the parent's blocks) or says it cannot."""
    kv = make(kind)
    parent = req("p", list(range(6)))
    assert kv.allocate(parent, 6)
    child = req("c", list(range(6)))
    if kv.supports_fork:
        kv.fork(parent, child)
        assert kv.block_table("c") == kv.block_table("p")
        kv.free(child)
    else:
        with pytest.raises(NotImplementedError):
            kv.fork(parent, child)
    kv.free(parent)
    assert kv.take_block_copies() == []
    assert kv.usage == 0.0
