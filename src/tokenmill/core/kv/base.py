"""KVCacheManager: the one small interface the scheduler uses to reserve KV memory.

``paged`` (``paged.PagedKVManager``) and ``static`` (``static.StaticKVManager``) implement
it; ``tokenmill.core.kv.build_kv_manager`` picks one by name and sizes it. Both describe a request's KV as a block table of block ids into one
``[num_blocks, block_size, ...]`` tensor per layer, so the model runner reads K/V the same
way whatever the strategy. No torch here: this is pure bookkeeping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from tokenmill.core.request import Request


@dataclass
class PrefixHit:
    """Result of a prefix lookup: blocks whose KV is already computed for this request."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class Allocation:
    """What one successful ``allocate`` did to the request's block table: the scheduler's
    step diff carries exactly this to the workers (no table is compared with another)."""

    block_ids: list[int]
    """The block ids appended to the table, or the whole table when ``replaces``."""
    replaces: bool = False
    """The table was rebuilt rather than extended: the request's first allocation since it
    held nothing (new, or taken again after preemption), a copy-on-write of a shared block,
    or blocks released by ``truncate`` since the last allocation."""


@dataclass(frozen=True)
class KVSizing:
    """What a strategy needs to size its pool: the engine's limits and the memory budget."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    budget_bytes: int
    """Memory the KV pool may take."""
    bytes_per_token: int
    """K and V of one token over all layers, in the cache's dtype."""
    prefix_cache_fills_pool: bool = False
    """Whether cached prefixes outrank never-used blocks (``BlockPool``)."""

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one request of ``max_model_len`` tokens needs."""
        return -(-self.max_model_len // self.block_size)


@dataclass
class KVCacheStats:
    """Counters exported as metrics."""

    num_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache."""
    num_hit_tokens: int = 0
    """Of those, tokens found already computed."""


class KVCacheManager(ABC):
    """Reserves and releases KV memory for requests; maps them to block tables."""

    block_size: int
    num_blocks: int
    stats: KVCacheStats
    wants_compiled_decode: ClassVar[bool] = False
    """Whether the layout is fixed enough for the worker to compile a decode step (static)."""
    supports_fork: ClassVar[bool] = False
    """Whether ``fork`` works, i.e. requests can share KV copy-on-write (beam search needs it)."""

    @classmethod
    @abstractmethod
    def for_budget(cls, sizing: KVSizing) -> KVCacheManager:
        """A manager sized for these limits; ConfigError (naming the flag) if they cannot fit."""

    @abstractmethod
    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Find already-computed KV for a request about to start (no state change)."""

    @abstractmethod
    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> Allocation | None:
        """Reserve room for ``num_new_tokens`` more tokens: what changed in the request's
        block table, or None (and no change) if the pool cannot hold them."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release everything the request holds (finish, abort or preemption)."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """Block ids holding the request's KV, in token order."""

    @abstractmethod
    def can_admit(self, request: Request, num_new_tokens: int = 1) -> bool:
        """Whether a new request could start now with this many tokens (static: a slot is free)."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of KV memory in use, 0..1."""

    @property
    @abstractmethod
    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold (the whole pool, or one slot)."""

    @property
    @abstractmethod
    def num_reserved_token_slots(self) -> int:
        """Token slots reserved by live requests, shared blocks once (for memory-waste figures)."""

    def truncate(self, request: Request, num_tokens: int) -> None:  # noqa: B027 - optional
        """Keep KV for the request's first ``num_tokens`` tokens only (speculative tokens
        that were rejected): blocks past them are released, nothing is copied. Static
        slots keep their region, so there it changes nothing."""

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the KV ``parent`` holds without copying it: the blocks are shared
        (ref counts up) and a shared block is copied only when one of them writes into it."""
        raise NotImplementedError(f"the {type(self).__name__} strategy cannot share KV (fork)")

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies that copy-on-write asked for since the last call; the
        worker does them before the step's forward writes anything."""
        return []

    def reset_prefix_cache(self) -> None:  # noqa: B027 - optional
        """Forget cached prefixes (optional)."""
