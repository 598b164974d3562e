"""top-k / top-p from the candidates: the same logits as the full sort for every row, and
the full sort only for the rows the candidates cannot settle."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sampling import nucleus
from tokenmill.sampling.nucleus import CANDIDATES, apply_top_k_top_p, top_k_top_p_sorted

VOCAB = 3000

ROWS = [  # (top_k, top_p, temperature-like scale of the logits)
    (0, 1.0, 4.0),  # nothing filters
    (5, 1.0, 4.0),
    (64, 1.0, 1.0),
    (0, 0.5, 4.0),
    (0, 0.9, 4.0),
    (0, 0.95, 6.0),
    (40, 0.8, 2.0),
    (CANDIDATES + 50, 1.0, 4.0),  # top-k past the candidates: the full sort
    (0, 0.9, 0.05),  # a flat row: the nucleus is wider than the candidates
    (VOCAB, 0.9, 4.0),  # top-k of the whole vocabulary is no top-k
]


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randn(VOCAB, generator=gen) * scale for _, _, scale in ROWS])
    top_k = torch.tensor([k for k, _, _ in ROWS])
    top_p = torch.tensor([p for _, p, _ in ROWS], dtype=torch.float32)
    return logits, top_k, top_p


@pytest.mark.parametrize("seed", range(5))
def test_candidates_give_the_full_sorts_logits(seed: int) -> None:
    logits, top_k, top_p = _case(seed)
    logits[3, 7] = float("-inf")  # a ban stays a ban
    got, want = apply_top_k_top_p(logits, top_k, top_p), top_k_top_p_sorted(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)
    kept = (~torch.isinf(got)).sum(-1).tolist()
    assert kept[0] == VOCAB and kept[1] == 5 and kept[2] == 64 and kept[7] == CANDIDATES + 50
    assert all(1 <= kept[i] < CANDIDATES for i in (3, 4, 5, 6)) and kept[8] > CANDIDATES


def test_ties_with_the_kth_value_are_kept_past_the_candidates() -> None:
    logits = torch.randn(1, VOCAB) * 0.01
    logits[0, : CANDIDATES + 10] = 5.0  # the k-th value ties with more than CANDIDATES tokens
    top_k, top_p = torch.tensor([3]), torch.tensor([1.0])
    got = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, top_k_top_p_sorted(logits, top_k, top_p))
    assert int((~torch.isinf(got)).sum()) == CANDIDATES + 10


def test_settled_rows_skip_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaked rows with Gemma 3's defaults (top-k 64, top-p 0.95) and a top-p alone never
    reach the sort; the flat row does (only that row)."""
    sorted_rows: list[int] = []

    def spy(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(len(logits))
        return top_k_top_p_sorted(logits, top_k, top_p)

    monkeypatch.setattr(nucleus, "top_k_top_p_sorted", spy)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen) * torch.tensor([[4.0], [4.0], [0.05]])
    apply_top_k_top_p(logits[:2], torch.tensor([64, 0]), torch.tensor([0.95, 0.9]))
    assert sorted_rows == []
    apply_top_k_top_p(logits, torch.tensor([64, 0, 0]), torch.tensor([0.95, 0.9, 0.9]))
    assert sorted_rows == [1]
