"""Greedy sampling's op (``csrc/ops_sampling.cpp``): the argmax of fp32 logits rows, with
torch's argmax as the fallback for whatever the kernel does not take."""

from __future__ import annotations

import torch

from tokenmill.kernels.ops import supports


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [rows, vocab] logits, the same indices (the first of a
    tie). fp32 CPU rows go to the kernel (SIMD chunk maxima, split across threads from 8 MB
    of logits), where torch's argmax is scalar; anything else, and any batch holding a NaN or
    an infinity, to torch."""
    if (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and supports(logits, float32=True)
    ):
        return torch.ops.tokenmill_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)
