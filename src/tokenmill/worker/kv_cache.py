"""KV cache tensors: one [num_blocks, block_size, num_kv_heads, head_dim] K and V per layer.

Sizing turns the user's memory budget into a block count. The tensors are zero-filled:
attention masks padding and stale slots, and zeros (unlike uninitialised memory) can never
be NaN, which would leak through a masked softmax as 0 * NaN. On the CPU they live in
anonymous memory maps, which the OS hands out as zero pages when first touched: the pool
costs resident memory as blocks are used, not all at start-up (``torch.zeros`` wrote every
byte of it, seconds of start-up and the whole pool resident for a server that never fills it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap

import psutil
import torch

from tokenmill.model import sizing
from tokenmill.model.config import ModelConfig

logger = logging.getLogger(__name__)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token across all layers (``model/sizing.py``, as the planner)."""
    return sizing.kv_bytes_per_token(cfg, torch.empty((), dtype=dtype).element_size())


def kv_budget_bytes(
    kv_cache_memory: float | None, gpu_memory_utilization: float, device: torch.device
) -> int:
    """The KV budget: explicit bytes, a fraction of free memory, or a default."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return sizing.kv_budget_from_memory(kv_cache_memory, total, free, gpu_memory_utilization)
    return sizing.cpu_kv_budget(kv_cache_memory, psutil.virtual_memory().available)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled K and V tensors for every layer, plus one scratch block at index num_blocks.

    The scratch block absorbs the K/V writes of padding rows in fixed-shape steps.
    """
    shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (zeroed(shape, dtype, device), zeroed(shape, dtype, device)) for _ in range(cfg.num_layers)
    ]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by an anonymous map, so untouched pages stay free."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows has none)
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the map alive; it is unmapped when the tensor is freed.
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' memory that are resident now (pages touched at least once),
    measured with ``mincore``; the KV pool's mapping fills lazily as blocks are first used,
    so this is what the pool costs in RSS, up to its size. Tensors not on the CPU, or where
    ``mincore`` is unavailable, count in full."""
    total = 0
    libc = _libc()
    page = mmap.PAGESIZE
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        address = tensor.data_ptr()
        if libc is None or tensor.device.type != "cpu" or nbytes == 0 or address % page:
            total += nbytes
            continue
        num_pages = -(-nbytes // page)
        vec = (ctypes.c_ubyte * num_pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
            total += nbytes
            continue
        # one byte a page, bit 0 = resident (the other bits are reserved, 0): counted in C
        total += bytes(vec).count(1) * page
    return total


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def copy_kv_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], blocks_to_copy: list[tuple[int, int]]
) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write of a shared block)."""
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.long, device=device)
    for k, v in kv_caches:
        k[dst] = k[src]
        v[dst] = v[src]
