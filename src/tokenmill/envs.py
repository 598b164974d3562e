"""The environment variables tokenmill reads, in one module (vLLM keeps its own in ``envs.py``).

Each one overrides what the configuration chose, for A/B runs and for machines where a
kernel misbehaves; the engine's own choices are ``EngineConfig`` fields with flags
(``--attention-backend``, ``--fused-decode``). A variable set to ``0`` (or ``false``,
``off``, ``no``) switches its feature off; unset or anything else leaves it as configured.
The C++ extension reads ``TOKENMILL_CPU_ISA`` itself when it loads (``kernels/csrc/ops.cpp``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = "TOKENMILL_CACHE"
"""Folder of the compiled CPU kernels (and the demo model); default ``~/.cache/tokenmill``."""
CPU_KERNELS = "TOKENMILL_CPU_KERNELS"
"""``0`` runs every op on torch's kernels (the extension is never built or loaded)."""
CPU_ISA = "TOKENMILL_CPU_ISA"
"""``auto`` (default), ``avx512`` or ``avx2``: the kernel table the extension selects at load."""
BF16_GEMV = "TOKENMILL_BF16_GEMV"
"""``0`` keeps bf16 and fp32 projections in oneDNN's layout instead of tokenmill's GEMV blocks."""
FUSED_DECODE = "TOKENMILL_FUSED_DECODE"
"""``0`` runs decode steps layer by layer although ``--fused-decode`` allows the fused step
(read at every step, so an A/B run may switch it on a running engine)."""
PREFILL_GEMM = "TOKENMILL_PREFILL_GEMM"
"""``0`` keeps the AVX2 int8 and int4 projections on their int kernels at every batch size
instead of dequantizing to fp32 for torch's GEMM from ``dequantized_gemm_rows`` rows on (read
at every call, for A/B runs on one engine)."""

_OFF = ("0", "false", "off", "no")


def is_off(name: str) -> bool:
    """Whether the variable ``name`` switches its feature off."""
    return os.environ.get(name, "").strip().lower() in _OFF


def cache_root() -> Path:
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "tokenmill"))
