"""The bf16 layout the C++ GEMV/GEMM (``kernels.gemv_bf16``) reads: weights [N, K] as blocks
of 16 output channels, each block ``ceil(K / 2)`` lines of 64 bytes, line p holding the 16
channels' weights k = 2p and 2p + 1 (the pairs an AVX512-BF16 dot product multiplies).

A block is one contiguous stream, so a thread reads its range of blocks sequentially at any
batch size; row-major weights are read several short rows at a time, which the hardware
prefetcher follows badly (see avx512.cpp). Each row's x pair is broadcast against a line,
so no horizontal sums are needed. N is padded to 16 and K to 2 with zeros.

fp32 weights (``pack_f32``, read by ``kernels.gemv_f32``) are the same 16-channel blocks with
one 64-byte line per input: [ceil(N/16), K, 16].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS, PAIR = 16, 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [ceil(N/16), ceil(K/2), 16, 2] from a weight [N, K]."""
    n, k = weight.shape
    nb, kp = -(-n // ROWS), -(-k // PAIR)
    w = F.pad(weight.to(torch.bfloat16), (0, kp * PAIR - k, 0, nb * ROWS - n))
    return w.view(nb, ROWS, kp, PAIR).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack``."""
    nb, kp = packed.shape[:2]
    w = packed.transpose(1, 2).reshape(nb * ROWS, kp * PAIR)
    return w[:out_features, :in_features]


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [ceil(N/16), K, 16] from a weight [N, K] (N padded to 16 with zeros)."""
    n, k = weight.shape
    nb = -(-n // ROWS)
    w = F.pad(weight.to(torch.float32), (0, 0, 0, nb * ROWS - n))
    return w.view(nb, ROWS, k).transpose(1, 2).contiguous()


def unpack_f32(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack_f32``."""
    nb, k = packed.shape[:2]
    return packed.transpose(1, 2).reshape(nb * ROWS, k)[:out_features]
