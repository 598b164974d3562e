"""LM-head products with fp32 output: the sums the bf16 kernels accumulate, returned without
rounding to bf16. Rounding a head's logits to bf16 (8 bits of mantissa) made SmolLM2's two
best first tokens tie, and greedy then took the lower token id: a wrong answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import SHAPES, randn
from tokenmill import kernels
from tokenmill.kernels import gemv_layout
from tokenmill.model.layers import Linear


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 within accumulation-order error, far inside bf16's rounding step."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize(("m", "n", "k"), [*SHAPES, (1, 1000, 576), (3, 37, 640)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_out_gemv_and_row_major_linear(
    isa: str, threads: int, m: int, n: int, k: int, with_bias: bool
) -> None:
    x, w = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2) if with_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    _close(kernels.gemv_bf16_f32out(x, gemv_layout.pack(w), n, bias), want)
    _close(kernels.linear_bf16_f32out(x, w, bias), want)
    # The bf16-out ops are the same sums rounded: bit-identical to rounding these.
    rounded = kernels.gemv_bf16(x, gemv_layout.pack(w), n, bias)
    assert torch.equal(
        rounded, kernels.gemv_bf16_f32out(x, gemv_layout.pack(w), n, bias).bfloat16()
    )


def test_a_tied_head_keeps_close_logits_apart(isa: str) -> None:
    """A head reading the embedding's bf16 rows in place (a tied head) returns fp32 logits
    that keep two candidates 1/64 apart distinct; bf16 logits near 20 round both together."""
    hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
    hidden[0, 0] = 1.0
    embed = torch.zeros(2, 64, dtype=torch.bfloat16)
    embed[0, 0], embed[1, 0] = 20.0, 20.0
    embed[1, 1], hidden[0, 1] = 1.0, 1 / 64  # token 1 scores 20 + 1/64
    head = Linear(64, 2)
    head.weight = torch.nn.Parameter(embed, requires_grad=False)
    logits = head.forward_float32(hidden)
    assert logits.dtype == torch.float32 and int(logits.argmax()) == 1
    assert float(logits[0, 1] - logits[0, 0]) == pytest.approx(1 / 64)
    assert head(hidden).float()[0, 0] == head(hidden).float()[0, 1]  # bf16 out: a tie
