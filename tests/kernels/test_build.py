"""Building, switching and falling back: each case in a fresh interpreter, as a user's
process would meet it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from tokenmill import kernels
from tokenmill.model.layers import RMSNorm
x = torch.randn(3, 64).bfloat16()
out, _ = RMSNorm(64, 1e-6).bfloat16()(x)  # runs on whichever path is there
kernels.available()
print("RESULT", kernels.available(), kernels.active_isa(), kernels.amx_active(), tuple(out.shape))
"""


def _probe(**env: str) -> tuple[str, str]:
    full = {**os.environ, "PYTHONPATH": str(SRC), **env}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    return result, done.stderr


def test_the_switch_turns_the_kernels_off_without_a_warning() -> None:
    result, stderr = _probe(TOKENMILL_CPU_KERNELS="0")
    assert result == "RESULT False none False (3, 64)"
    assert "WARNING" not in stderr


def test_a_failed_build_warns_once_and_torch_kernels_run(tmp_path: Path) -> None:
    """The next process reads the recorded failure instead of building again, until the
    compiler changes; no scratch folder is left behind."""
    missing = str(tmp_path / "no-such-c++")
    result, stderr = _probe(TOKENMILL_CACHE=str(tmp_path), CXX=missing)
    assert result == "RESULT False none False (3, 64)"
    assert stderr.count("tokenmill CPU kernels unavailable") == 1, stderr
    assert "failed before" not in stderr
    kernels = tmp_path / "kernels"
    assert [p.suffix for p in kernels.iterdir()] == [".failed"], list(kernels.iterdir())

    result, stderr = _probe(TOKENMILL_CACHE=str(tmp_path), CXX=missing)
    assert result == "RESULT False none False (3, 64)"
    assert stderr.count("tokenmill CPU kernels unavailable (their build failed before") == 1
    assert "delete" in stderr and ".failed" in stderr, stderr

    result, stderr = _probe(TOKENMILL_CACHE=str(tmp_path), CXX=missing + "-2")  # retried
    assert stderr.count("tokenmill CPU kernels unavailable") == 1
    assert "failed before" not in stderr, stderr
    assert [p.suffix for p in kernels.iterdir()] == [".failed"], list(kernels.iterdir())


def test_the_environment_forces_the_avx2_kernels() -> None:
    from tokenmill import kernels

    if not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")
    result, _ = _probe(TOKENMILL_CPU_ISA="avx2")
    assert result == "RESULT True avx2 False (3, 64)"


def test_the_cache_key_follows_the_sources_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels import build

    key = build.build_key()
    assert key == build.build_key()
    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-DTOKENMILL_TEST"))
    assert build.build_key() != key


def test_every_source_is_compiled_and_every_header_keyed() -> None:
    from tokenmill.kernels import build

    assert sorted(build.SOURCES) == sorted(p.name for p in build.CSRC.glob("*.cpp"))
    assert {"ops.h", "kernels.h", "common.h"} <= set(build.HEADERS)
