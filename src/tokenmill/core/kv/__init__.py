"""KV-cache strategies behind one contract (``base.KVCacheManager``): ``paged`` and ``static``.

The engine names a strategy (``--kv-cache``) and gets a sized manager from ``build_kv_manager``;
everything else it needs from the strategy (a compiled decode step or not, capacity, usage)
it asks through the contract, never by the strategy's name.
"""

from __future__ import annotations

from tokenmill.core.kv.base import Allocation, KVCacheManager, KVSizing
from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager

STRATEGIES: dict[str, type[KVCacheManager]] = {"paged": PagedKVManager, "static": StaticKVManager}
"""``--kv-cache`` names and their managers."""


def build_kv_manager(kind: str, sizing: KVSizing) -> KVCacheManager:
    """The ``kind`` strategy sized for ``sizing``."""
    return STRATEGIES[kind].for_budget(sizing)


__all__ = ["STRATEGIES", "Allocation", "KVCacheManager", "KVSizing", "build_kv_manager"]
