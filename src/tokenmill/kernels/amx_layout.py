"""Weight tiles for the AMX kernels: 16 output channels x 64 input channels per tile, in the
VNNI order TDPBUSD reads (tile row r holds, for each of the 16 channels, the 4 inputs
4r..4r+3). int4 tiles keep the first 512 codes of a tile in the low nibbles and the other
512 in the high nibbles. Channels are padded to 16 and inputs to 64 with zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _tiles(values: torch.Tensor) -> torch.Tensor:
    """[N/16, K/64, 1024] bytes from an int8/uint8 [N, K] matrix, in VNNI tile order."""
    n, k = values.shape
    padded = F.pad(values, (0, -k % 64, 0, -n % 16))
    nb, kc = padded.shape[0] // 16, padded.shape[1] // 64
    tiles = padded.view(nb, 16, kc, 16, 4).permute(0, 2, 3, 1, 4)  # [nb, kc, quad, channel, 4]
    return tiles.reshape(nb, kc, 1024).contiguous()


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N/16, K/64, 16, 64] from int8 weights [N, K]."""
    tiles = _tiles(qweight)
    return tiles.view(tiles.shape[0], tiles.shape[1], 16, 64)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N/16, K/64, 512] from codes 0..15 [N, K]."""
    tiles = _tiles(codes.to(torch.uint8))
    return (tiles[..., :512] | (tiles[..., 512:] << 4)).contiguous()


def block_channels(values: torch.Tensor) -> torch.Tensor:
    """Per-channel values [N] or [N, G] blocked by 16 channels ([N/16, 16] or [N/16, G, 16],
    N zero-padded), so the kernel's epilogue reads 16 channels with one vector load."""
    n = values.shape[0]
    padded = F.pad(values, (0, 0) * (values.dim() - 1) + (0, -n % 16))
    if values.dim() == 1:
        return padded.view(-1, 16).contiguous()
    return padded.view(-1, 16, values.shape[1]).transpose(1, 2).contiguous()
