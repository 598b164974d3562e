"""Quantization at load time: int8 per output channel, int4 group-wise.

With tokenmill's CPU kernels (``tokenmill/kernels``) a projection stores its weights in the
layout its kernel reads, once: AMX-INT8 tiles (16 channels x 64 inputs in VNNI order,
``kernels/amx_layout.py``) wherever the AVX-512 table runs, read by AMX where the process
may use it and by AVX-512 VNNI dot products otherwise (``kernel`` ``amx`` or ``vnni``); plain
rows for the AVX2 kernels (and int4 groups of 32). Both tables quantize activations to int8
(W8A8 dynamic, llama.cpp Q8_0's trade): per row, except the AVX2 table's int8 (per group of
64 inputs) and int4 groups of 32 (per group of 32; weight-only on AVX-512). The torch paths
below remain for machines without the extension.

The tile kernels beat oneDNN's bf16 GEMM at every row count measured (1-256 rows of the
250M model's layers, ``benchmarks/int_gemm_ab.py``), and so do the AVX2 W8A8 row kernels
against dequantize + GEMM (``_w8a8_rows``), so they serve every batch; the weight-only row
kernels re-read each weight row per 4 activation rows and end every output with a
horizontal sum, so above ``max_kernel_rows`` their projections dequantize and run the GEMM.

Torch's kernels are (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``). Measured
on this project's 2-core AVX-512/AMX machine (8 layers of the 250M model's shapes,
CHANGELOG.md, benchmark history): for one row they read int4 weights 2.5x faster than oneDNN reads
prepacked bf16 and int8 about as fast; their cost then grows with the row count (they walk
the weights again per few rows), while dequantizing the layer's weight into the activation
dtype and running the GEMM costs the same at any row count. Activations stay in the model
dtype; the int kernels take bf16 inputs (their fp32 paths are 5x slower), so an fp32
model's activations are rounded to bf16 for that product only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs, kernels
from tokenmill.errors import ConfigError
from tokenmill.kernels import amx_layout, int4_layout

_INT4_LAYOUT_BLOCKS = (64, 32)
"""Output-channel block of torch's CPU int4 packing: 64 with AVX-512 kernels, 32 with AVX2."""

_TILES = ("amx", "vnni")
"""The kernels that read AMX tiles (``kernels/amx_layout.py``)."""
_Op = Callable[..., torch.Tensor]
"""A linear op of tokenmill's kernels (``kernels.linear_int8_amx`` and its siblings)."""
_EVERY_BATCH = torch.iinfo(torch.int64).max
"""``max_kernel_rows`` of a projection whose int kernel serves every batch size."""
_BF16_ROWS = torch.empty(0, 1, dtype=torch.bfloat16)
"""A bf16 CPU activation, for asking ``_tile_op`` which op reads the tiles now."""


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int kernels run in: half as it is, fp32 rounded to bf16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class QuantizedLinear(nn.Module):
    """Common part of the int8 and int4 projections: bias, shapes, the row-count dispatch."""

    max_kernel_rows = 0
    """Rows up to which the int kernel beats dequantize + GEMM."""
    kernel: str | None
    """Which tokenmill kernel serves this projection: amx, vnni, rows, channels8 (int4), or
    None (torch's)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_gemv = True
        """Whether the int kernel may serve small batches (else dequantize + GEMM always)."""
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._fast: tuple[_Op, tuple[object, ...], str] | None = None
        """(op, its arguments after x, the ISA they were taken for): the whole forward of a
        projection whose kernel serves every batch, for the decoder's bf16 [tokens, hidden]
        rows. One stream calls ~65 projections a step; the general path (module buffer
        lookups, dispatch checks, reshape, casts, a separate bias add) cost ~15 us each."""

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[_Op, tuple[object, ...]] | None:
        """tokenmill's op for activations like ``x`` now, and its arguments after x (with
        ``bias``), or None where no tokenmill kernel takes them."""
        return None

    def _refresh_fast_path(self) -> None:
        fast = (
            self._kernel_call(_BF16_ROWS, self.bias)
            if self.max_kernel_rows == _EVERY_BATCH
            else None
        )
        self._fast = None if fast is None else (*fast, kernels.active_isa())

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        result = super()._apply(fn, recurse)
        self._refresh_fast_path()  # the buffers may be new tensors now
        return result

    dequantized_gemm_rows: int | None = None
    """Rows (a prefill chunk's tokens) from which the projection dequantizes its weight to fp32
    (``_fp32_weight``) and runs torch's fp32 GEMM instead of its int kernel; None: never."""

    def _fp32_weight(self) -> torch.Tensor | None:
        """The weight as fp32 [out, in] for the prefill GEMM, or None where this layout has
        no such path."""
        return None

    def _prefill_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x``'s product by the fp32 GEMM of the dequantized weight (activations exact), where
        ``x`` has ``dequantized_gemm_rows`` rows or more; else None."""
        rows = self.dequantized_gemm_rows
        if (
            rows is None
            or x.numel() < rows * self.in_features
            or not kernels.supports(x)
            or envs.is_off(envs.PREFILL_GEMM)
        ):
            return None
        weight = self._fp32_weight()
        if weight is None:
            return None
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), weight, bias).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prefill = self._prefill_gemm(x)
        if prefill is not None:
            return prefill
        fast = self._fast
        if (
            fast is not None
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.stride(1) == 1
            and fast[2] == kernels.active_isa()  # tests switch the ISA after load
        ):
            return fast[0](x, *fast[1])
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.max_kernel_rows and self.has_gemv:
            y = self._gemv(flat).to(x.dtype)
        else:
            y = F.linear(flat, self.dequantize(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with float32 outputs (an LM head's logits). Here the kernel's own
        outputs, widened; the int8 row layout overrides it with an op that never rounds."""
        return self(x).float()

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        call = self._kernel_call(x, None)
        if call is not None:
            return call[0](x.to(torch.bfloat16), *call[1])
        if self.kernel is not None:  # the ISA was switched after load (tests): stay correct
            return F.linear(x, self.dequantize(x.dtype))
        return self._torch_gemv(x)

    def _torch_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """torch's int kernel, for layers stored in its packing (no tokenmill kernels)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, rebuilt from its quantized form."""
        raise NotImplementedError


_QUANTIZE_ROWS = 256
"""Output channels quantized at a time: the fp32 temporaries stay ~1 MB instead of several
copies of the whole weight, which the C allocator then kept resident after loading."""


def int8_channels(
    chunks: Iterable[torch.Tensor], shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and fp32 scales, one per output channel (symmetric, absmax / 127), of a
    weight ``shape`` given as consecutive chunks of its rows. Each channel depends on its
    own row only, so the result is the same bit for bit however the rows are chunked, and a
    caller that dequantizes a chunk at a time (a GGUF file's blocks) never holds the float
    weight whole."""
    qweight = torch.empty(shape, dtype=torch.int8)
    scales = torch.empty(shape[0])
    row = 0
    for chunk in chunks:
        for lo in range(0, chunk.shape[0], _QUANTIZE_ROWS):
            w = chunk[lo : lo + _QUANTIZE_ROWS].float()
            hi = row + lo + w.shape[0]
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            qweight[row + lo : hi] = torch.round(w / scale[:, None]).clamp(-127, 127)
            scales[row + lo : hi] = scale
        row += chunk.shape[0]
    if row != shape[0]:
        raise ValueError(f"int8_channels: chunks hold {row} rows of {shape[0]}")
    return qweight, scales


def _int8_row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each channel's sum of codes in int32, a chunk of rows at a time: ``sum(dtype=int32)``
    widens its whole input first (671 MB for Gemma 3's 262,144 x 640 tied head)."""
    sums = torch.empty(qweight.shape[0], dtype=torch.int32)
    for lo in range(0, qweight.shape[0], _QUANTIZE_ROWS):
        sums[lo : lo + _QUANTIZE_ROWS] = qweight[lo : lo + _QUANTIZE_ROWS].sum(1, dtype=torch.int32)
    return sums


def _int4_groups(
    weight: torch.Tensor, padded_out: int, padded_in: int, group_size: int, half: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 (int32 [padded_out, padded_in]), and each group's scale and low end
    ([padded_out, groups, 1]): asymmetric, (high - low) / 15. Padding is zeros. ``half``:
    scale and low end rounded to fp16 (the layout that stores them so) before the codes are
    chosen against them, so the codes fit the values the kernel multiplies by."""
    out_features, in_features = weight.shape
    groups = padded_in // group_size
    q = torch.zeros(padded_out, padded_in, dtype=torch.int32)
    scale = torch.empty(padded_out, groups, 1)
    low = torch.empty(padded_out, groups, 1)
    for lo in range(0, padded_out, _QUANTIZE_ROWS):
        hi = min(lo + _QUANTIZE_ROWS, padded_out)
        w = torch.zeros(hi - lo, padded_in)
        if lo < out_features:
            w[: min(hi, out_features) - lo, :in_features] = weight[lo:hi].float()
        w = w.view(hi - lo, groups, group_size)
        w_low, w_high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        w_scale = (w_high - w_low) / 15.0
        if half:
            w_scale, w_low = w_scale.half().float(), w_low.half().float()
        w_scale = w_scale.clamp(min=1e-8)
        q[lo:hi] = torch.round((w - w_low) / w_scale).clamp(0, 15).view(hi - lo, -1)
        scale[lo:hi], low[lo:hi] = w_scale, w_low
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


class Int8Linear(QuantizedLinear):
    """int8 weights with one scale per output channel (symmetric, absmax / 127)."""

    max_kernel_rows = 16
    """At 16 rows the kernel took 2.5 ms for 1024 -> 5632 (2 threads), dequantize + GEMM 3.6;
    at 64 rows 10.1 against 4.6."""

    # Buffers (register_buffer), declared so that they type as tensors, not Tensor | Module;
    # which of them exist depends on the layout (``kernel``).
    qweight: torch.Tensor | None
    scales: torch.Tensor
    kernel_scales: torch.Tensor
    row_sums: torch.Tensor
    amx_tiles: torch.Tensor
    amx_scales: torch.Tensor
    amx_row_sums: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tiles_ok: bool = True,
        channels: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``tiles_ok=False`` keeps the row layout on every ISA: its kernel also writes fp32
        outputs (``forward_float32``, an LM head's logits). ``channels``: codes [out, in] and
        scales [out] already quantized (``int8_channels`` over a GGUF tensor's rows);
        ``weight`` then only gives the shape, dtype and device."""
        super().__init__(weight.shape[1], weight.shape[0], bias)
        qweight, scales = channels or int8_channels((weight,), (weight.shape[0], weight.shape[1]))
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)  # fp32: the dequantizing path keeps full scales
        self.kernel = _kernel_for(weight, tiles_ok=tiles_ok)
        if self.kernel is not None:
            row_sums = _int8_row_sums(qweight)
            if self.kernel in _TILES:
                self.register_buffer("amx_tiles", amx_layout.pack_int8(qweight))
                self.register_buffer("amx_scales", amx_layout.block_channels(scales))
                self.register_buffer("amx_row_sums", amx_layout.block_channels(row_sums))
                self.qweight = None  # the tiles are the only copy
                self.max_kernel_rows = _EVERY_BATCH  # beats bf16 GEMMs
            else:
                self.register_buffer("row_sums", row_sums)
                if _w8a8_rows():
                    self.max_kernel_rows = _EVERY_BATCH
            self._refresh_fast_path()
            return
        self.register_buffer("kernel_scales", scales.to(kernel_dtype(weight.dtype)))
        # torch's int8 kernel crashes or miscomputes from 2 rows on when the input width is
        # not a multiple of 16 (seen at 40 and 72 in torch 2.13); such a shape skips it.
        self.has_gemv = self.in_features % 16 == 0

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[_Op, tuple[object, ...]] | None:
        tile_op = _tile_op(self.kernel, x, kernels.linear_int8_amx, kernels.linear_int8_vnni)
        if tile_op is not None:
            tiles = (self.amx_tiles, self.amx_scales, self.amx_row_sums)
            return tile_op, (*tiles, bias, self.out_features)
        if self.kernel == "rows" and kernels.supports(x, float32=True):
            return kernels.linear_int8, (self.int_weight(), self.scales, self.row_sums, bias)
        return None

    dequantized_gemm_rows = 512
    """As ``Int4Linear.dequantized_gemm_rows``, for the AVX2 W8A8 rows: on the AVX2 EPYC at 2
    threads (SmolLM2's and the 250M model's projections) dequantize + fp32 GEMM took 0.69-1.04x
    the kernel's time at 64 rows, 1.0-1.2x at 256 and 1.18-1.26x at 512 (i.e. faster from
    512 on) and 1.3-1.7x faster at 2048. Above the default ``--max-num-seqs``, so decode
    steps stay on the kernel."""

    def _fp32_weight(self) -> torch.Tensor | None:
        if self.kernel != "rows":
            return None
        return self.int_weight().float().mul_(self.scales[:, None])

    lookup_dtype: torch.dtype = torch.bfloat16
    """The dtype ``embedding`` returns rows in (a tied head's model dtype)."""

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized: a tied LM head is also the embedding
        table, so the model keeps no second copy of it."""
        rows = self.int_weight()[ids].float() * self.scales[ids].unsqueeze(-1)
        return rows.to(self.lookup_dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "rows" and kernels.supports(flat, float32=True):
            y = kernels.linear_int8_f32out(
                flat.to(torch.bfloat16), self.int_weight(), self.scales, self.row_sums, self.bias
            )
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward_float32(x)

    def _torch_gemv(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.kernel_scales
        return torch._weight_int8pack_mm(x.to(scales.dtype), self.int_weight(), scales)

    def int_weight(self) -> torch.Tensor:
        """The int8 weight [out, in], from whichever layout holds it."""
        if self.qweight is not None:
            return self.qweight
        tiles = self.amx_tiles.view(*self.amx_tiles.shape[:2], 16, 16, 4)
        rows = tiles.permute(0, 3, 1, 2, 4).reshape(tiles.shape[0] * 16, -1)
        return rows[: self.out_features, : self.in_features]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # two passes in ``dtype``: half the traffic of an fp32 temporary
        weight = self.int_weight().to(dtype)
        return weight.mul_(self.scales.to(dtype)[:, None])


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
        self.kernel = _kernel_for(weight, tiles_ok=group_size % 64 == 0)
        if self.kernel == "rows" and groups is None and _channels8(group_size):
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
            self.max_kernel_rows = _EVERY_BATCH

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

    def _fp32_weight(self) -> torch.Tensor | None:
        if self.kernel == "channels8":
            return kernels.dequantize_int4_x8(
                self.packed, self.kernel_scales, self.kernel_offsets, self.out_features,
                self.in_features,
            )  # fmt: skip
        if self.kernel == "rows":
            return kernels.dequantize_int4(
                self.packed, self.kernel_scales, self.kernel_offsets, self.group_size,
                self.in_features,
            )  # fmt: skip
        return None

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
            self.max_kernel_rows = _EVERY_BATCH
            self.layout_block = None
            return
        codes = F.pad(q[:n], (0, k_pad - q.shape[1]))
        scale = F.pad(scale[:n], (0, groups - scale.shape[1])).contiguous()
        low = F.pad(low[:n], (0, groups - low.shape[1])).contiguous()
        self.register_buffer("kernel_scales", scale)
        self.register_buffer("kernel_offsets", low)
        if self.kernel in _TILES:
            block = amx_layout.block_channels
            sums = codes.view(n, groups, gs).sum(-1, dtype=torch.int32)
            self.register_buffer("amx_tiles", amx_layout.pack_int4(codes))
            self.register_buffer("amx_scales", block(scale))
            self.register_buffer("amx_offsets", block(low))
            self.register_buffer("amx_code_sums", block(sums))
            self.max_kernel_rows = _EVERY_BATCH
        else:
            self.register_buffer("packed", int4_layout.pack(codes))
            if _w8a8_rows() and gs % 32 == 0:  # the AVX2 table quantizes x for groups of 32 too
                self.max_kernel_rows = _EVERY_BATCH
        self.layout_block = None

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[_Op, tuple[object, ...]] | None:
        tile_op = _tile_op(self.kernel, x, kernels.linear_int4_amx, kernels.linear_int4_vnni)
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
        if self.kernel in _TILES:
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


def _kernel_for(weight: torch.Tensor, tiles_ok: bool) -> str | None:
    """The tokenmill kernel a projection is stored for: amx or vnni (both read AMX tiles),
    rows (the AVX2 table, or a shape the tiles do not take), or None for torch's."""
    if weight.device.type != "cpu" or not kernels.available():
        return None
    if not tiles_ok:
        return "rows"
    if kernels.amx_active():
        return "amx"
    return "vnni" if kernels.active_isa() == "avx512_bf16" else "rows"


def _channels8(group_size: int) -> bool:
    """Whether int4 weights quantized at load in groups of ``group_size`` go to the layout of
    8 interleaved channels (``int4_layout.pack_channels8``, fp16 scales and offsets): groups
    of 32 where the AVX2 table is active. Its one-row product read SmolLM2's 120 projections
    of a token 1.5x faster than the per-channel rows at 2 threads (1.7x at one), with 5 bits a
    weight instead of 6. A GGUF file's blocks keep the rows and their exact fp32 scales (a
    Q4_K scale is a product that fp16 would round); AVX-512 keeps its own kernels (not
    measured there)."""
    return group_size == 32 and _w8a8_rows()


def _w8a8_rows() -> bool:
    """Whether the row-major int kernels quantize activations (the AVX2 table's W8A8, int4
    in groups of 32+): then they beat dequantize + GEMM in the activation dtype at every row
    count (measured on the 250M model's MLP shapes at 16-512 rows, 2 threads: 1.3-7x, fp32
    and bf16 activations), so they serve every batch like the tile kernels; only int4's
    prefill chunks go to torch's fp32 GEMM (``Int4Linear.dequantized_gemm_rows``)."""
    return kernels.active_isa() == "avx2"


def _tile_op(kernel: str | None, x: torch.Tensor, amx_op: _Op, vnni_op: _Op) -> _Op | None:
    """The op that reads the tile layout for ``x`` now: AMX where granted, else the VNNI
    kernels while the avx512 table is active; None (another path) otherwise."""
    if kernel == "amx" and kernels.amx_active():
        return amx_op
    if kernel in _TILES and kernels.supports(x, float32=True):
        return vnni_op if kernels.active_isa() == "avx512_bf16" else None
    return None


def kernel_layout(method: str, group_size: int) -> str:
    """How a CPU projection quantized with ``method`` is stored in this process (torch, rows,
    amx or vnni: ``sizing.QuantLayout``), for sizing memory as the engine will."""
    tiles_ok = method == "int8" or group_size % 64 == 0
    layout = _kernel_for(torch.empty(0), tiles_ok) or "torch"
    if method == "int4" and layout == "rows" and _channels8(group_size):
        return "channels8"
    return layout


def quantize_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, method: str, group_size: int
) -> QuantizedLinear:
    """A quantized projection for a weight [out, in] (and optional bias) in the model dtype."""
    if method == "int8":
        return Int8Linear(weight, bias)
    if method == "int4":
        return Int4Linear(weight, bias, group_size)
    raise ConfigError(f"--quantization {method!r} is not supported; choose one of int8, int4")
