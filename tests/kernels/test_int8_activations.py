"""How the int8 kernels quantize their activations: per row and group of
``kernels.int8_activation_group()`` (64) inputs, on both tables and the AVX-512 tile kernels,
checked against a torch copy of the quantizer (both ISAs, one and two threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import generator, randn
from tokenmill import kernels
from tokenmill.kernels import ops as kernels_ops


def _int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantized to int8 and back as the kernels' quantizer does: scale max |x| / 127 per
    row (group 0) or per group of ``group`` inputs, values x * (1 / scale) rounded to even."""
    m, k = x.shape
    span = group or k
    xf = F.pad(x.float(), (0, -k % span)).view(m, -1, span)
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(xf * (1 / scale)).clamp(-128, 127)
    return (q * scale).view(m, -1)[:, :k]


@pytest.mark.parametrize(("m", "k"), [(1, 1000), (2, 1000), (5, 200), (4, 192), (3, 576)])
def test_linear_int8_quantizes_x_as_the_table_says(isa: str, threads: int, m: int, k: int) -> None:
    """The int8 rows' products are those of x quantized per group of
    ``int8_activation_group()`` inputs (64 on AVX2) or per row (0), up to fp32 summation order
    and the bf16 output. With a 1000x outlier, per row and per group differ by far more than
    that (one scale a row leaves the other values a few levels), so this tells them apart."""
    n = 7
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.02 + 1e-3
    x = randn(m, k, dtype=torch.bfloat16)
    x[:, 5] = 1000.0  # an outlier channel, as trained models have
    x[0, 64:128] = 0  # a group of zeros
    w = q.float() * scales[:, None]
    group = kernels.int8_activation_group()
    assert group == 64
    got = kernels.linear_int8(x, q, scales, q.sum(1, dtype=torch.int32), None).float()
    _assert_quantized_per_group(got, x, w, group)


@pytest.mark.parametrize(("m", "k"), [(1, 1000), (5, 200), (17, 576)])
@pytest.mark.parametrize("tiles", ["vnni", "amx"])
def test_the_int8_tiles_quantize_x_per_chunk_of_64(isa: str, m: int, k: int, tiles: str) -> None:
    """The AVX-512 tile kernels (the layout int8 projections are stored in there) quantize x
    per row and 64-input chunk too, on VNNI and on AMX."""
    from tokenmill.kernels import amx_layout

    if isa != "avx512":
        pytest.skip("the tile ops run on the avx512 table")
    if tiles == "amx" and not kernels_ops.amx_permitted():
        pytest.skip("AMX is not granted here")
    n = 37
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.02 + 1e-3
    x = randn(m, k, dtype=torch.bfloat16)
    x[:, 5] = 1000.0
    x[0, 64:128] = 0
    block = amx_layout.block_channels
    args = (x, amx_layout.pack_int8(q), block(scales), block(q.sum(1, dtype=torch.int32)), None, n)
    if tiles == "amx":
        kernels.set_isa("amx")
        try:
            got = kernels.linear_int8_amx(*args).float()
        finally:
            kernels.set_isa("avx512")
    else:
        got = kernels.linear_int8_vnni(*args).float()
    _assert_quantized_per_group(got, x, q.float() * scales[:, None], 64)


def _assert_quantized_per_group(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group: int
) -> None:
    want = F.linear(_int8_rows(x, group), w)
    other = F.linear(_int8_rows(x, 64 if group == 0 else 0), w)
    tol = want.abs() * 2**-8 + 1e-3 * F.linear(x.float().abs(), w.abs())
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() - tol).max().item()
    assert ((other - want).abs() > 4 * tol).any()  # the test can tell the two apart
