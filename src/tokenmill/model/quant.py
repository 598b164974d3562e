"""Weight-only quantization at load time: int8 per output channel, int4 group-wise.

Kernels are torch's own (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``). Measured
on this project's 2-core AVX-512/AMX machine (8 layers of the 250M model's shapes,
docs/benchmarks.md): for one row they read int4 weights 2.5x faster than oneDNN reads
prepacked bf16 and int8 about as fast; their cost then grows with the row count (they walk
the weights again per few rows), while dequantizing the layer's weight into the activation
dtype and running the GEMM costs the same at any row count. A projection takes the int
kernel up to ``max_kernel_rows`` rows (the measured crossover: decode batches) and
dequantizes above it (prefill chunks). Activations stay in the model dtype; the int kernels
take bf16 inputs (their fp32 paths are 5x slower), so an fp32 model's activations are
rounded to bf16 for that product only. No torch kernel (inductor's max-autotune template,
``torch._int_mm``) beat oneDNN's prepacked bf16 GEMM at 16+ rows here: at decode batches of
16 the quantized models are slower than bf16 and about as fast as fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError

_INT4_LAYOUT_BLOCKS = (64, 32)
"""Output-channel block of torch's CPU int4 packing: 64 with AVX-512 kernels, 32 with AVX2."""


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int kernels run in: half as it is, fp32 rounded to bf16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class QuantizedLinear(nn.Module):
    """Common part of the int8 and int4 projections: bias, shapes, the row-count dispatch."""

    max_kernel_rows = 0
    """Rows up to which the int kernel beats dequantize + GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_gemv = True
        """Whether the int kernel may serve small batches (else dequantize + GEMM always)."""
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.max_kernel_rows and self.has_gemv:
            y = self._gemv(flat).to(x.dtype)
        else:
            y = F.linear(flat, self.dequantize(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, rebuilt from its quantized form."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """int8 weights with one scale per output channel (symmetric, absmax / 127)."""

    max_kernel_rows = 16
    """At 16 rows the kernel took 2.5 ms for 1024 -> 5632 (2 threads), dequantize + GEMM 3.6;
    at 64 rows 10.1 against 4.6."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer(
            "qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scales)  # fp32: the dequantizing path keeps full scales
        self.register_buffer("kernel_scales", scales.to(kernel_dtype(weight.dtype)))
        # torch's int8 kernel crashes or miscomputes from 2 rows on when the input width is
        # not a multiple of 16 (seen at 40 and 72 in torch 2.13); such a shape skips it.
        self.has_gemv = self.in_features % 16 == 0

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.kernel_scales
        return torch._weight_int8pack_mm(x.to(scales.dtype), self.qweight, scales)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        weight = self.qweight.to(
            dtype
        )  # two passes in ``dtype``: half the traffic of an fp32 temporary
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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.padded_in = -(-in_features // group_size) * group_size
        self.padded_out = -(-out_features // 64) * 64
        w = torch.zeros(self.padded_out, self.padded_in)
        w[:out_features, :in_features] = weight.float()
        groups = self.padded_in // group_size
        w = w.view(self.padded_out, groups, group_size)
        low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp(min=1e-8)
        q = torch.round((w - low) / scale).clamp(0, 15).to(torch.int32).view(self.padded_out, -1)
        # torch's convention: w = (q - 8) * scale + zero, so zero = low + 8 * scale.
        zero = low + 8 * scale
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scale.view(-1, groups), zero.view(-1, groups)], -1)
            .transpose(0, 1)
            .contiguous()
            .to(kernel_dtype(weight.dtype)),
        )
        self.register_buffer("offsets", (zero - 8 * scale).view(self.padded_out, groups))
        """zero - 8 * scale per group in fp32: dequantizing is then one multiply-add."""
        self.layout_block = next((b for b in _INT4_LAYOUT_BLOCKS if self._unpacks_to(b, q)), None)
        """The packing's channel block, or None if it is not one we can read: then the int4
        kernel serves every batch size (slower for large ones, still correct)."""
        if self.layout_block is None:
            self.max_kernel_rows = torch.iinfo(torch.int64).max

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

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(
            self._pad(x).to(self.scales_and_zeros.dtype),
            self.packed,
            self.group_size,
            self.scales_and_zeros,
        )
        return y[:, : self.out_features]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.layout_block is not None
        out = self._unpack(self.layout_block, dtype)
        groups = out.view(self.padded_out, -1, self.group_size)
        scale = self.scales_and_zeros[..., 0].t().unsqueeze(-1).to(dtype)
        offset = self.offsets.unsqueeze(-1).to(dtype)
        groups.mul_(scale).add_(offset)
        return out[: self.out_features, : self.in_features]


def quantize_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, method: str, group_size: int
) -> QuantizedLinear:
    """A quantized projection for a weight [out, in] (and optional bias) in the model dtype."""
    if method == "int8":
        return Int8Linear(weight, bias)
    if method == "int4":
        return Int4Linear(weight, bias, group_size)
    raise ConfigError(f"--quantization {method!r} is not supported; choose one of int8, int4")
