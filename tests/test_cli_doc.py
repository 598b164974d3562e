"""docs/cli.md is generated from the real parser: a flag added, renamed or re-documented
without regenerating it fails here, so the reference never drifts from ``--help``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_cli_doc", ROOT / "scripts" / "gen_cli_doc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_doc_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == _generator().render(), (
        "docs/cli.md is stale: run `PYTHONPATH=src python scripts/gen_cli_doc.py`"
    )


def test_cli_doc_lists_every_own_serve_flag() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    for flag in ("--max-num-seqs", "--api-key", "--routes-config", "--data-parallel-size"):
        assert f"`{flag}`" in text
