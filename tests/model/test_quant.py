"""int8/int4 projections: what they store, and that every kernel path computes it, with
tokenmill's CPU kernels (AMX tiles or rows, W8A8 on AVX-512) and with torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.model.quant import Int4Linear, Int8Linear, int8_channels, quantize_linear


@pytest.fixture(params=["tokenmill", "torch"], autouse=True)
def kernel_path(request: pytest.FixtureRequest):
    """Layers built with tokenmill's kernels (where they built) or with torch's only."""
    if request.param == "tokenmill" and not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")
    kernels.set_enabled(request.param == "tokenmill")
    yield request.param
    kernels.set_enabled(True)


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rounds_each_weight_to_the_nearest_step_of_its_channel(dtype: torch.dtype) -> None:
    weight = _weight(48, 64).to(dtype)
    linear = Int8Linear(weight, None)
    step = weight.float().abs().amax(dim=1) / 127
    error = (linear.dequantize(torch.float32) - weight.float()).abs()
    assert linear.int_weight().dtype == torch.int8
    assert (error <= step[:, None] * 0.5 + 1e-2 * step[:, None] + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_fits_each_group_with_less_error_than_min_max(group_size: int) -> None:
    """Each group's scale and offset are fitted (``_fitted_groups``): the layer's weight has
    less squared error than min-max's half-step rounding gives, and no weight is further than
    one min-max step (what a clipped outlier may lose) plus the stored parameters' rounding."""
    weight = _weight(64, 256)
    linear = Int4Linear(weight, None, group_size)
    groups = weight.view(64, -1, group_size)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    min_max = torch.round((groups - low) / step) * step + low - groups
    error = (linear.dequantize(torch.float32) - weight).view(64, -1, group_size)
    assert error.pow(2).sum() < 0.95 * min_max.pow(2).sum()
    assert (error.abs() <= step + 0.02 * groups.abs().amax(-1, keepdim=True)).all()
    stored = linear.amx_tiles if linear.kernel in ("amx", "vnni") else linear.packed
    assert stored.numel() == 64 * 256 // 2  # two weights a byte, no second copy


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
    # the int kernels take bf16 activations (tokenmill's on AVX-512: int8 per row): allow
    # their rounding of x, relative to |x||w|
    scale = x.abs().amax() * weight.abs().amax() * in_features**0.5
    assert (got - want).abs().max() <= 2e-2 * scale


def test_the_int4_packing_is_read_in_place_on_this_cpu(kernel_path: str) -> None:
    """The dequantizing path reads torch's packed layout (64-channel blocks with AVX-512,
    32 with AVX2); if a torch release changed it, every batch would fall back to the slow
    int kernel, so this fails loudly instead."""
    if kernel_path == "tokenmill":
        pytest.skip("tokenmill's layouts are checked in tests/kernels")
    assert Int4Linear(_weight(128, 64), None, 32).layout_block in (64, 32)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_projection_stores_one_copy_in_its_kernels_layout(kernel_path: str, method: str) -> None:
    linear = quantize_linear(_weight(48, 128), None, method, 64)
    if kernel_path == "torch":
        assert linear.kernel is None
        return
    tiles = "amx" if kernels.amx_active() else "vnni"
    assert linear.kernel == (tiles if kernels.active_isa().startswith("avx512_bf16") else "rows")
    int_bytes = sum(b.numel() for b in linear.buffers() if b.dtype in (torch.int8, torch.uint8))
    per_weight = 1 if method == "int8" else 0.5
    padded = (-(-48 // 16) * 16 if linear.kernel != "rows" else 48) * 128
    assert int_bytes == padded * per_weight


@pytest.fixture(params=["avx512", "avx2"])
def isa(request: pytest.FixtureRequest, kernel_path: str):
    """Layers built (and run) on one kernel table; skipped where the CPU lacks it."""
    if kernel_path == "torch":
        pytest.skip("the kernel tables are tokenmill's")
    before = kernels.active_isa()
    try:
        chosen = kernels.set_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    yield chosen
    kernels.set_isa("avx2" if before == "avx2" else "avx512" if before == "avx512_bf16" else "auto")


@pytest.mark.parametrize("method,group_size", [("int8", 128), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 65, 130])
def test_each_table_stores_its_layout_and_computes_the_weight(
    isa: str, method: str, group_size: int, rows: int
) -> None:
    """AVX-512 without AMX stores AMX tiles for the VNNI kernels and serves every row count
    with them; AVX2 stores rows. Both compute the stored weight, and a layer whose table was
    switched after load (tests) still does, through dequantize + GEMM."""
    weight, bias = _weight(100, 200), torch.randn(100)
    linear = quantize_linear(weight.bfloat16(), bias.bfloat16(), method, group_size)
    tiles = "amx" if kernels.amx_active() else "vnni"
    assert linear.kernel == (tiles if isa == "avx512_bf16" else "rows")
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = F.linear(x.float(), linear.dequantize(torch.float32), bias.bfloat16().float())
    scale = x.float().abs().amax() * weight.abs().amax() * 200**0.5
    assert (linear(x).float() - want).abs().max() <= 2e-2 * scale
    # bf16 [rows, in] goes straight to the op, bias and all; [1, rows, in] takes the general path
    assert linear._fast is not None
    general = linear(x[None])[0].float()
    assert (linear(x).float() - general).abs().max() <= 1e-2 * scale
    try:
        kernels.set_isa("avx2" if isa == "avx512_bf16" else "avx512")
    except RuntimeError:
        return  # an AVX2-only CPU
    assert (linear(x).float() - want).abs().max() <= 2e-2 * scale


def test_unknown_method_names_the_flag() -> None:
    with pytest.raises(Exception, match="--quantization 'int3'"):
        quantize_linear(_weight(16, 32), None, "int3", 32)


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 300, 1000])
def test_int8_channels_of_chunked_rows_equal_the_whole_weight_bit_for_bit(
    rows_per_chunk: int,
) -> None:
    """A GGUF tensor is requantized a chunk of rows at a time: each channel's scale is its own
    row's, so no chunking changes a code, a scale or a row sum."""
    weight = torch.randn(1000, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight[3] = 0  # an all-zero channel keeps its floor scale
    chunks = [weight[lo : lo + rows_per_chunk] for lo in range(0, 1000, rows_per_chunk)]
    w = weight.float()  # the whole-tensor formula, all rows at once
    want_scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    want_codes = torch.round(w / want_scales[:, None]).clamp(-127, 127).to(torch.int8)
    codes, scales = int8_channels(chunks, (1000, 96))
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)
    whole = Int8Linear(weight, None)
    assert torch.equal(whole.int_weight(), want_codes)
    if whole.kernel == "rows":
        assert torch.equal(whole.row_sums, want_codes.sum(1, dtype=torch.int32))
    given = Int8Linear(
        torch.empty((), dtype=torch.bfloat16).expand(1000, 96), None, channels=(codes, scales)
    )
    for name, buffer in whole.named_buffers():
        assert torch.equal(buffer, getattr(given, name)), name
    with pytest.raises(ValueError, match="999 rows of 1000"):
        int8_channels(chunks[:-1] + [chunks[-1][:-1]], (1000, 96))
