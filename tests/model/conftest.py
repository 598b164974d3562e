"""Fixtures the GGUF test modules share (the writer itself is tests/gguf_fixture.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def own_gguf_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted GGUF folders go to a per-session folder, not the repository's cache
    (the GGUF modules use it for every test: ``pytestmark``)."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "tm-cache"))


@pytest.fixture(scope="module")
def gguf_file(make_model, tmp_path_factory):
    """``gguf_file(family, qtype) -> (hf folder, gguf path)``, written once per module."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}
    out = tmp_path_factory.mktemp("gguf")

    def get(family: str, qtype: str) -> tuple[Path, Path]:
        from tests.gguf_fixture import model_overrides, write_gguf  # gguf: only where used

        if (family, qtype) not in cache:
            folder = make_model(family, **model_overrides(family, qtype))
            path = write_gguf(folder, out / f"{family}-{qtype}.gguf", family, qtype)
            cache[family, qtype] = (folder, path)
        return cache[family, qtype]

    return get
