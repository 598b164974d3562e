"""int4 projections, asymmetric per group of input channels: the layouts its kernels read
(torch's packing, rows, 8 interleaved channels, AMX tiles) and how each is built from float
weights or a GGUF file's blocks (``quant`` has the overview)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import amx_layout, int4_layout
from tokenmill.model.quant_base import (
    EVERY_BATCH,
    QUANTIZE_ROWS,
    TILES,
    Op,
    QuantizedLinear,
    in_prompt_chunks,
    kernel_dtype,
    kernel_for,
    tile_kernel_op,
    w8a8_rows,
)

_INT4_LAYOUT_BLOCKS = (64, 32)
"""Output-channel block of torch's CPU int4 packing: 64 with AVX-512 kernels, 32 with AVX2."""


_FITTED_LEVELS = (14.5, 15.5)
"""Steps per group range whose grids start the least-squares fits, beside min-max's 15:
half a step more clips an outlier, half a step fewer widens the grid, and the fit then
moves the scale and offset to the codes chosen. Chosen by ``verify`` on Gemma 3 270M (int4,
groups of 32, 16 prompts x 64 tokens teacher-forced against float32): min-max alone 91.2%
top-1 and mean KL 0.405; these two 94.3% and 0.184; adding 14 (less squared error still)
91.6% and 0.234, and 13.5 to 16 in halves 90.4% and 0.264. So the set is the measured best,
not the least squared error."""

_FIT_ROUNDS = 2
"""Fits per starting grid: each re-chooses the codes against the last fit's parameters."""


def _fitted_groups(w: torch.Tensor, half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15, scale and low end for groups ``w`` [rows, groups, size]: each group's
    lowest squared error among min-max's and the least-squares scale and offset fitted to
    the codes of each grid in ``_FITTED_LEVELS`` (llama.cpp's K-quants search alike). min-max
    is a candidate, so no group is worse than it. ``half``: parameters rounded to fp16
    before the codes are chosen against them, so the error is the one the kernel computes
    with."""
    size = w.shape[-1]
    w_low, w_high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    w_sum = w.sum(dim=-1, keepdim=True)

    def codes_for(s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if half:
            s, o = s.half().float(), o.half().float()
        s = s.clamp(min=1e-8)
        c = torch.round((w - o) / s).clamp(0, 15)
        return c, s, o, ((c * s + o - w) ** 2).sum(dim=-1, keepdim=True)

    codes, scale, low, error = codes_for((w_high - w_low) / 15.0, w_low)
    for levels in _FITTED_LEVELS:
        grid = torch.round((w - w_low) / ((w_high - w_low) / levels).clamp(min=1e-8)).clamp(0, 15)
        for _ in range(_FIT_ROUNDS):
            c_sum = grid.sum(dim=-1, keepdim=True)
            det = size * (grid * grid).sum(dim=-1, keepdim=True) - c_sum * c_sum
            fit = det > 0  # at least two distinct codes
            s = (size * (grid * w).sum(dim=-1, keepdim=True) - c_sum * w_sum) / det.where(fit, 1.0)
            s = s.where(fit, scale)
            grid, s, o, e = codes_for(s, ((w_sum - s * c_sum) / size).where(fit, low))
            better = e < error
            codes, scale = grid.where(better, codes), s.where(better, scale)
            low, error = o.where(better, low), e.where(better, error)
    return codes, scale, low


def _int4_groups(
    weight: torch.Tensor, padded_out: int, padded_in: int, group_size: int, half: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 (int32 [padded_out, padded_in]), and each group's scale and low end
    ([padded_out, groups, 1]): asymmetric, fitted by ``_fitted_groups``. Padding is zeros. ``half``:
    scale and low end rounded to fp16 (the layout that stores them so) before the codes are
    chosen against them, so the codes fit the values the kernel multiplies by."""
    out_features, in_features = weight.shape
    groups = padded_in // group_size
    q = torch.zeros(padded_out, padded_in, dtype=torch.int32)
    scale = torch.empty(padded_out, groups, 1)
    low = torch.empty(padded_out, groups, 1)
    for lo in range(0, padded_out, QUANTIZE_ROWS):
        hi = min(lo + QUANTIZE_ROWS, padded_out)
        w = torch.zeros(hi - lo, padded_in)
        if lo < out_features:
            w[: min(hi, out_features) - lo, :in_features] = weight[lo:hi].float()
        if group_size % 8 == 0 and group_size <= 256 and kernels.available():
            q[lo:hi], scale[lo:hi], low[lo:hi] = kernels.quantize_int4_groups(
                w, group_size, half, _FITTED_LEVELS, _FIT_ROUNDS
            )
        else:
            codes, scale[lo:hi], low[lo:hi] = _fitted_groups(w.view(-1, groups, group_size), half)
            q[lo:hi] = codes.view(hi - lo, -1)
    return q, scale, low


def _pad_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    padded_out: int,
    padded_in: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and group parameters quantized already (a GGUF file's), in ``_int4_groups``' shapes
    and padding."""
    out_features, in_features = codes.shape
    groups = padded_in // group_size
    q = torch.zeros(padded_out, padded_in, dtype=torch.int32)
    q[:out_features, :in_features] = codes
    padded_scale = torch.zeros(padded_out, groups, 1)
    padded_low = torch.zeros(padded_out, groups, 1)
    padded_scale[:out_features, : scale.shape[1], 0] = scale
    padded_low[:out_features, : low.shape[1], 0] = low
    return q, padded_scale, padded_low


class Int4Linear(QuantizedLinear):
    """int4 weights, asymmetric per group of ``group_size`` input channels, in torch's CPU packing.

    The kernel wants whole groups and output channels in multiples of 16; a shape that is
    not (the demo model's 688-wide MLP) is zero-padded, which changes no result: padded
    input channels meet zero activations and padded output channels are cut off. Output
    channels are padded to a multiple of 64 so the packing always has the layout
    ``_unpack`` reads; dequantization then reads the packed tensor itself, and no second
    copy of the weight is kept.
    """

    max_kernel_rows = 64
    """Dequantizing the packing costs 4-5 elementwise passes (11 ms for 1024 -> 5632 on 2
    threads), which the int4 kernel only exceeds beyond about 64 rows."""

    # Buffers (register_buffer), declared so that they type as tensors, not Tensor | Module;
    # which of them exist depends on the layout (``kernel``).
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    offsets: torch.Tensor
    kernel_scales: torch.Tensor
    kernel_offsets: torch.Tensor
    amx_tiles: torch.Tensor
    amx_scales: torch.Tensor
    amx_offsets: torch.Tensor
    amx_code_sums: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
        groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``groups``: codes [out, in] and each group's scale and offset [out, in / group_size]
        already quantized (a GGUF file's blocks); ``weight`` then only gives the shape,
        dtype and device."""
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.padded_in = -(-in_features // group_size) * group_size
        self.padded_out = -(-out_features // 64) * 64
        groups_per_row = self.padded_in // group_size
        self.kernel = kernel_for(weight, tiles_ok=group_size % 64 == 0)
        file_fp16 = groups is not None and fp16_exact(groups[1], groups[2])
        if self.kernel == "rows" and channels8(group_size) and (groups is None or file_fp16):
            self.kernel = "channels8"
        if groups is None:
            q, scale, low = _int4_groups(
                weight, self.padded_out, self.padded_in, group_size, self.kernel == "channels8"
            )
        else:
            q, scale, low = _pad_groups(*groups, self.padded_out, self.padded_in, group_size)
        if self.kernel is not None:
            self._store_for_kernel(
                q, scale.view(self.padded_out, groups_per_row), low.view(-1, groups_per_row)
            )
            self._refresh_fast_path()
            return
        # torch's convention: w = (q - 8) * scale + zero, so zero = low + 8 * scale.
        zero = low + 8 * scale
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scale.view(-1, groups_per_row), zero.view(-1, groups_per_row)], -1)
            .transpose(0, 1)
            .contiguous()
            .to(kernel_dtype(weight.dtype)),
        )
        self.register_buffer("offsets", (zero - 8 * scale).view(self.padded_out, groups_per_row))
        """zero - 8 * scale per group in fp32: dequantizing is then one multiply-add."""
        self.layout_block = next((b for b in _INT4_LAYOUT_BLOCKS if self._unpacks_to(b, q)), None)
        """The packing's channel block, or None if it is not one we can read: then the int4
        kernel serves every batch size (slower for large ones, still correct)."""
        if self.layout_block is None:
            self.max_kernel_rows = EVERY_BATCH

    dequantized_gemm_rows = 512
    """Rows (a prefill chunk's tokens) from which a row-kernel projection dequantizes its
    weight to fp32 (``kernels.dequantize_int4``) and runs torch's fp32 GEMM instead of the
    int4 kernel. On the AVX2 EPYC at 2 threads over SmolLM2's, Gemma 3 270M's and the 250M
    model's projections (``benchmarks/int4_prefill.py``, groups of 32) the GEMM was 0.9-1.8x
    the kernel at 512 rows and 1.9-2.6x at 2048; at 256 it lost on the gate/up projections
    (0.7-0.8x) while winning on the down ones (1.3-1.9x). The int kernel re-reads each weight
    row per 4 activation rows and widens every group of 32 to fp32; dequantizing costs the
    weight's size whatever the row count, so the threshold is rows, not rows x inputs. Above
    the default ``--max-num-seqs`` (256), so a decode step stays on the int kernel (the fused
    step's, bit for bit); a step that mixes decode rows into a prefill chunk of 512+ rows
    computes them all by the GEMM (activations unquantized, weights exact)."""

    avx512_dequantized_gemm_rows = 64
    """On AVX-512 BF16 without AMX, a GGUF file's groups in the ``rows`` layout (scales fp16
    would round, as Q4_K's; ``linear_int4`` there widens every group before its dot
    products) rebuilt in bf16 for
    oneDNN's bf16 GEMM: on a Zen 5 EPYC at 2 threads over SmolLM2's projections
    (``results/int4-prefill-avx512-2026-12-07/rows.txt``) 0.73-0.80x the kernel's time at
    64 rows and 0.30-0.44x at 256-1024, where the fp32 GEMM took 0.8-1.0x. ``channels8``
    never leaves its VNNI kernel there (``_fp32_gemm_wins``)."""

    amx_prompt_gemm_rows = 64
    """``amx_dequantized_gemm_rows`` for groups of 32 in 8 channels in a step that holds
    prefill chunks (``quant_base.prompt_chunks``; a decode-only step keeps 257, as the fused
    decode step computes it). Their GEMV blocks are rebuilt at ~20 GB/s, and on the AMX Xeon
    at 2 threads over SmolLM2's projections blocks + the bf16 tiles took 0.73-0.93x the VNNI
    kernel's time at 64 rows, 0.49-0.60x at 128 and 0.94-1.25x at 48
    (``results/int4-prompt-rows-amx-2026-12-07/``). A step that mixed 15 decode rows with a
    128-token prompt chunk had stayed on the VNNI kernel, compute-bound there, while bf16 ran
    on the tiles."""

    def _bf16_gemm_rows(self) -> int | None:
        if self.kernel != "channels8":
            return super()._bf16_gemm_rows()
        if not kernels.amx_bf16_active():
            return None
        return self.amx_prompt_gemm_rows if in_prompt_chunks() else self.amx_dequantized_gemm_rows

    def _fp32_gemm_wins(self) -> bool:
        """Not for ``channels8`` on AVX-512: its VNNI kernel (``linear_int4_x8``) took
        0.72-0.89x the time of GEMV blocks rebuilt in bf16 (``kernels.gemv_bf16``) at 1024
        rows and 0.25-0.38x that of the fp32 GEMM from 512 rows on, over SmolLM2's, Gemma 3's
        and the 250M model's projections (Zen 5 EPYC, 2 threads,
        ``results/int4-prefill-avx512-2026-12-07/before.txt``), so it serves every row
        count; the fp32 GEMM had made int4's prompts 2.4x slower than bf16's there."""
        return self.kernel != "channels8" or kernels.active_isa() != "avx512_bf16"

    def _dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.kernel == "channels8":
            return kernels.dequantize_int4_x8(
                self.packed, self.kernel_scales, self.kernel_offsets, self.out_features,
                self.in_features, dtype == torch.bfloat16,
            )  # fmt: skip
        if self.kernel == "rows":
            return kernels.dequantize_int4(
                self.packed, self.kernel_scales, self.kernel_offsets, self.group_size,
                self.in_features,
            ).to(dtype)  # fmt: skip
        return None

    def _dequantized_blocks(self) -> torch.Tensor | None:
        if self.kernel != "channels8" or self.in_features % 32:
            return None
        return kernels.dequantize_int4_x8_blocks(
            self.packed, self.kernel_scales, self.kernel_offsets, self.out_features,
            self.in_features,
        )  # fmt: skip

    def _store_for_kernel(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> None:
        """Codes, scales and offsets (``w = q * scale + low``) in the kernel's layout only."""
        n, gs = self.out_features, self.group_size
        k_pad = int4_layout.padded_in(self.in_features, gs)
        groups = k_pad // gs
        if self.kernel == "channels8":  # whole blocks of 8 channels (padded_out has 64)
            n8 = -(-n // 8) * 8
            block = int4_layout.block_channels8
            codes = F.pad(q[:n8], (0, k_pad - q.shape[1]))
            self.register_buffer("packed", int4_layout.pack_channels8(codes))
            self.register_buffer(
                "kernel_scales", block(F.pad(scale[:n8], (0, groups - scale.shape[1]))).half()
            )
            self.register_buffer(
                "kernel_offsets", block(F.pad(low[:n8], (0, groups - low.shape[1]))).half()
            )
            self.max_kernel_rows = EVERY_BATCH
            self.layout_block = None
            return
        codes = F.pad(q[:n], (0, k_pad - q.shape[1]))
        scale = F.pad(scale[:n], (0, groups - scale.shape[1])).contiguous()
        low = F.pad(low[:n], (0, groups - low.shape[1])).contiguous()
        self.register_buffer("kernel_scales", scale)
        self.register_buffer("kernel_offsets", low)
        if self.kernel in TILES:
            block = amx_layout.block_channels
            sums = codes.view(n, groups, gs).sum(-1, dtype=torch.int32)
            self.register_buffer("amx_tiles", amx_layout.pack_int4(codes))
            self.register_buffer("amx_scales", block(scale))
            self.register_buffer("amx_offsets", block(low))
            self.register_buffer("amx_code_sums", block(sums))
            self.max_kernel_rows = EVERY_BATCH
        else:
            self.register_buffer("packed", int4_layout.pack(codes))
            if w8a8_rows() and gs % 32 == 0:  # the AVX2 table quantizes x for groups of 32 too
                self.max_kernel_rows = EVERY_BATCH
        self.layout_block = None

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[Op, tuple[object, ...]] | None:
        tile_op = tile_kernel_op(self.kernel, x, kernels.linear_int4_amx, kernels.linear_int4_vnni)
        gs, n = self.group_size, self.out_features
        if tile_op is not None:
            tiles = (self.amx_tiles, self.amx_scales, self.amx_code_sums, self.amx_offsets)
            return tile_op, (*tiles, gs, bias, n)
        if self.kernel == "rows" and kernels.supports(x, float32=True):
            rows = (self.packed, self.kernel_scales, self.kernel_offsets)
            return kernels.linear_int4, (*rows, gs, bias)
        if self.kernel == "channels8" and kernels.supports(x, float32=True):
            blocks = (self.packed, self.kernel_scales, self.kernel_offsets)
            return kernels.linear_int4_x8, (*blocks, bias, n)
        return None

    def _codes(self) -> torch.Tensor:
        """Codes [out, k_pad] from the kernel layout."""
        if self.kernel == "channels8":
            return int4_layout.unpack_channels8(self.packed)[: self.out_features]
        if self.kernel in TILES:
            tiles = self.amx_tiles
            both = torch.cat((tiles & 15, tiles >> 4), dim=-1)  # [nb, kc, 1024]
            both = both.view(*tiles.shape[:2], 16, 16, 4).permute(0, 3, 1, 2, 4)
            return both.reshape(tiles.shape[0] * 16, -1)[: self.out_features]
        return int4_layout.unpack(self.packed)

    def _unpacks_to(self, block: int, expected: torch.Tensor) -> bool:
        if self.padded_out % block:
            return False
        return torch.equal(self._unpack(block, torch.int32), expected)

    def _unpack(self, block: int, dtype: torch.dtype) -> torch.Tensor:
        """The 4-bit codes [out, in] from the packing, in ``dtype``: per block of ``block``
        channels and per input channel, ``block / 2`` bytes whose low nibbles are the first
        half of the block's channels and high nibbles the second half."""
        packed = self.packed.view(self.padded_out // block, self.padded_in, block // 2)
        out = torch.empty(self.padded_out // block, block, self.padded_in, dtype=dtype)
        out[:, : block // 2].copy_((packed & 15).transpose(1, 2))  # convert and transpose at once
        out[:, block // 2 :].copy_((packed >> 4).transpose(1, 2))
        return out.view(self.padded_out, self.padded_in)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.pad(x, (0, self.padded_in - self.in_features))
            if self.padded_in > self.in_features
            else x
        )

    def _torch_gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(
            self._pad(x).to(self.scales_and_zeros.dtype),
            self.packed,
            self.group_size,
            self.scales_and_zeros,
        )
        return y[:, : self.out_features]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel is not None:
            scales, offsets = self.kernel_scales, self.kernel_offsets
            if self.kernel == "channels8":  # [blocks, G, 8] -> [out, G]
                n = self.out_features
                scales = scales.transpose(1, 2).reshape(-1, scales.shape[1])[:n]
                offsets = offsets.transpose(1, 2).reshape(-1, offsets.shape[1])[:n]
            groups = self._codes().to(dtype).view(self.out_features, -1, self.group_size)
            groups.mul_(scales.to(dtype)[..., None]).add_(offsets.to(dtype)[..., None])
            return groups.view(self.out_features, -1)[:, : self.in_features]
        assert self.layout_block is not None
        out = self._unpack(self.layout_block, dtype)
        groups = out.view(self.padded_out, -1, self.group_size)
        scale = self.scales_and_zeros[..., 0].t().unsqueeze(-1).to(dtype)
        offset = self.offsets.unsqueeze(-1).to(dtype)
        groups.mul_(scale).add_(offset)
        return out[: self.out_features, : self.in_features]


def channels8(group_size: int) -> bool:
    """Whether int4 weights quantized at load in groups of ``group_size`` go to the layout of
    8 interleaved channels (``int4_layout.pack_channels8``, fp16 scales and offsets): groups
    of 32, on every kernel table (``linear_int4_x8``: AVX2 code, or AVX-512 VNNI where that
    table is active, the same bits). Its one-row product read SmolLM2's 120 projections of a
    token 1.5x faster than the per-channel rows at 2 threads (1.7x at one), with 5 bits a
    weight instead of 6; on the AMX Xeon, where the AVX-512 table had taken groups of 32
    weight-only (bf16 activations, dequantized per row), SmolLM2's int4 decode step became
    3.2x faster at one stream and 2.9x at 16. A GGUF file's blocks go there too where fp16
    holds their scales and offsets exactly (``fp16_exact``: Q4_0's and Q4_1's, stored as
    fp16), and keep the rows and their fp32 scales otherwise (a Q4_K scale is a product of
    fp16 and a 6-bit integer, which fp16 would round)."""
    return group_size == 32


def fp16_exact(*tensors: torch.Tensor) -> bool:
    """Whether every value of ``tensors`` is a float16 value (finite), so that 8 interleaved
    channels' fp16 scales and offsets rebuild a file's weights bit for bit."""
    return all(torch.equal(t.half().float(), t.float()) for t in tensors)
