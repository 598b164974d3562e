"""Sampling: user-facing parameters and the batched sampler."""

from tokenmill.sampling.params import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams"]
