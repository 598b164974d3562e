"""One draw per row from a categorical distribution, by the inverse CDF in two levels.

The sampler drew by the exponential race (argmax of p / E, E ~ Exp(1)), which needs one
exponential variate per vocabulary entry: torch makes those one at a time on a CPU, 1.1 ms a
row for SmolLM2's 49,152 tokens and 6 ms for Gemma 3's 262,144, so sixteen sampled Gemma
streams spent ~99 ms a step on noise alone, as long as the model's own step. The inverse CDF
needs one uniform variate a row: the row is cut into blocks of ``BLOCK`` entries, the block is
found on the cumulative block sums (float64), then the entry on the cumulative sum of that
block alone (float64). A single float32 cumulative sum over the whole row would round each
entry's share to float32's spacing near 1 (6e-8), distorting the many tiny probabilities of a
large vocabulary; the two levels keep every entry's share to a float32 block sum's relative
error (~1e-7 of its block's mass). An entry of zero mass (masked by top-k, top-p, min-p or a
grammar) is never drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 1024
"""Entries per block: the second level reads one block per row (a 262,144-entry row is 256
blocks)."""


def categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of ``probs`` [B, V] (non-negative, any positive total), the index drawn
    with its uniform variate in [0, 1) from ``uniforms`` [B] (float64 for the full
    resolution): the first index whose cumulative mass exceeds ``u * total``."""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // BLOCK)
    if num_blocks * BLOCK != vocab:
        probs = F.pad(probs, (0, num_blocks * BLOCK - vocab))
    blocks = probs.reshape(rows, num_blocks, BLOCK)
    # float32 sums within a block, float64 across them: no whole-row float64 copy (a fresh
    # 33 MB buffer a step at 16 x 262,144 cost more in page faults than the draw itself)
    block_cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)
    target = uniforms.to(torch.float64).reshape(rows, 1) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    rest = (target - before).clamp_(min=0.0)
    chosen = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, BLOCK)).squeeze(1)
    inner = torch.searchsorted(chosen.to(torch.float64).cumsum(-1), rest, right=True)
    # the block sum and its cumulative sum round apart by an ulp: never past its last
    # entry with mass
    last = BLOCK - 1 - (chosen.flip(-1) > 0).to(torch.uint8).argmax(-1, keepdim=True)
    return (block * BLOCK + torch.minimum(inner, last)).squeeze(-1)
