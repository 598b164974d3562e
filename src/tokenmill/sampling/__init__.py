"""Sampling: the batched sampler and speculative verification (torch).

The parameter types they read live in ``tokenmill.core`` (``sampling_params``,
``structured_params``, ``beam_search_params``), which is torch-free.
"""
