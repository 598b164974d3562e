"""Weight-only int8/int4 projections: what they store, and that both kernel paths compute it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.quant import Int4Linear, Int8Linear, quantize_linear


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rounds_each_weight_to_the_nearest_step_of_its_channel(dtype: torch.dtype) -> None:
    weight = _weight(48, 64).to(dtype)
    linear = Int8Linear(weight, None)
    step = weight.float().abs().amax(dim=1) / 127
    error = (linear.dequantize(torch.float32) - weight.float()).abs()
    assert linear.qweight.dtype == torch.int8
    assert (error <= step[:, None] * 0.5 + 1e-2 * step[:, None] + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_rounds_each_weight_within_half_a_step_of_its_group(group_size: int) -> None:
    weight = _weight(64, 256)
    linear = Int4Linear(weight, None, group_size)
    groups = weight.view(64, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (linear.dequantize(torch.float32) - weight).abs().view(64, -1, group_size)
    # half a step, plus bf16 rounding of the scale and zero point
    assert (error <= step.unsqueeze(-1) * 0.5 + 0.02 * groups.abs().amax(-1, keepdim=True)).all()
    assert linear.packed.numel() == 64 * 256 // 2  # two weights a byte, no second copy


@pytest.mark.parametrize("out_features,in_features", [(64, 128), (100, 688), (16, 40)])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 65])
def test_both_kernel_paths_compute_the_stored_weight(
    method: str, out_features: int, in_features: int, rows: int
) -> None:
    """Few rows take the int kernel, more take dequantize + GEMM (int8 switches above 16
    rows, int4 above 64); shapes the int4 kernel
    cannot take (688 inputs, 100 outputs) are zero-padded without changing the result."""
    weight = _weight(out_features, in_features)
    bias = torch.randn(out_features)
    linear = quantize_linear(weight, bias, method, 32)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    got = linear(x)
    want = F.linear(x, linear.dequantize(torch.float32), bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # the int kernels take bf16 activations: allow bf16 rounding of x, relative to |x||w|
    scale = x.abs().amax() * weight.abs().amax() * in_features**0.5
    assert (got - want).abs().max() <= 2e-2 * scale


def test_the_int4_packing_is_read_in_place_on_this_cpu() -> None:
    """The dequantizing path reads torch's packed layout (64-channel blocks with AVX-512,
    32 with AVX2); if a torch release changed it, every batch would fall back to the slow
    int kernel, so this fails loudly instead."""
    assert Int4Linear(_weight(128, 64), None, 32).layout_block in (64, 32)


def test_unknown_method_names_the_flag() -> None:
    with pytest.raises(Exception, match="--quantization 'int3'"):
        quantize_linear(_weight(16, 32), None, "int3", 32)
