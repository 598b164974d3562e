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


CHUNK_ELEMENTS = 1 << 22
"""Elements packed per step: a whole-tensor pad and transpose would hold two extra copies of
the weight at once (a tied 262,144 x 640 head: 671 MB beside its own 335 MB in bf16)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [ceil(N/16), ceil(K/2), 16, 2] from a weight [N, K], a chunk of blocks at a time."""
    n, k = weight.shape
    nb, kp = -(-n // ROWS), -(-k // PAIR)
    out = torch.empty(nb, kp, ROWS, PAIR, dtype=torch.bfloat16, device=weight.device)
    step = max(1, CHUNK_ELEMENTS // (kp * PAIR * ROWS))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        rows = weight[b0 * ROWS : b1 * ROWS].to(torch.bfloat16)
        rows = F.pad(rows, (0, kp * PAIR - k, 0, (b1 - b0) * ROWS - rows.shape[0]))
        out[b0:b1] = rows.view(b1 - b0, ROWS, kp, PAIR).transpose(1, 2)
    return out


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack``."""
    nb, kp = packed.shape[:2]
    w = packed.transpose(1, 2).reshape(nb * ROWS, kp * PAIR)
    return w[:out_features, :in_features]


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [ceil(N/16), K, 16] from a weight [N, K] (N padded to 16 with zeros), a chunk of
    blocks at a time."""
    n, k = weight.shape
    nb = -(-n // ROWS)
    out = torch.empty(nb, k, ROWS, dtype=torch.float32, device=weight.device)
    step = max(1, CHUNK_ELEMENTS // (k * ROWS))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        rows = weight[b0 * ROWS : b1 * ROWS].to(torch.float32)
        rows = F.pad(rows, (0, 0, 0, (b1 - b0) * ROWS - rows.shape[0]))
        out[b0:b1] = rows.view(b1 - b0, ROWS, k).transpose(1, 2)
    return out


def unpack_f32(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack_f32``."""
    nb, k = packed.shape[:2]
    return packed.transpose(1, 2).reshape(nb * ROWS, k)[:out_features]


def rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the weight [len(ids), K], read from ``pack``'s or ``pack_f32``'s
    blocks: a tied LM head packed for the GEMV is also the embedding table, so the model
    keeps no row-major copy beside it. Exact (the blocks hold the values unchanged)."""
    flat = ids.reshape(-1)
    picked = packed[flat // ROWS, :, flat % ROWS]  # [T, kp, 2] (bf16) or [T, K] (fp32)
    return picked.reshape(len(flat), -1)[:, :in_features].reshape(*ids.shape, in_features)
