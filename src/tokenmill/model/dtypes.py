"""Names of dtypes and devices as the flags spell them, and the torch objects they mean.

One table for the KV cache's ``--kv-cache-dtype`` names (and the model dtypes, which share
them), read by the workers that allocate and the engine that reports.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = {dtype: name for name, dtype in KV_CACHE_DTYPES.items()}
KV_CACHE_DTYPES["fp8"] = torch.float8_e4m3fn  # vLLM's alias


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` stores K/V in the model dtype; anything else as named (vLLM's names)."""
    return model_dtype if requested == "auto" else KV_CACHE_DTYPES[requested]


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA where torch sees a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
