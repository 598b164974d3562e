"""Prefix-aware routing over data-parallel replicas, without any replica running."""

from __future__ import annotations

from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.prefix_router import PrefixAffinityRouter, prompt_block_hashes
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams

BS = 4


def test_hashes_are_the_paged_caches_own() -> None:
    prompt = list(range(2, 13))  # 2 full blocks and a partial one
    kv = PagedKVManager(8, BS)
    request = Request("r", prompt, SamplingParams())
    assert prompt_block_hashes(prompt, BS) == kv._block_hashes(request, 2)


def test_shared_prefixes_go_to_one_replica_and_others_spread() -> None:
    router = PrefixAffinityRouter(2, BS)
    system_a, system_b = list(range(100, 116)), list(range(200, 216))
    first_a = router.route(system_a + [1, 2])
    first_b = router.route(system_b + [3])
    assert first_a != first_b  # no match: the least loaded one
    for i in range(6):
        assert router.route(system_a + [i, i + 1, i + 2, i + 3, i]) == first_a
        assert router.route(system_b + [i]) == first_b
    assert router.num_affinity_hits == 12


def test_new_prefixes_spread_over_idle_replicas() -> None:
    router = PrefixAffinityRouter(2, BS)
    homes = []
    for p in range(4):  # one at a time: every load is 0 when each is routed
        prefix = list(range(100 * p, 100 * p + 2 * BS))
        homes.append(router.route(prefix))
        router.finished(homes[-1])
    assert sorted(homes) == [0, 0, 1, 1]


def test_load_beats_affinity_past_the_imbalance_bound() -> None:
    router = PrefixAffinityRouter(2, BS, max_load_imbalance=2)
    prompt = list(range(50, 70))
    home = router.route(prompt)
    assert [router.route(prompt) for _ in range(2)] == [home, home]  # loads 3 vs 0 now
    assert router.route(prompt) != home
    for _ in range(3):
        router.finished(home)
    assert router.route(prompt) == home


def test_a_dead_replica_is_forgotten_and_skipped() -> None:
    router = PrefixAffinityRouter(3, BS)
    prompt = list(range(10, 30))
    home = router.route(prompt)
    router.mark_dead(home)
    other = router.route(prompt)
    assert other != home
    router.mark_alive(home)
    assert router.route(prompt) == other  # the prefix now lives on the other one


def test_memory_per_replica_is_bounded() -> None:
    router = PrefixAffinityRouter(1, BS, max_blocks_per_replica=5)
    for i in range(20):
        router.route([i * 1000 + j for j in range(4 * BS)])
    assert len(router._blocks[0]) == 5
    assert len(router._holders) == 5


def test_the_table_evicts_a_chains_deepest_blocks_first() -> None:
    router = PrefixAffinityRouter(2, BS, max_blocks_per_replica=4)
    shared = list(range(100, 100 + 3 * BS))  # 3 blocks
    home = router.route(shared)
    router.route(list(range(500, 500 + 2 * BS)))  # load evens out: the other replica
    router.route(shared + list(range(900, 900 + 2 * BS)))  # 5 blocks on `home`: one goes
    router.finished(home)
    router.finished(home)
    # The chain's first block survived, so the shared prefix still finds its replica.
    assert router.choose(prompt_block_hashes(shared, BS)) == (home, 3)


def test_a_restarted_replica_is_not_undercounted_by_requests_from_before() -> None:
    router = PrefixAffinityRouter(2, BS)
    before = router.route(list(range(10, 30)))
    router.mark_dead(before)
    router.mark_alive(before)
    router.started(before, [])  # a new request on the restarted replica
    router.finished(before)  # the old, failed request ends
    assert router.load[before] == 1
