"""Sampling: user-facing parameters and the batched sampler."""

from tokenmill.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
