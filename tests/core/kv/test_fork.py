"""fork and copy-on-write: what beam search needs of the KV manager.

A simulated KV memory (block id -> token per slot) is written through block tables exactly
as the model runner writes K/V, and the copies the manager asks for are applied before the
writes, as the worker applies them. Random sequences of new requests (with prefix-cache
hits), decodes, forks and frees must keep every live request reading back its own tokens,
ref counts equal to the number of tables holding a block, and nothing leaked at the end.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler

BS = 4


def _request(rid: str, prompt: list[int], output: list[int] | None = None) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    r.output_token_ids = list(output or [])
    return r


class _Memory:
    """The KV tensors, reduced to the token id stored in each slot."""

    def __init__(self, kv: PagedKVManager) -> None:
        self.kv = kv
        self.slots: dict[tuple[int, int], int] = {}

    def compute(self, r: Request, num_new: int) -> None:
        for src, dst in self.kv.take_block_copies():
            for i in range(BS):
                if (src, i) in self.slots:
                    self.slots[(dst, i)] = self.slots[(src, i)]
        table = self.kv.block_table(r.request_id)
        for p in range(r.num_computed_tokens, r.num_computed_tokens + num_new):
            self.slots[(table[p // BS], p % BS)] = r.token_id(p)
        r.num_computed_tokens += num_new

    def read(self, r: Request) -> list[int | None]:
        table = self.kv.block_table(r.request_id)
        return [self.slots.get((table[p // BS], p % BS)) for p in range(r.num_computed_tokens)]


def _check_invariants(kv: PagedKVManager, live: dict[str, Request], memory: _Memory) -> None:
    holders: Counter[int] = Counter()
    for rid in live:
        holders.update(kv.block_table(rid))
    for block in kv.pool.blocks:
        assert block.ref_count == holders[block.block_id], block
        free = block.block_id in kv.pool.free_queue or block.block_id in kv.pool.fresh
        assert free == (block.ref_count == 0)
    for r in live.values():
        assert memory.read(r) == r.token_slice(0, r.num_computed_tokens), r.request_id


OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "decode", "fork", "free"]),
        st.integers(0, 50),
        st.lists(st.integers(0, 3), min_size=1, max_size=9),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, prefix_caching=st.booleans())
def test_fork_and_copy_on_write_keep_every_request_intact(
    ops: list[tuple[str, int, list[int]]], prefix_caching: bool
) -> None:
    kv = PagedKVManager(num_blocks=24, block_size=BS, enable_prefix_caching=prefix_caching)
    memory = _Memory(kv)
    live: dict[str, Request] = {}
    ids = itertools.count()
    for op, pick, tokens in ops:
        victims = sorted(live)
        target = live[victims[pick % len(victims)]] if victims else None
        if op == "new" or target is None:
            r = _request(f"r{next(ids)}", tokens)
            prefix = kv.lookup_prefix(r)
            if not kv.allocate(r, r.num_tokens - prefix.num_tokens, prefix):
                continue
            r.num_computed_tokens = prefix.num_tokens
            live[r.request_id] = r
            memory.compute(r, r.num_tokens - prefix.num_tokens)
        elif op == "decode":
            target.output_token_ids.append(tokens[0])
            if not kv.allocate(target, 1):
                target.output_token_ids.pop()
                continue
            memory.compute(target, 1)
        elif op == "fork":
            child = _request(f"r{next(ids)}", target.prompt_token_ids, target.output_token_ids)
            kv.fork(target, child)
            child.num_computed_tokens = target.num_computed_tokens
            live[child.request_id] = child
        else:
            kv.free(live.pop(target.request_id))
        _check_invariants(kv, live, memory)
    for r in list(live.values()):
        kv.free(r)
    assert kv.pool.num_free_blocks == kv.num_blocks  # no leak
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_writing_into_a_shared_partial_block_copies_it_once() -> None:
    kv = PagedKVManager(num_blocks=8, block_size=BS)
    parent = _request("p", [5, 6, 7, 8, 9, 10])  # 1.5 blocks
    assert kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    children = [_request(f"c{i}", parent.prompt_token_ids) for i in range(2)]
    for c in children:
        kv.fork(parent, c)
        c.num_computed_tokens = 6
    shared_full, shared_partial = kv.block_table("p")
    assert kv.pool.blocks[shared_partial].ref_count == 3
    copies = []
    for i, r in enumerate([parent, *children]):
        r.output_token_ids.append(20 + i)
        assert kv.allocate(r, 1)
        copies += kv.take_block_copies()
    # Two of the three sharers copy; the last one writes in place; the full block stays shared.
    assert copies == [
        (shared_partial, kv.block_table("p")[1]),
        (shared_partial, kv.block_table("c0")[1]),
    ]
    assert kv.block_table("c1") == [shared_full, shared_partial]
    assert kv.pool.blocks[shared_full].ref_count == 3
    for r in [parent, *children]:
        kv.free(r)
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_copy_on_write_needs_a_free_block() -> None:
    kv = PagedKVManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    parent = _request("p", [1, 2, 3, 4, 5])
    assert kv.allocate(parent, 5)
    parent.num_computed_tokens = 5
    child = _request("c", parent.prompt_token_ids)
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    other = _request("o", [9])
    assert not kv.allocate(other, 1)  # both blocks are held (shared)
    child.output_token_ids.append(1)
    assert not kv.allocate(child, 1)  # the copy needs a free block: refused, unchanged
    assert kv.block_table("c") == kv.block_table("p")


def test_scheduler_fork_puts_the_child_next_to_its_parent() -> None:
    kv = PagedKVManager(num_blocks=8, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    parent = _request("p", [1, 2, 3, 4, 5])
    sched.add_request(parent)
    out = sched.schedule()
    sched.update_after_step(out.scheduled)
    child = _request("c", parent.prompt_token_ids)
    sched.fork_request(parent, child)
    assert child in sched.running and child.num_computed_tokens == 5
    parent.output_token_ids.append(7)
    child.output_token_ids.append(8)
    out = sched.schedule()
    assert {r.request_id for r, n in out.scheduled} == {"p", "c"}
    assert len(out.plan.blocks_to_copy) == 1
    src, dst = out.plan.blocks_to_copy[0]
    assert {src, dst} == {kv.block_table("p")[1], kv.block_table("c")[1]}
    sched.finish_request("p", parent.status)
    sched.finish_request("c", child.status)
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_static_cannot_fork() -> None:
    kv = StaticKVManager(num_slots=2, max_model_len=16, block_size=BS)
    assert not kv.supports_fork
    parent = _request("p", [1, 2])
    assert kv.allocate(parent, 2)
    with pytest.raises(NotImplementedError):
        kv.fork(parent, _request("c", [1, 2]))
    assert kv.take_block_copies() == []
