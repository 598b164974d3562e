"""Paged KV: a pool of fixed-size blocks with ref counts and automatic prefix caching.

Full blocks are identified by a chained hash (sha256 of the parent hash, the request's
cache salt and the block's tokens); the cached block also keeps its tokens, which are
compared on every hit to guard against collisions. Freed blocks keep their hash and sit
in an LRU free queue, so a later request with the same prefix can reuse them until the
space is actually needed. Requests fanned out from one ``n > 1`` request share a salt,
which is how they share the prompt's blocks (ref count > 1) even with prefix caching off.
``fork`` gives a new request (a beam) its parent's block table with every ref count up;
the first of them to write into a shared, partly filled last block gets a fresh copy
(copy-on-write: the (src, dst) pair goes to the worker through ``take_block_copies``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

from tokenmill.core.kv.base import (
    Allocation,
    KVCacheManager,
    KVCacheStats,
    KVSizing,
    PrefixHit,
)
from tokenmill.core.request import Request
from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)

BlockHash = bytes


@dataclass
class Block:
    """One KV block: how many requests use it and, when full and cached, its identity."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


def hash_block(parent: BlockHash | None, salt: str | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chained hash of a full block: identical iff the whole prefix up to it is identical."""
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update((salt or "").encode())
    h.update(b"|")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class BlockPool:
    """Owns every block: the free queue (LRU order), ref counts and the hash table.

    Blocks never used yet sit apart from the free queue (``fresh``): on a CPU the pool is
    allocated lazily, so a block's pages become resident the first time a request writes
    it. By default a freed block, cached or not, is reused before a fresh one is touched,
    so resident memory follows the peak live working set and then stays flat (a 3x longer
    soak ended where its midpoint was). With ``cache_fills_pool`` cached blocks are evicted
    only once every fresh block is used: the prefix cache may then fill the whole pool
    (``--prefix-cache-fills-pool``), which is vLLM's order, and resident memory climbs to
    the pool's size as traffic goes by.
    """

    def __init__(self, num_blocks: int, cache_fills_pool: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.cache_fills_pool = cache_fills_pool
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Head is evicted first. Uncached blocks go to the head, cached ones to the tail.
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        self.fresh: list[int] = list(range(num_blocks - 1, -1, -1))
        """Never-used blocks, popped from the end (lowest id first)."""
        self.cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.fresh)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks written at least once: what the pool holds resident on a CPU."""
        return self.num_blocks - len(self.fresh)

    def _next_free(self) -> int:
        if not self.free_queue:
            return self.fresh.pop()
        if self.fresh and self.cache_fills_pool:
            head = next(iter(self.free_queue))
            if self.blocks[head].block_hash is not None:  # keep the cached prefix
                return self.fresh.pop()
        block_id, _ = self.free_queue.popitem(last=False)
        return block_id

    def get_cached(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for this hash, if its tokens really match."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the cache (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take free blocks (``_next_free``'s order), evicting their cached identity."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.blocks[self._next_free()]
            self._uncache(block)
            block.ref_count = 1
            out.append(block)
        return out

    def cache(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a newly full block; a hash already cached elsewhere keeps its block."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block.block_id

    def free(self, blocks: list[Block], keep_cached: bool = True) -> None:
        """Drop one reference per block; blocks reaching zero return to the free queue.

        Callers pass blocks tail first, so a request's last blocks are evicted before its
        (more shareable) first ones.
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_count == 0:
                if not keep_cached:
                    self._uncache(block)
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def reset_cache(self) -> None:
        """Forget every cached identity (blocks in use keep their data)."""
        for block in self.blocks:
            self._uncache(block)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None


class PagedKVManager(KVCacheManager):
    """Block tables per request over a shared BlockPool, with prefix caching."""

    supports_fork: ClassVar[bool] = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_fills_pool: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, cache_fills_pool)
        self.stats = KVCacheStats()
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._block_copies: list[tuple[int, int]] = []
        self._truncated: set[str] = set()
        """Requests ``truncate`` shortened since their last allocation (theirs is rebuilt)."""

    @classmethod
    def for_budget(cls, sizing: KVSizing) -> PagedKVManager:
        """As many blocks as the budget holds, but no more than every sequence could use."""
        block_bytes = sizing.bytes_per_token * sizing.block_size
        num_blocks = min(
            sizing.budget_bytes // block_bytes, sizing.max_num_seqs * sizing.blocks_per_seq
        )
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache budget of {sizing.budget_bytes} bytes holds no block of {sizing.block_size} tokens "
                f"({block_bytes} bytes); raise --kv-cache-memory"
            )
        if num_blocks < sizing.blocks_per_seq:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len %d: long prompts will be rejected",
                num_blocks * sizing.block_size,
                sizing.max_model_len,
            )
        return cls(
            num_blocks,
            sizing.block_size,
            sizing.enable_prefix_caching,
            sizing.prefix_cache_fills_pool,
        )

    # ---- hashing -------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_full_blocks`` blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            hashes.append(hash_block(hashes[-1] if hashes else None, request.cache_salt, tokens))
        return hashes[:num_full_blocks]

    # ---- KVCacheManager ------------------------------------------------------------
    def lookup_prefix(self, request: Request) -> PrefixHit:
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixHit()  # every prompt position must be computed for its logprobs
        # At least one token must be computed to produce logits, hence num_tokens - 1.
        num_full = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hit: list[int] = []
        for i, block_hash in enumerate(self._block_hashes(request, num_full)):
            block = self.pool.get_cached(
                block_hash, tuple(request.token_slice(i * bs, (i + 1) * bs))
            )
            if block is None:
                break
            hit.append(block.block_id)
        return PrefixHit(block_ids=hit, num_tokens=len(hit) * bs)

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> Allocation | None:
        rid = request.request_id
        blocks = self._blocks.get(rid, [])
        replaces = not blocks or rid in self._truncated
        prefix_blocks = [self.pool.blocks[b] for b in prefix.block_ids] if prefix else []
        num_computed = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(prefix_blocks))
        num_reviving = sum(1 for b in prefix_blocks if b.ref_count == 0)
        cow_index = self._shared_write_block(blocks, request.num_computed_tokens, num_new_tokens)
        num_copies = 0 if cow_index is None else 1
        if num_new_blocks + num_reviving + num_copies > self.pool.num_free_blocks:
            return None
        if cow_index is not None:
            blocks = self._copy_on_write(blocks, cow_index)
            replaces = True
        if prefix is not None and not blocks:
            self.stats.num_query_tokens += request.num_prompt_tokens
            self.stats.num_hit_tokens += prefix.num_tokens
        self.pool.touch(prefix_blocks)
        added = prefix_blocks + self.pool.allocate(num_new_blocks)
        blocks = blocks + added
        self._blocks[rid] = blocks
        self._truncated.discard(rid)
        # Only verified tokens are hashed: speculative ones past num_tokens may be rejected.
        num_verified = min(num_computed + num_new_tokens, request.num_tokens)
        self._cache_full_blocks(request, blocks, num_verified // self.block_size)
        return Allocation([b.block_id for b in (blocks if replaces else added)], replaces)

    def truncate(self, request: Request, num_tokens: int) -> None:
        blocks = self._blocks.get(request.request_id)
        if blocks is None:
            return
        num_kept = -(-num_tokens // self.block_size)
        if num_kept >= len(blocks):
            return
        tail = blocks[num_kept:]
        self._blocks[request.request_id] = blocks[:num_kept]
        self._truncated.add(request.request_id)
        # Tail blocks hold unverified tokens only, so none of them was hashed or cached.
        self.pool.free(list(reversed(tail)), keep_cached=False)

    def _shared_write_block(
        self, blocks: list[Block], num_computed: int, num_new_tokens: int
    ) -> int | None:
        """Index of the block the next token lands in, if it is partly filled and shared."""
        index = num_computed // self.block_size
        if num_new_tokens <= 0 or num_computed % self.block_size == 0 or index >= len(blocks):
            return None
        return index if blocks[index].ref_count > 1 else None

    def _copy_on_write(self, blocks: list[Block], index: int) -> list[Block]:
        """Swap a shared block for a private copy (the worker copies the data before the step)."""
        shared = blocks[index]
        (private,) = self.pool.allocate(1)
        self.pool.free([shared])  # ref count stays >= 1: the other sharers keep it
        self._block_copies.append((shared.block_id, private.block_id))
        return blocks[:index] + [private] + blocks[index + 1 :]

    def fork(self, parent: Request, child: Request) -> None:
        if child.request_id in self._blocks:
            raise ValueError(f"request {child.request_id!r} already holds KV")
        blocks = self._blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self._blocks[child.request_id] = list(blocks)
        # Hashes cover full blocks only, and the child shares every full block's tokens.
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._block_copies = self._block_copies, []
        return copies

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_full: int) -> None:
        bs = self.block_size
        for i, block_hash in enumerate(self._block_hashes(request, num_full)):
            if blocks[i].block_hash is None:
                self.pool.cache(
                    blocks[i], block_hash, tuple(request.token_slice(i * bs, (i + 1) * bs))
                )

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._truncated.discard(request.request_id)
        self._hashes.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)), keep_cached=self.enable_prefix_caching)

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def can_admit(self, request: Request, num_new_tokens: int = 1) -> bool:
        return self.pool.num_free_blocks >= -(-num_new_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def max_tokens_per_request(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_reserved_token_slots(self) -> int:
        # Blocks with a reference, each once however many requests share it; O(1) per step.
        return (self.num_blocks - self.pool.num_free_blocks) * self.block_size

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
