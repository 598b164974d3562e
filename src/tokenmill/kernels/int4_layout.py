"""The int4 packing the C++ kernels read: per weight row, per 64 input channels, 32 bytes
whose low nibbles are channels 0-31 and high nibbles channels 32-63.

A code q stands for ``(q - 8) * scale + zero`` of its group; rows are padded to whole
64-channel chunks with code 8 (which is 0 before the zero is added, and meets zero
activations). ``scales`` and ``zeros`` are fp32 [N, groups].
"""

from __future__ import annotations

import torch


def padded_in(in_features: int, group_size: int) -> int:
    """Input channels after padding: whole groups and whole 64-channel chunks."""
    step = max(64, group_size)
    return -(-in_features // step) * step


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] from int codes 0..15 [N, K] (K a multiple of 64)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 64, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8) back from ``pack``."""
    n, half = packed.shape
    p = packed.view(n, half // 32, 1, 32)
    return torch.cat((p & 15, p >> 4), dim=2).reshape(n, half * 2)
