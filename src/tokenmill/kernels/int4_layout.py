"""The int4 packings the C++ kernels read.

Rows (``pack``): per weight row, per 64 input channels, 32 bytes whose low nibbles are
channels 0-31 and high nibbles channels 32-63. A code q stands for ``(q - 8) * scale + zero``
of its group; rows are padded to whole 64-channel chunks with code 8 (which is 0 before the
zero is added, and meets zero activations). ``scales`` and ``zeros`` are fp32 [N, groups].

Channels of 8 (``pack_channels8``, groups of 32, ``linear_int4_x8``): per block of 8 output
channels and group, 128 bytes in four 32-byte words; word t holds, for channel c, bytes
4c..4c+3 whose low nibbles are the group's inputs 8t..8t+3 and high nibbles 8t+4..8t+7. One
word against 4 activations broadcast to all lanes then sums 8 channels at once, one per
32-bit lane (llama.cpp repacks Q4_0 for AVX2 on the same idea). Scales and offsets are
blocked alike, [blocks, groups, 8] (``block_channels8``).
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


def pack_channels8(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N/8, K/32, 128] from int codes 0..15 [N, K] (N a multiple of 8, K of 64)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // 8, 8, k // 32, 4, 2, 4)  # [b, c, g, t, half, i]
    c = c.permute(0, 2, 3, 4, 1, 5)  # [b, g, t, half, c, i]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n // 8, k // 32, 128).contiguous()


def unpack_channels8(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8) back from ``pack_channels8``."""
    blocks, groups, _ = packed.shape
    p = packed.view(blocks, groups, 4, 1, 8, 4)
    c = torch.cat((p & 15, p >> 4), dim=3)  # [b, g, t, half, c, i]
    return c.permute(0, 4, 1, 2, 3, 5).reshape(blocks * 8, groups * 32)


def block_channels8(values: torch.Tensor) -> torch.Tensor:
    """Per-channel, per-group values [N, G] (N a multiple of 8) as [N/8, G, 8]."""
    n, groups = values.shape
    return values.reshape(n // 8, 8, groups).transpose(1, 2).contiguous()
