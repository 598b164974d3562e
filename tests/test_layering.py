"""Packages import one way, in the order docs/architecture.md draws; every package is listed.

Each package (and top-level module) of ``src/tokenmill`` names the tokenmill packages it may
import, lazy imports inside functions included; the leaf modules (errors, outputs, ...) may be
imported by all. Anything else is a layering break, and a package missing from the table fails
too, so a new one has to take its place in the order.
"""

from __future__ import annotations

import ast
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenmill"

LEAVES = frozenset({"errors", "outputs", "pooling_params", "lora_request", "envs", "sizes"})
"""Plain data and error types: import nothing of tokenmill, importable from everywhere."""

ALLOWED: dict[str, frozenset[str]] = {
    name: frozenset(deps)
    for name, deps in {
        "entrypoints": {
            "tune",
            "bench",
            "metrics",
            "engine",
            "resolved_model",
            "config",
            "worker",
            "model",
            "structured",
            "tokenizer",
            "core",
        },
        "tune": {"bench", "core"},
        "bench": {"engine", "resolved_model", "config", "model", "tokenizer", "core"},
        "metrics": {"core"},
        "engine": {  # never "worker": the engine reaches its workers through the executor
            "executor",
            "resolved_model",
            "config",
            "model",
            "sampling",
            "structured",
            "tokenizer",
            "core",
        },
        "executor": {"worker", "resolved_model", "config", "model", "core"},
        "worker": {
            "resolved_model",
            "config",
            "model",
            "sampling",
            "structured",
            "tokenizer",
            "core",
        },
        "resolved_model": {"config", "model", "tokenizer", "core"},
        "sampling": {"structured", "kernels", "core"},
        "structured": {"core"},
        "config": {"core"},
        "model": {"kernels"},
        "kernels": set(),
        "tokenizer": set(),
        "core": set(),
        **{leaf: set() for leaf in LEAVES},
    }.items()
}
"""Package -> the tokenmill packages it may import besides itself and the leaves."""

THIRD_PARTY_FORBIDDEN = {
    "core": ("torch", "llguidance"),
    "tokenizer": ("torch",),
    "tune": ("torch",),
}
"""core/ is torch-free (the scheduler and KV managers run without it); so is the tokenizer."""


def _units() -> dict[str, list[Path]]:
    units: dict[str, list[Path]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if name != "__init__":
            units.setdefault(name, []).append(path)
    return units


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "tokenmill":  # from tokenmill import engine: a package import
                names.update(f"tokenmill.{alias.name}" for alias in node.names)
    return names


def test_every_package_has_a_place_in_the_order() -> None:
    assert sorted(_units()) == sorted(ALLOWED)


def test_the_order_has_no_cycle() -> None:
    order = list(TopologicalSorter(ALLOWED).static_order())  # raises CycleError on a cycle
    assert set(order) == set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downstream(package: str) -> None:
    """Every import counts: lazy ones, ``TYPE_CHECKING`` ones and ``from tokenmill import x``."""
    allowed = ALLOWED[package] | {package} | (set() if package in LEAVES else LEAVES)
    forbidden = THIRD_PARTY_FORBIDDEN.get(package, ())
    bad = set()
    for path in _units()[package]:
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tokenmill" and len(parts) > 1 and parts[1] not in allowed:
                bad.add(f"{path.relative_to(SRC)}: {name}")
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.add(f"{path.relative_to(SRC)}: {name}")
    assert not bad, sorted(bad)


def test_from_tokenmill_import_is_a_package_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from tokenmill import worker, envs\nimport tokenmill.engine\n")
    assert {"tokenmill.worker", "tokenmill.envs", "tokenmill.engine"} <= _imports(module)
