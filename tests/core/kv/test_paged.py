"""Paged KV block manager: prefix caching, sharing, eviction, and invariants under random use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), cache_salt=salt)


def _start(kv: PagedKVManager, req: Request) -> int:
    """Admit like the scheduler does; returns the number of cached tokens."""
    hit = kv.lookup_prefix(req)
    assert kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
    req.num_computed_tokens = req.num_tokens
    return hit.num_tokens


def check_invariants(kv: PagedKVManager, live: dict[str, Request]) -> None:
    pool = kv.pool
    refs = [0] * pool.num_blocks
    for rid in live:
        for b in kv.block_table(rid):
            refs[b] += 1
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], "ref count disagrees with block tables"
        listed = (block.block_id in pool.free_queue) + (block.block_id in pool.fresh)
        assert listed == (block.ref_count == 0), "free queue out of sync"
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] == block.block_id
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash
    for rid, req in live.items():
        assert len(kv.block_table(rid)) == -(-req.num_computed_tokens // BS)


def test_second_request_reuses_prefix_blocks() -> None:
    kv = PagedKVManager(num_blocks=16, block_size=BS)
    a = _req("a", list(range(10)))
    assert _start(kv, a) == 0
    b = _req("b", list(range(8)) + [99, 98, 97])
    assert _start(kv, b) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.pool.blocks[kv.block_table("a")[0]].ref_count == 2
    assert kv.stats.num_hit_tokens == 8


def test_cached_blocks_survive_free_until_evicted() -> None:
    kv = PagedKVManager(num_blocks=4, block_size=BS)
    a = _req("a", list(range(9)))
    _start(kv, a)
    kv.free(a)
    assert kv.usage == 0.0
    assert _start(kv, _req("b", list(range(9)))) == 8  # revived from the free queue
    kv.free(_req("b", []))
    # a different prompt needs all 4 blocks: the cached ones are evicted
    c = _req("c", list(range(100, 116)))
    assert _start(kv, c) == 0
    assert not kv.pool.cached or all(kv.pool.blocks[b].ref_count for b in kv.pool.cached.values())


def test_prefix_caching_off_shares_only_within_salt() -> None:
    kv = PagedKVManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a0, a1 = _req("a#0", list(range(9)), salt="a"), _req("a#1", list(range(9)), salt="a")
    _start(kv, a0)
    assert _start(kv, a1) == 8  # n > 1 siblings share the prompt's blocks
    other = _req("b", list(range(9)), salt="b")
    assert _start(kv, other) == 0
    kv.free(a0)
    kv.free(a1)
    assert _start(kv, _req("a2", list(range(9)), salt="a")) == 0  # nothing kept once freed


def test_collision_guard_checks_tokens() -> None:
    kv = PagedKVManager(num_blocks=8, block_size=BS)
    a = _req("a", [1, 2, 3, 4, 5])
    _start(kv, a)
    block = kv.pool.blocks[kv.block_table("a")[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a hash collision: same hash, other tokens
    assert kv.lookup_prefix(_req("b", [1, 2, 3, 4, 5])).num_tokens == 0


def test_full_hit_still_computes_last_token() -> None:
    kv = PagedKVManager(num_blocks=8, block_size=BS)
    _start(kv, _req("a", list(range(8))))
    hit = kv.lookup_prefix(_req("b", list(range(8))))
    assert hit.num_tokens == 4  # the last block is recomputed to produce logits


def test_allocate_fails_cleanly_when_full() -> None:
    kv = PagedKVManager(num_blocks=2, block_size=BS)
    a = _req("a", list(range(8)))
    _start(kv, a)
    b = _req("b", list(range(50, 55)))
    before = (kv.pool.num_free_blocks, dict(kv.pool.cached))
    assert not kv.allocate(b, 5)
    assert (kv.pool.num_free_blocks, dict(kv.pool.cached)) == before
    assert kv.block_table("b") == []


ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "append", "fork", "free", "evict"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 3), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(3, 24), st.booleans(), st.booleans())
def test_random_operations_keep_invariants(
    operations, num_blocks: int, caching: bool, fills_pool: bool
) -> None:
    """start / append / fork (a sibling with the same salt) / free / evict, in any order.

    By default the blocks ever touched never exceed the most blocks live at once: resident
    memory follows the working set, not the traffic's length."""
    kv = PagedKVManager(
        num_blocks=num_blocks,
        block_size=BS,
        enable_prefix_caching=caching,
        cache_fills_pool=fills_pool,
    )
    live: dict[str, Request] = {}
    counter = 0
    peak = 0
    for op, slot, tokens in operations:
        rid = f"r{slot}"
        if op == "start" and rid not in live:
            counter += 1
            req = _req(rid, tokens, salt=None if caching else f"s{counter}")
            hit = kv.lookup_prefix(req)
            if kv.allocate(req, req.num_tokens - hit.num_tokens, hit):
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
        elif op == "fork" and rid in live:
            parent = live[rid]
            child_id = f"r{(slot + 1) % 8}"
            if child_id not in live:
                child = _req(child_id, parent.prompt_token_ids, salt=parent.cache_salt)
                hit = kv.lookup_prefix(child)
                if kv.allocate(child, child.num_tokens - hit.num_tokens, hit):
                    child.num_computed_tokens = child.num_tokens
                    live[child_id] = child
                    shared = set(kv.block_table(child_id)) & set(kv.block_table(rid))
                    assert len(shared) * BS >= hit.num_tokens
        elif op == "append" and rid in live:
            req = live[rid]
            req.output_token_ids.extend(tokens)
            if kv.allocate(req, len(tokens)):
                req.num_computed_tokens = req.num_tokens
            else:
                del req.output_token_ids[-len(tokens) :]
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        elif op == "evict" and kv.pool.num_free_blocks:
            # a one-block request that takes the LRU free block (evicting its cache entry)
            filler = _req(f"fill{counter}", [100 + slot] * BS)
            counter += 1
            if kv.allocate(filler, BS):
                filler.num_computed_tokens = BS
                peak = max(peak, kv.pool.num_blocks - kv.pool.num_free_blocks)
                kv.free(filler)
        check_invariants(kv, live)
        peak = max(peak, kv.pool.num_blocks - kv.pool.num_free_blocks)
        if not fills_pool:
            assert kv.pool.num_touched_blocks <= peak, (
                "a fresh block taken while freed ones were free"
            )
    for req in list(live.values()):
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_freed_blocks_are_reused_before_fresh_ones() -> None:
    """A long run of one-at-a-time requests touches one request's blocks, not the pool."""
    kv = PagedKVManager(num_blocks=64, block_size=BS)
    for i in range(40):
        req = _req(f"r{i}", [1000 + i] * 9)  # 3 blocks, 2 of them cached when freed
        _start(kv, req)
        kv.free(req)
    assert kv.pool.num_touched_blocks == 3


def test_prefix_cache_may_fill_the_pool_when_asked() -> None:
    """With cache_fills_pool, cached prefixes outlive fresh blocks: 40 distinct prompts all
    stay cached in a 64-block pool (and the pool's touched part grows with them)."""
    kv = PagedKVManager(num_blocks=200, block_size=BS, cache_fills_pool=True)
    for i in range(40):
        req = _req(f"r{i}", [1000 + i] * 9)
        _start(kv, req)
        kv.free(req)
    assert kv.pool.num_touched_blocks == 81
    assert _start(kv, _req("again", [1000] * 9)) == 8  # the first prompt's blocks survived
