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


def _blocks(
    weight: torch.Tensor, dtype: torch.dtype, pair: int, reuse_storage: bool = False
) -> torch.Tensor:
    """[ceil(N/16), ceil(K/pair), 16, pair] in ``dtype`` from a weight [N, K] (N padded to 16
    and K to ``pair`` with zeros), a chunk of blocks at a time.

    ``reuse_storage``: the caller gives the weight up, so where no padding or conversion is
    needed the blocks are written over it, a chunk at a time (block b holds the bytes of
    rows 16b..16b+15 in either layout). Packing into a new tensor held the weight twice at
    once: Gemma 3's tied 262,144 x 640 head, 335 MB in bf16, was most of the load's peak
    above the served model's resident size."""
    n, k = weight.shape
    nb, kp = -(-n // ROWS), -(-k // pair)
    in_place = (
        reuse_storage
        and weight.dtype == dtype
        and weight.is_contiguous()
        and n % ROWS == 0
        and k % pair == 0
        and weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    )
    out = (
        weight.view(nb, kp, ROWS, pair)
        if in_place
        else torch.empty(nb, kp, ROWS, pair, dtype=dtype, device=weight.device)
    )
    step = max(1, CHUNK_ELEMENTS // (kp * pair * ROWS))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        chunk = weight[b0 * ROWS : b1 * ROWS].to(dtype)
        pads = (0, kp * pair - k, 0, (b1 - b0) * ROWS - chunk.shape[0])
        if any(pads):
            chunk = F.pad(chunk, pads)
        elif in_place:
            chunk = chunk.clone()  # these rows are about to be written over
        out[b0:b1] = chunk.view(b1 - b0, ROWS, kp, pair).transpose(1, 2)
    return out


def pack(weight: torch.Tensor, reuse_storage: bool = False) -> torch.Tensor:
    """bf16 [ceil(N/16), ceil(K/2), 16, 2] from a weight [N, K] (``reuse_storage``: see
    ``_blocks``)."""
    return _blocks(weight, torch.bfloat16, PAIR, reuse_storage)


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack``."""
    nb, kp = packed.shape[:2]
    w = packed.transpose(1, 2).reshape(nb * ROWS, kp * PAIR)
    return w[:out_features, :in_features]


def pack_f32(weight: torch.Tensor, reuse_storage: bool = False) -> torch.Tensor:
    """fp32 [ceil(N/16), K, 16] from a weight [N, K] (N padded to 16 with zeros;
    ``reuse_storage``: see ``_blocks``)."""
    return _blocks(weight, torch.float32, 1, reuse_storage).squeeze(-1)


def unpack_f32(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [N, K] back from ``pack_f32``."""
    nb, k = packed.shape[:2]
    return packed.transpose(1, 2).reshape(nb * ROWS, k)[:out_features]


def rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the weight [len(ids), K], read from ``pack``'s or ``pack_f32``'s
    blocks: a tied LM head packed for the GEMV is also the embedding table, so the model
    keeps no row-major copy beside it. Exact (the blocks hold the values unchanged). A bf16
    pair read as one int32 halves the gather's elements: 1,024 of SmolLM2's rows took 0.7 ms
    so against 7.3 ms as two bf16 values (a prompt step's embedding)."""
    flat = ids.reshape(-1)
    if packed.dim() == 4:  # bf16 [nb, kp, 16, 2]: each (k, k + 1) pair gathered as one int32
        pairs = packed.view(torch.int32).squeeze(-1)  # [nb, kp, 16]
        picked = pairs[flat // ROWS, :, flat % ROWS].view(packed.dtype)  # [T, 2 * kp]
    else:  # fp32 [nb, K, 16]
        picked = packed[flat // ROWS, :, flat % ROWS]
    return picked[:, :in_features].reshape(*ids.shape, in_features)
