"""The CPU dtype rule, stated once: what ``--dtype auto`` runs on a CPU.

Where the CPU has bf16 dot products (AVX512-BF16 or AMX), every checkpoint runs as bf16, a
float32 one included, as vLLM does. Where it has not but tokenmill's AVX2 kernels run, bf16
too: their GEMV reads bf16 weights (half float32's bytes) and multiplies in float32.
Otherwise float32. ``--dtype float32`` keeps a float32 checkpoint's precision. ``serve``,
``plan``, ``check``, ``verify`` and ``bench offline`` all resolve ``auto`` through this one
function, so every tool tests what ``serve`` runs. Reads ``/proc/cpuinfo``; no torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

REPORTED_FLAGS = frozenset(
    {
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "amx_bf16",
        "amx_fp16",
        "amx_int8",
    }
)
"""The /proc/cpuinfo flags that decide kernels and dtype here (and that logs report)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags among ``REPORTED_FLAGS`` (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split()) & REPORTED_FLAGS
    return frozenset()


def has_native_bf16(flags: frozenset[str]) -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX), so bf16 GEMMs beat fp32 ones."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_auto_dtype(
    declared: str, flags: frozenset[str], kernels_read_bf16: bool
) -> tuple[str, str]:
    """``--dtype auto`` on a CPU: the dtype name and why, for the log.

    ``declared`` is the checkpoint's torch_dtype name; ``kernels_read_bf16`` says whether
    tokenmill's AVX2 kernels run here (the caller knows: the engine from the loaded
    extension, ``plan`` from the flags).
    """
    if has_native_bf16(flags):
        return "bfloat16", "which this CPU computes natively"
    if kernels_read_bf16:
        return "bfloat16", "whose weights tokenmill's AVX2 kernels read at half float32's bytes"
    if declared == "float32":
        return "float32", "as the checkpoint declares"
    return "float32", "as this CPU has no bf16 dot products"
