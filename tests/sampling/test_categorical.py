"""The two-level inverse-CDF draw: the same index as one float64 cumulative sum over the row,
across block boundaries and padding, and never an entry of zero mass."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling.categorical import BLOCK, categorical


def _reference(weights: torch.Tensor, u: float) -> int:
    cdf = weights.to(torch.float64).cumsum(0)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    return int(torch.searchsorted(cdf, target, right=True)[0])


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(0, 15), min_size=1, max_size=3 * BLOCK + 17).filter(any),
    uniforms=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=8),
)
def test_matches_one_float64_cumulative_sum(weights: list[int], uniforms: list[float]) -> None:
    """Integer weights sum exactly in float32 and float64, so both levels see the reference's
    boundaries exactly: the index must be the reference's for every uniform."""
    row = torch.tensor(weights, dtype=torch.float32)
    probs = row.expand(len(uniforms), -1)
    got = categorical(probs, torch.tensor(uniforms, dtype=torch.float64)).tolist()
    assert got == [_reference(row, u) for u in uniforms]
    assert all(weights[i] > 0 for i in got)


def test_edge_uniforms_land_on_the_first_and_last_entries_with_mass() -> None:
    probs = torch.zeros(2, 3 * BLOCK + 5)
    probs[:, [3, BLOCK - 1, BLOCK, 2 * BLOCK + 7]] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0))
    got = categorical(probs, torch.stack([torch.tensor(0.0, dtype=torch.float64), below_one]))
    assert got.tolist() == [3, 2 * BLOCK + 7]


def test_frequencies_follow_the_probabilities_across_blocks() -> None:
    """Mass on both sides of block boundaries and in the padded last block; 40k draws."""
    vocab = 3 * BLOCK - 100
    probs = torch.zeros(vocab)
    where = [0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, vocab - 1]
    probs[where] = torch.tensor([0.3, 0.1, 0.2, 0.05, 0.15, 0.2])
    n = 40_000
    draws = categorical(
        probs.expand(n, -1),
        torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
    )
    freq = torch.bincount(draws, minlength=vocab).float() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(where)
    assert torch.allclose(freq[where], probs[where], atol=0.012), freq[where]


def test_unnormalised_rows_and_a_single_entry() -> None:
    probs = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    got = categorical(probs, torch.tensor([0.74, 0.99], dtype=torch.float64))
    assert got.tolist() == [1, 0]  # 0.74 * 4 = 2.96 < 3: entry 1
