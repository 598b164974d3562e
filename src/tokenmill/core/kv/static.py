"""Static KV: ``max_num_seqs`` slots, each a contiguous region of ``max_model_len`` tokens.

Everything is reserved at start-up (TensorRT-LLM's trade-off): admission waits for a free
slot, a running request can never run out of KV, so nothing is ever preempted. A slot
remembers the tokens whose KV it still holds after its request ends; a new request whose
prompt shares a prefix with them reuses that KV, as llama.cpp's server does. The slot's
region is exposed as a block table of consecutive blocks, so the model runner reads it
exactly as it reads the paged cache. No torch here.
"""

from __future__ import annotations

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


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StaticKVManager(KVCacheManager):
    """Fixed per-request slots over one preallocated KV region."""

    wants_compiled_decode: ClassVar[bool] = True

    def __init__(
        self, num_slots: int, max_model_len: int, block_size: int, enable_prefix_reuse: bool = True
    ) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.blocks_per_slot = -(-max_model_len // block_size)
        self.num_blocks = num_slots * self.blocks_per_slot
        self.enable_prefix_reuse = enable_prefix_reuse
        self.stats = KVCacheStats()
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = list(range(num_slots))
        # Tokens whose KV each slot holds (for reuse by the next request of that slot).
        self._slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        # The cache salt of the request that computed them (its LoRA adapter): reused only
        # by a request with the same salt.
        self._slot_salts: list[str | None] = [None] * num_slots

    @classmethod
    def for_budget(cls, sizing: KVSizing) -> StaticKVManager:
        """One slot of ``max_model_len`` tokens per sequence; the budget must hold them all."""
        manager = cls(
            sizing.max_num_seqs,
            sizing.max_model_len,
            sizing.block_size,
            sizing.enable_prefix_caching,
        )
        needed = manager.num_blocks * sizing.block_size * sizing.bytes_per_token
        if needed > sizing.budget_bytes:
            raise ConfigError(
                f"static KV needs {needed / 2**30:.2f} GiB ({sizing.max_num_seqs} slots x {sizing.max_model_len} "
                f"tokens) but --kv-cache-memory allows {sizing.budget_bytes / 2**30:.2f} GiB; lower --max-num-seqs "
                f"or --max-model-len"
            )
        return manager

    def _slot_of_block(self, block_id: int) -> int:
        return block_id // self.blocks_per_slot

    def _slot_blocks(self, slot: int) -> list[int]:
        start = slot * self.blocks_per_slot
        return list(range(start, start + self.blocks_per_slot))

    def lookup_prefix(self, request: Request) -> PrefixHit:
        if (
            not self.enable_prefix_reuse
            or not self._free_slots
            or request.sampling_params.prompt_logprobs is not None
        ):
            return PrefixHit()
        tokens = request.token_slice(0, request.num_tokens)
        best_slot, best_len = None, 0
        for slot in self._free_slots:
            if self._slot_salts[slot] != request.cache_salt:
                continue
            n = _common_prefix_len(self._slot_tokens[slot], tokens)
            if n > best_len:
                best_slot, best_len = slot, n
        best_len = min(best_len, request.num_tokens - 1)  # one token must run to get logits
        if best_slot is None or best_len <= 0:
            return PrefixHit()
        # The slot's blocks that hold the prefix; ``allocate`` takes the slot they belong to.
        return PrefixHit(
            block_ids=self._slot_blocks(best_slot)[: -(-best_len // self.block_size)],
            num_tokens=best_len,
        )

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> Allocation | None:
        rid = request.request_id
        is_new = rid not in self._slot_of
        if is_new:
            if not self._free_slots:
                return None
            slot = self._free_slots[-1]
            if prefix is not None and prefix.block_ids:
                slot = self._slot_of_block(prefix.block_ids[0])
            self._free_slots.remove(slot)
            self._slot_of[rid] = slot
            self.stats.num_query_tokens += request.num_prompt_tokens
            self.stats.num_hit_tokens += prefix.num_tokens if prefix else 0
            # Overwritten from here on; known again when the request frees the slot.
            self._slot_tokens[slot] = []
        end = request.num_computed_tokens + (prefix.num_tokens if prefix else 0) + num_new_tokens
        if end > self.blocks_per_slot * self.block_size:
            raise RuntimeError(f"request {rid} exceeds its slot ({end} tokens)")
        # A slot's table is all its blocks from the start, and never changes while held.
        return Allocation(self.block_table(rid) if is_new else [], replaces=is_new)

    def free(self, request: Request) -> None:
        slot = self._slot_of.pop(request.request_id, None)
        if slot is None:
            return
        # The slot keeps the KV of every token that was computed, for the next request.
        self._slot_tokens[slot] = request.token_slice(0, request.num_computed_tokens)
        self._slot_salts[slot] = request.cache_salt
        self._free_slots.append(slot)

    def block_table(self, request_id: str) -> list[int]:
        slot = self._slot_of.get(request_id)
        return [] if slot is None else self._slot_blocks(slot)

    def can_admit(self, request: Request, num_new_tokens: int = 1) -> bool:
        return bool(self._free_slots)

    @property
    def usage(self) -> float:
        return len(self._slot_of) / self.num_slots

    @property
    def max_tokens_per_request(self) -> int:
        return self.blocks_per_slot * self.block_size

    @property
    def num_reserved_token_slots(self) -> int:
        return len(self._slot_of) * self.blocks_per_slot * self.block_size

    def reset_prefix_cache(self) -> None:
        self._slot_tokens = [[] for _ in range(self.num_slots)]
