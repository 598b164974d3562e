"""PrefixAffinityRouter: which data-parallel replica should take a prompt (no torch).

The front end hashes a prompt's full blocks exactly as the paged KV cache does
(``core/kv/paged.hash_block``: chained, so one hash stands for the whole prefix up to it)
and remembers which hashes it sent to which replica. A prompt goes to the replica holding
its longest chain of leading blocks, the one most likely to have them in its prefix cache,
unless that replica is busier than the least loaded one by more than
``max_load_imbalance`` requests (then load wins, as Ray Serve's
``PrefixCacheAffinityRouter`` and SGLang's cache-aware router do); with no match it goes to
the least loaded replica (of equally loaded ones, the one holding the fewest blocks). Each replica's memory of hashes is an LRU bounded by
``max_blocks_per_replica`` (about its KV cache's size in blocks: older blocks have likely
been evicted there too). Lookup costs O(matched blocks), not O(replicas).
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.core.kv.paged import BlockHash, hash_block


def prompt_block_hashes(
    token_ids: list[int], block_size: int, salt: str | None = None
) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks (the paged cache's own)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        hashes.append(hash_block(hashes[-1] if hashes else None, salt, block))
    return hashes


class PrefixAffinityRouter:
    """Routing state of one front end over ``num_replicas`` replicas."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_blocks_per_replica: int = 1 << 16,
        max_load_imbalance: int = 8,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_load_imbalance = max_load_imbalance
        self.load = [0] * num_replicas
        """Requests sent to each replica and not finished yet."""
        self.is_alive = [True] * num_replicas
        self._blocks: list[OrderedDict[BlockHash, None]] = [
            OrderedDict() for _ in range(num_replicas)
        ]
        self._holders: dict[BlockHash, set[int]] = {}
        self.num_affinity_hits = 0
        """Requests routed by prefix (the rest went to the least loaded replica)."""

    @property
    def num_replicas(self) -> int:
        return len(self.load)

    def live_replicas(self, exclude: frozenset[int] = frozenset()) -> list[int]:
        return [r for r in range(self.num_replicas) if self.is_alive[r] and r not in exclude]

    def choose(
        self, hashes: list[BlockHash], exclude: frozenset[int] = frozenset()
    ) -> tuple[int, int]:
        """(replica, leading blocks it is believed to hold) for a prompt's block hashes.

        ``exclude``: replicas this request already tried (they answered 503).
        """
        live = self.live_replicas(exclude)
        if not live:
            raise RuntimeError("no live replica")
        # Equal loads: the replica remembered to hold the fewest blocks, so that new prefixes
        # spread over the caches instead of piling onto the first replica (as SGLang's
        # cache-aware router sends an unmatched prompt to the smallest tree).
        least = min(live, key=lambda r: (self.load[r], len(self._blocks[r]), r))
        best, depth = None, 0
        candidates: set[int] | None = None
        for i, h in enumerate(hashes):
            holders = {r for r in self._holders.get(h, ()) if self.is_alive[r] and r not in exclude}
            candidates = holders if candidates is None else candidates & holders
            if not candidates:
                break
            best, depth = min(candidates, key=lambda r: (self.load[r], r)), i + 1
        if best is not None and self.load[best] - self.load[least] <= self.max_load_imbalance:
            return best, depth
        return least, 0

    def route(self, token_ids: list[int], salt: str | None = None) -> int:
        """Pick a replica for the prompt and record the request as started there."""
        hashes = prompt_block_hashes(token_ids, self.block_size, salt)
        replica, depth = self.choose(hashes)
        if depth:
            self.num_affinity_hits += 1
        self.started(replica, hashes)
        return replica

    def started(self, replica: int, hashes: list[BlockHash]) -> None:
        self.load[replica] += 1
        table = self._blocks[replica]
        # Deepest block first, so a prompt's leading blocks are the most recent and the
        # last evicted: without its first block a chain can never match again.
        for h in reversed(hashes):
            if h in table:
                table.move_to_end(h)
            else:
                table[h] = None
                self._holders.setdefault(h, set()).add(replica)
        while len(table) > self.max_blocks_per_replica:
            old, _ = table.popitem(last=False)
            self._forget(old, replica)

    def finished(self, replica: int) -> None:
        self.load[replica] = max(0, self.load[replica] - 1)

    def mark_dead(self, replica: int, forget: bool = True) -> None:
        """A replica went away: its cache is gone, so is what we believed it held.

        ``forget=False``: it only stopped answering (its process, and cache, live on).
        """
        self.is_alive[replica] = False
        if not forget:
            return
        # ``load`` is kept: the requests that were in flight still call ``finished``, and
        # zeroing it here would undercount the replica once it is restarted.
        for h in self._blocks[replica]:
            self._forget(h, replica)
        self._blocks[replica].clear()

    def mark_alive(self, replica: int) -> None:
        self.is_alive[replica] = True

    def _forget(self, h: BlockHash, replica: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]
