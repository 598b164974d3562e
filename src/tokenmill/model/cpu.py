"""What this CPU runs fast, read once at start-up: vector ISA, native bf16/fp16, physical cores.

Machines differ: AVX2-only Zen 3 next to AVX-512 Xeons with AVX512-BF16 and AMX. The dtype
``auto`` choice, the kernels a Linear uses and the default compute thread count follow from
what is read here, and the engine logs it, so a benchmark says what it measured.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import psutil
import torch

from tokenmill.model.cpu_dtype import REPORTED_FLAGS, cpu_flags, has_native_bf16
from tokenmill.model.thread_policy import physical_cores


@dataclass(frozen=True)
class CPUInfo:
    """The features that decide which kernels are fast here."""

    isa: str
    """ATen's kernel level: AVX512, AVX2 or DEFAULT (``torch.backends.cpu.get_cpu_capability``)."""
    flags: frozenset[str]
    """The /proc/cpuinfo flags we care about."""
    num_physical_cores: int
    """Physical cores this process may run on (hyper-threads counted once)."""

    @property
    def has_native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX), so bf16 GEMMs beat fp32 ones."""
        return has_native_bf16(self.flags)

    @property
    def has_native_fp16(self) -> bool:
        """fp16 matrix multiply in hardware (AMX-FP16); AVX512-FP16 alone is not used by oneDNN GEMMs."""
        return "amx_fp16" in self.flags

    def describe(self) -> str:
        shown = sorted(self.flags & REPORTED_FLAGS)
        return f"{self.isa} ({' '.join(shown) or 'no bf16/amx/vnni'}), {self.num_physical_cores} physical cores"


def _physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may use."""
    try:
        return physical_cores(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@functools.cache
def cpu_info() -> CPUInfo:
    """This machine's CPU features (read once)."""
    return CPUInfo(
        isa=torch.backends.cpu.get_cpu_capability(),
        flags=cpu_flags(),
        num_physical_cores=_physical_cores(),
    )
