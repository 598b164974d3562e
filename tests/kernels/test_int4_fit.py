"""The int4 group fit at load: the C++ op (``quantize_int4_groups``) against its torch
reference (``quant_int4._fitted_groups``), and both against min-max quantization, which
they must never do worse than."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import randn
from tokenmill import kernels
from tokenmill.model.quant_int4 import _FIT_ROUNDS, _FITTED_LEVELS, _fitted_groups


def _min_max_error(groups: torch.Tensor, half: bool) -> torch.Tensor:
    """Each group's squared error under min-max, its parameters rounded as the fit's are."""
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    if half:
        step, low = step.half().float(), low.half().float()
    step = step.clamp(min=1e-8)
    codes = torch.round((groups - low) / step).clamp(0, 15)
    return (codes * step + low - groups).pow(2).sum(-1)


def _error(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    return (codes.view_as(groups).float() * scale + low - groups).pow(2).sum(-1)


def _weight(rows: int, cols: int, group_size: int) -> torch.Tensor:
    """Random rows with the groups that test the edges: constant, all zero, one outlier, two
    values only."""
    w = randn(rows, cols, seed=3) * 0.05
    w[0, :group_size] = 0.25  # constant: one distinct code, no fit
    if rows > 1:
        w[1, :group_size] = 0.0
    if rows > 2:
        w[2, 3] = 4.0  # an outlier the clipping grid may give up
    if rows > 3:
        w[3, :group_size] = torch.tensor([-1.0, 1.0]).repeat(group_size // 2)
    return w


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("group_size", [8, 32, 128])
@pytest.mark.parametrize("half", [False, True])
def test_the_op_fits_as_the_torch_reference(
    threads: int, rows: int, group_size: int, half: bool
) -> None:
    """Same squared error per group (sums in another order: a few ulps), the same codes and
    parameters in nearly every group, never worse than min-max; the same bits on 1 and 2
    threads."""
    w = _weight(rows, 2 * 128, group_size)
    groups = w.view(rows, -1, group_size)
    codes, scale, low = kernels.quantize_int4_groups(
        w, group_size, half, _FITTED_LEVELS, _FIT_ROUNDS
    )
    assert codes.dtype == torch.int32 and codes.shape == w.shape
    assert scale.shape == low.shape == (rows, w.shape[1] // group_size, 1)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    want_codes, want_scale, want_low = _fitted_groups(groups, half)
    got, want = _error(codes, scale, low, groups), _error(want_codes, want_scale, want_low, groups)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)
    assert (got <= _min_max_error(groups, half) * (1 + 1e-5) + 1e-12).all()
    if half:  # fp16 parameters leave the sums' order no say in nearly every group
        same = (
            (codes.view_as(groups) == want_codes.int()).all(-1)
            & (scale == want_scale).squeeze(-1)
            & (low == want_low).squeeze(-1)
        )
        assert same.float().mean() >= 0.99
        stored = scale > 1e-8  # not a constant group's floor; the layout stores both in fp16
        assert torch.equal(scale.half().float()[stored], scale[stored])
        assert torch.equal(low.half().float(), low)
    torch.set_num_threads(3 - threads)
    again = kernels.quantize_int4_groups(w, group_size, half, _FITTED_LEVELS, _FIT_ROUNDS)
    assert all(torch.equal(a, b) for a, b in zip(again, (codes, scale, low), strict=True))


def test_the_fit_beats_min_max_on_gaussian_weights() -> None:
    """The point of the fit: less squared error overall than min-max (Gemma 3's projections:
    0.72x), from the reference and the op alike."""
    w = randn(256, 512, seed=5)
    groups = w.view(256, -1, 32)
    min_max = _min_max_error(groups, True).sum()
    reference = _error(*_fitted_groups(groups, True), groups).sum()
    op = _error(
        *kernels.quantize_int4_groups(w, 32, True, _FITTED_LEVELS, _FIT_ROUNDS), groups
    ).sum()
    assert reference < 0.9 * min_max and op < 0.9 * min_max


def test_the_op_refuses_groups_it_cannot_vectorize() -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.quantize_int4_groups(torch.zeros(2, 36), 12, True, _FITTED_LEVELS, _FIT_ROUNDS)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quantize_int4_groups(torch.zeros(2, 64, dtype=torch.bfloat16), 32, True, (15.0,), 1)
