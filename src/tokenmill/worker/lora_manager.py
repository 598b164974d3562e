"""LoRAManager: which adapters are known, kept in CPU memory, and sitting in a device slot.

Three tiers, as in vLLM: every adapter a live request names is registered (its
``LoRARequest``, a few strings); up to ``max_cpu_loras`` are kept loaded in CPU memory,
least recently used evicted, but never one that unfinished requests use (so a step never
reads a folder, which may be gone by then; an evicted adapter is read again when a new
request names it); up to ``max_loras`` sit in the device slots a step reads. The scheduler never puts more
than ``max_loras`` adapters in one step, so ``prepare_step`` always finds them slots,
evicting the least recently used slot no request of the step needs. Only the engine
thread uses this object.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.model.config import ModelConfig
from tokenmill.model.lora import LoRAAdapter, LoRAStacks, LoRAStepState, load_lora_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapter registry, CPU LRU cache and device slots for one model."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        ids_in_use: Callable[[], set[int]] = set,
    ) -> None:
        """``ids_in_use``: adapter ids of unfinished requests (kept in the CPU cache)."""
        self.cfg = cfg
        self._ids_in_use = ids_in_use
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.stacks = LoRAStacks(cfg, max_loras, max_rank, dtype, device)
        self._requests: dict[int, LoRARequest] = {}
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * max_loras
        """Per slot: the adapter id in it."""
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.num_loads = 0
        """Adapters read from disk (a CPU-cache miss counts again)."""

    # ---- registry ---------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> None:
        """Register and load an adapter (LoRAError if it does not fit this model)."""
        known = self._requests.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise InvalidRequestError(
                    f"LoRA id {lora.lora_int_id} is already in use by adapter {known.lora_name!r}",
                    param="lora_request",
                )
            self._cached(lora.lora_int_id)
            return
        self._load(lora)
        self._requests[lora.lora_int_id] = lora

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter everywhere (its requests must have ended); False if unknown."""
        if self._requests.pop(lora_id, None) is None:
            return False
        self._cpu.pop(lora_id, None)
        for slot, slot_id in enumerate(self._slot_ids):
            if slot_id == lora_id:
                self._slot_ids[slot] = None
                self._slot_lru.move_to_end(slot, last=False)  # reused first
        return True

    def ids(self) -> list[int]:
        """Registered adapter ids."""
        return list(self._requests)

    def get(self, lora_id: int) -> LoRARequest | None:
        return self._requests.get(lora_id)

    @property
    def num_cpu_loras(self) -> int:
        return len(self._cpu)

    def _load(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = load_lora_adapter(
            lora.lora_path, self.cfg, self.max_rank, self.dtype, name=lora.lora_name
        )
        self.num_loads += 1
        logger.info(
            "loaded LoRA %r (id %d, rank %d, %.1f MiB) from %s",
            lora.lora_name,
            lora.lora_int_id,
            adapter.rank,
            adapter.nbytes / 2**20,
            lora.lora_path,
        )
        self._cpu[lora.lora_int_id] = adapter
        if len(self._cpu) > self.max_cpu_loras:
            keep = self._ids_in_use() | {lora.lora_int_id}
            for lora_id in [i for i in self._cpu if i not in keep]:
                if len(self._cpu) <= self.max_cpu_loras:
                    break
                del self._cpu[lora_id]
                logger.info("LoRA id %d evicted from the CPU cache", lora_id)
        return adapter

    def _cached(self, lora_id: int) -> LoRAAdapter:
        adapter = self._cpu.get(lora_id)
        if adapter is None:
            return self._load(self._requests[lora_id])
        self._cpu.move_to_end(lora_id)
        return adapter

    # ---- slots ------------------------------------------------------------------------
    def prepare_step(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Slots of the adapters one step uses (loading the missing ones): id -> slot."""
        needed = set(lora_ids)
        slot_of = {i: s for s, i in enumerate(self._slot_ids) if i in needed}
        missing = sorted(needed - set(slot_of))
        if len(needed) > len(self._slot_ids):
            raise RuntimeError(
                f"{len(needed)} adapters in one step, max_loras is {len(self._slot_ids)}"
            )
        for lora_id in missing:
            free = [s for s in self._slot_lru if s not in slot_of.values()]
            # Empty slots first (lowest index keeps the step's slots close together), then LRU.
            empty = [s for s in free if self._slot_ids[s] is None]
            slot = min(empty) if empty else free[0]
            self.stacks.write(slot, self._cached(lora_id))
            self._slot_ids[slot] = lora_id
            slot_of[lora_id] = slot
        for slot in sorted(slot_of.values()):
            self._slot_lru.move_to_end(slot)
        return slot_of

    def build_step(
        self, rows_by_lora: dict[int, list[int]], num_tokens: int
    ) -> LoRAStepState | None:
        """The step's LoRA state from each adapter's token rows; None when no row has one."""
        if not rows_by_lora:
            return None
        slot_of = self.prepare_step(rows_by_lora)
        rows_by_slot = {slot_of[i]: rows for i, rows in rows_by_lora.items()}
        first = min(rows_by_slot)
        num_groups = max(rows_by_slot) - first + 1
        modules = frozenset().union(*(self.stacks.slot_modules[s] for s in rows_by_slot))
        only = rows_by_slot.get(first)
        if num_groups == 1 and only is not None and only == list(range(num_tokens)):
            return LoRAStepState(self.stacks, first, 1, None, None, modules)
        width = max(len(r) for r in rows_by_slot.values())
        padded = [rows_by_slot.get(first + g, []) for g in range(num_groups)]
        rows = [r + [0] * (width - len(r)) for r in padded]
        mask = None
        if any(len(r) < width for r in padded):
            mask = torch.tensor(
                [[True] * len(r) + [False] * (width - len(r)) for r in padded],
                dtype=torch.bool,
                device=self.device,
            ).unsqueeze(-1)
        return LoRAStepState(
            self.stacks,
            first,
            num_groups,
            torch.tensor(rows, dtype=torch.long, device=self.device),
            mask,
            modules,
        )
