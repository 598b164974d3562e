"""The bf16 layout the C++ GEMV (``kernels.gemv_bf16``) reads: weights [N, K] as blocks of 16
output channels, each block ``ceil(K / 32)`` slices of 16 channels x 32 inputs (1 KB).

A thread reads its range of blocks as one sequential stream; row-major weights are read
several short rows at a time, which the hardware prefetcher follows badly (see avx512.cpp).
N is padded to 16 and K to 32 with zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS, COLS = 16, 32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [ceil(N/16), ceil(K/32), 16, 32] from a weight [N, K]."""
    n, k = weight.shape
    nb, kc = -(-n // ROWS), -(-k // COLS)
    w = F.pad(weight.to(torch.bfloat16), (0, kc * COLS - k, 0, nb * ROWS - n))
    return w.view(nb, ROWS, kc, COLS).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack``."""
    nb, kc = packed.shape[:2]
    w = packed.transpose(1, 2).reshape(nb * ROWS, kc * COLS)
    return w[:out_features, :in_features]
