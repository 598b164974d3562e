"""How the int8 row kernels quantize their activations: per group of
``kernels.int8_activation_group()`` inputs on the AVX2 table, per row on AVX-512, checked
against a torch copy of the quantizer (both ISAs, one and two threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import generator, randn
from tokenmill import kernels


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
    assert group == (64 if isa == "avx2" else 0)
    got = kernels.linear_int8(x, q, scales, q.sum(1, dtype=torch.int32), None).float()
    want = F.linear(_int8_rows(x, group), w)
    other = F.linear(_int8_rows(x, 64 if group == 0 else 0), w)
    tol = want.abs() * 2**-8 + 1e-3 * F.linear(x.float().abs(), w.abs())
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() - tol).max().item()
    assert ((other - want).abs() > 4 * tol).any()  # the test can tell the two apart
