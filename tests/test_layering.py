"""Packages import one way (docs/architecture.md): entrypoints -> engine -> {core, executor,
worker}; executor -> worker -> {core, model}."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenmill"

FORBIDDEN = {
    "core": (
        "tokenmill.engine",
        "tokenmill.worker",
        "tokenmill.executor",
        "tokenmill.entrypoints",
        "tokenmill.model",
        "tokenmill.structured",
        "torch",
        "llguidance",
    ),
    "worker": ("tokenmill.engine", "tokenmill.executor", "tokenmill.entrypoints"),
    "executor": ("tokenmill.engine", "tokenmill.entrypoints"),
    "model": (
        "tokenmill.engine",
        "tokenmill.worker",
        "tokenmill.executor",
        "tokenmill.entrypoints",
    ),
    "engine": ("tokenmill.entrypoints",),
    "kernels": (
        "tokenmill.engine",
        "tokenmill.worker",
        "tokenmill.executor",
        "tokenmill.entrypoints",
        "tokenmill.model",
        "tokenmill.core",
    ),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downstream(package: str) -> None:
    bad = {
        f"{path.relative_to(SRC)}: {name}"
        for path in (SRC / package).rglob("*.py")
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])
    }
    assert not bad, sorted(bad)
