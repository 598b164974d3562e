"""Quantization at load time: int8 per output channel, int4 group-wise.

With tokenmill's CPU kernels (``tokenmill/kernels``) a projection stores its weights in the
layout its kernel reads, once: AMX-INT8 tiles (16 channels x 64 inputs in VNNI order,
``kernels/amx_layout.py``) wherever the AVX-512 table runs, read by AMX where the process
may use it and by AVX-512 VNNI dot products otherwise (``kernel`` ``amx`` or ``vnni``); plain
rows for the AVX2 kernels (and int4 groups of 32). Both tables quantize activations to int8
(W8A8 dynamic, llama.cpp Q8_0's trade): int8 per row and group of 64 inputs (rows and tiles,
both tables), int4 per row, except groups of 32 (per group of 32; weight-only on AVX-512). The torch paths
below remain for machines without the extension.

The tile kernels beat oneDNN's bf16 GEMM at every row count measured (1-256 rows of the
250M model's layers, ``benchmarks/int_gemm_ab.py``), and so do the AVX2 W8A8 row kernels
against dequantize + GEMM (``quant_base.w8a8_rows``), so they serve every batch; the weight-only row
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

from collections.abc import Iterable

import torch

from tokenmill import kernels
from tokenmill.errors import ConfigError
from tokenmill.kernels import amx_layout
from tokenmill.model.quant_base import (
    EVERY_BATCH,
    QUANTIZE_ROWS,
    TILES,
    Op,
    QuantizedLinear,
    kernel_dtype,
    kernel_for,
    tile_kernel_op,
    w8a8_rows,
)
from tokenmill.model.quant_int4 import Int4Linear, channels8

__all__ = [
    "Int4Linear",
    "Int8Linear",
    "QuantizedLinear",
    "int8_channels",
    "kernel_dtype",
    "kernel_layout",
    "quantize_linear",
]


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
        for lo in range(0, chunk.shape[0], QUANTIZE_ROWS):
            w = chunk[lo : lo + QUANTIZE_ROWS].float()
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
    for lo in range(0, qweight.shape[0], QUANTIZE_ROWS):
        sums[lo : lo + QUANTIZE_ROWS] = qweight[lo : lo + QUANTIZE_ROWS].sum(1, dtype=torch.int32)
    return sums


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
        """``tiles_ok=False`` keeps the row layout on every ISA. Both layouts' kernels also
        write fp32 outputs (``forward_float32``, an LM head's logits). ``channels``: codes [out, in] and
        scales [out] already quantized (``int8_channels`` over a GGUF tensor's rows), the
        codes given up (the tiles may be written over them); ``weight`` then only gives
        the shape, dtype and device."""
        super().__init__(weight.shape[1], weight.shape[0], bias)
        qweight, scales = channels or int8_channels((weight,), (weight.shape[0], weight.shape[1]))
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)  # fp32: the dequantizing path keeps full scales
        self.kernel = kernel_for(weight, tiles_ok=tiles_ok)
        if self.kernel is not None:
            row_sums = _int8_row_sums(qweight)
            if self.kernel in TILES:
                # over qweight where no padding is needed: it is dropped below (and callers'
                # ``channels`` are built for this projection alone)
                self.register_buffer("amx_tiles", amx_layout.pack_int8(qweight, reuse_storage=True))
                self.register_buffer("amx_scales", amx_layout.block_channels(scales))
                self.register_buffer("amx_row_sums", amx_layout.block_channels(row_sums))
                self.qweight = None  # the tiles are the only copy
                self.max_kernel_rows = EVERY_BATCH  # beats bf16 GEMMs
            else:
                self.register_buffer("row_sums", row_sums)
                if w8a8_rows():
                    self.max_kernel_rows = EVERY_BATCH
            self._refresh_fast_path()
            return
        self.register_buffer("kernel_scales", scales.to(kernel_dtype(weight.dtype)))
        # torch's int8 kernel crashes or miscomputes from 2 rows on when the input width is
        # not a multiple of 16 (seen at 40 and 72 in torch 2.13); such a shape skips it.
        self.has_gemv = self.in_features % 16 == 0

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None, f32_out: bool = False
    ) -> tuple[Op, tuple[object, ...]] | None:
        """``f32_out``: the ops that write fp32 outputs unrounded (``forward_float32``)."""
        if f32_out:
            amx_op, vnni_op = kernels.linear_int8_amx_f32out, kernels.linear_int8_vnni_f32out
            rows_op = kernels.linear_int8_f32out
        else:
            amx_op, vnni_op, rows_op = (
                kernels.linear_int8_amx,
                kernels.linear_int8_vnni,
                kernels.linear_int8,
            )
        tile_op = tile_kernel_op(self.kernel, x, amx_op, vnni_op)
        if tile_op is not None:
            tiles = (self.amx_tiles, self.amx_scales, self.amx_row_sums)
            return tile_op, (*tiles, bias, self.out_features)
        if self.kernel == "rows" and kernels.supports(x, float32=True):
            return rows_op, (self.int_weight(), self.scales, self.row_sums, bias)
        return None

    dequantized_gemm_rows = 512
    """As ``Int4Linear.dequantized_gemm_rows``, for the AVX2 W8A8 rows: on the AVX2 EPYC at 2
    threads (SmolLM2's and the 250M model's projections) dequantize + fp32 GEMM took 0.69-1.04x
    the kernel's time at 64 rows, 1.0-1.2x at 256 and 1.18-1.26x at 512 (i.e. faster from
    512 on) and 1.3-1.7x faster at 2048. Above the default ``--max-num-seqs``, so decode
    steps stay on the kernel."""

    def _dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.kernel != "rows":
            return None
        return self.int_weight().float().mul_(self.scales[:, None]).to(dtype)

    lookup_dtype: torch.dtype = torch.bfloat16
    """The dtype ``embedding`` returns rows in (a tied head's model dtype)."""

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized: a tied LM head is also the embedding
        table, so the model keeps no second copy of it (in the tile layout the rows are
        gathered from the tiles, never the whole weight)."""
        if self.qweight is not None:
            codes = self.qweight[ids]
        else:
            codes = amx_layout.int8_rows(self.amx_tiles, ids, self.in_features)
        rows = codes.float() * self.scales[ids].unsqueeze(-1)
        return rows.to(self.lookup_dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        call = self._kernel_call(flat, self.bias, f32_out=True)
        if call is None:
            return super().forward_float32(x)
        op, args = call
        return op(flat.to(torch.bfloat16), *args).view(*x.shape[:-1], self.out_features)

    def _torch_gemv(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.kernel_scales
        return torch._weight_int8pack_mm(x.to(scales.dtype), self.int_weight(), scales)

    def int_weight(self) -> torch.Tensor:
        """The int8 weight [out, in], from whichever layout holds it."""
        if self.qweight is not None:
            return self.qweight
        return amx_layout.unpack_int8(self.amx_tiles, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # two passes in ``dtype``: half the traffic of an fp32 temporary
        weight = self.int_weight().to(dtype)
        return weight.mul_(self.scales.to(dtype)[:, None])


def kernel_layout(method: str, group_size: int) -> str:
    """How a CPU projection quantized with ``method`` is stored in this process (torch, rows,
    amx or vnni: ``sizing.QuantLayout``), for sizing memory as the engine will."""
    tiles_ok = method == "int8" or group_size % 64 == 0
    layout = kernel_for(torch.empty(0), tiles_ok) or "torch"
    if method == "int4" and layout == "rows" and channels8(group_size):
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
