"""Inputs and comparisons shared by the kernel tests."""

from __future__ import annotations

import torch


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(dtype)


def close_to_fp32(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """bf16 outputs against an fp32 reference: within rtol of the largest output."""
    err = (got.float() - want).abs().max().item()
    assert err <= rtol * want.abs().max().item() + 1e-6, (err, want.abs().max().item())


SHAPES = [(1, 1, 32), (1, 37, 70), (3, 5, 96), (5, 64, 33), (16, 130, 257), (64, 48, 128)]
"""(rows M, output channels N, input channels K): tails in every dimension."""


DTYPES = [torch.float32, torch.bfloat16]
"""Activation dtypes every kernel takes."""

KV_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
"""KV cache dtypes the attention kernels read."""


def tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel output in ``dtype`` against an fp32 reference."""
    return (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    )
