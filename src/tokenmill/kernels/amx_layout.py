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


CHUNK_BYTES = 1 << 22
"""Bytes of weights packed per step by ``pack_int8``."""


def pack_int8(qweight: torch.Tensor, reuse_storage: bool = False) -> torch.Tensor:
    """int8 [N/16, K/64, 16, 64] from int8 weights [N, K], a chunk of 16-row blocks at a time.

    ``reuse_storage``: the caller gives ``qweight`` up, so where no padding is needed the
    tiles are written over it, chunk by chunk (block b's tiles are the bytes of rows
    16b..16b+15 in either layout). Packing the whole tensor at once held it three times:
    Gemma 3's tied 262,144 x 640 int8 head (168 MB) once padded, once permuted, besides
    itself, at load."""
    n, k = qweight.shape
    nb, kc = -(-n // 16), -(-k // 64)
    in_place = (
        reuse_storage
        and n % 16 == 0
        and k % 64 == 0
        and qweight.is_contiguous()
        and qweight.untyped_storage().nbytes() == qweight.numel() * qweight.element_size()
    )
    out = (
        qweight.view(nb, kc, 16, 64)
        if in_place
        else torch.empty(nb, kc, 16, 64, dtype=qweight.dtype, device=qweight.device)
    )
    step = max(1, CHUNK_BYTES // (kc * 1024))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        rows = qweight[b0 * 16 : b1 * 16]
        pads = (0, kc * 64 - k, 0, (b1 - b0) * 16 - rows.shape[0])
        chunk = F.pad(rows, pads) if any(pads) else rows.clone()  # a copy: out may alias rows
        quads = chunk.view(b1 - b0, 16, kc, 16, 4).permute(0, 2, 3, 1, 4)  # [b, kc, quad, ch, 4]
        out[b0:b1] = quads.reshape(b1 - b0, kc, 16, 64)
    return out


def _int8_lanes(tiles: torch.Tensor) -> torch.Tensor:
    """``pack_int8``'s tiles as [N/16, K/64, quad, channel, 4]."""
    return tiles.view(*tiles.shape[:2], 16, 16, 4)


def unpack_int8(tiles: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 weight [out_features, in_features] back from ``pack_int8`` (a copy)."""
    lanes = _int8_lanes(tiles)
    rows = lanes.permute(0, 3, 1, 2, 4).reshape(tiles.shape[0] * 16, -1)
    return rows[:out_features, :in_features]


def int8_rows(tiles: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the int8 weight [*ids.shape, in_features], gathered from ``pack_int8``'s
    tiles without unpacking the rest: a tied LM head in tiles is also the embedding table.
    Each channel's 4 consecutive inputs are gathered as one int32, a quarter of the elements."""
    flat = ids.reshape(-1)
    quads = _int8_lanes(tiles).view(torch.int32).squeeze(-1)  # a channel's 4 inputs as one int32
    picked = quads[flat // 16, :, :, flat % 16].view(torch.int8)  # [T, K/64, quad * 4]
    rows = picked.reshape(len(flat), -1)[:, :in_features]
    return rows.reshape(*ids.shape, in_features)


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
