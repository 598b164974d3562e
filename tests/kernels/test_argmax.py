"""The greedy sampler's argmax kernel against torch.argmax: the same index for every row,
ties to the first, chunk boundaries and tails, NaN and infinities left to torch, both ISAs,
one and two threads."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import randn
from tokenmill import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")

CHUNK = 4096  # ops_sampling.cpp's chunk of a row
PARALLEL_FLOATS = 1 << 21  # and the batch size from which its chunks split across threads


@pytest.mark.parametrize(
    ("rows", "cols"),
    [
        (1, 1),
        (1, 7),
        (3, 33),
        (16, CHUNK),
        (5, CHUNK + 1),
        (16, 49152),
        (2, 262144),
        (4, 3 * CHUNK - 5),
    ],
)
def test_argmax_matches_torch(isa, threads, rows, cols) -> None:
    logits = randn(rows, cols, seed=rows * 31 + cols) * 4
    got = kernels.argmax(logits)
    assert got.dtype == torch.long and got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("cols", [3 * CHUNK + 10, PARALLEL_FLOATS // 4 + 10])
def test_ties_go_to_the_first_index_across_chunks(isa, threads, cols) -> None:
    """The maximum repeated within a chunk and in later chunks: torch's first, on one thread
    and split across threads."""
    logits = torch.full((4, cols), -1.0)
    logits[0, [5, 9, CHUNK + 3]] = 2.0
    logits[1, [CHUNK + 7, 2 * CHUNK + 1, 3 * CHUNK + 9]] = 2.0
    logits[2, [3 * CHUNK + 2, 3 * CHUNK + 9]] = 2.0
    logits[3] = -7.5  # every value equal
    assert kernels.argmax(logits).tolist() == [5, CHUNK + 7, 3 * CHUNK + 2, 0]


def test_all_negative_and_extreme_finite_values(isa) -> None:
    logits = torch.tensor(
        [[-3.0e38, -3.4028235e38, -1.0e30], [-3.4028235e38, -3.4028235e38, -3.4028235e38]]
    )
    assert kernels.argmax(logits).tolist() == [2, 0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_give_torchs_answer(isa, bad) -> None:
    """A banned token (-inf, a grammar's mask) or a NaN anywhere: the batch goes to torch."""
    logits = randn(3, 2 * CHUNK + 5, seed=1)
    logits[1, CHUNK + 2] = bad
    logits[2, 7] = bad
    assert kernels.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_strided_rows_and_other_dtypes(isa) -> None:
    """Rows of a wider buffer (the head's padded logits) in place; bf16 and a column view
    (not contiguous along the vocabulary) go to torch."""
    wide = randn(6, 1000, seed=2)
    view = wide[:, :900]
    assert kernels.argmax(view).tolist() == view.argmax(dim=-1).tolist()
    half = wide.to(torch.bfloat16)
    assert kernels.argmax(half).tolist() == half.argmax(dim=-1).tolist()
    columns = wide.t()
    assert kernels.argmax(columns).tolist() == columns.argmax(dim=-1).tolist()


def test_the_op_refuses_what_it_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.tokenmill_cpu.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.tokenmill_cpu.argmax_rows(torch.zeros(2, 0))
