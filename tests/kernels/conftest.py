"""Fixtures for the kernel tests: each ISA this CPU runs, and 1 or 2 threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenmill import kernels


@pytest.fixture(scope="session", autouse=True)
def _built() -> None:
    if not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")


@pytest.fixture(params=["avx512", "avx2"])  # avx512 without AMX: the VNNI / BF16 paths
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one kernel table; skipped where the CPU lacks it."""
    before = kernels.active_isa()
    try:
        chosen = kernels.set_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    yield chosen
    kernels.set_isa("avx2" if before == "avx2" else "avx512" if before == "avx512_bf16" else "auto")


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
