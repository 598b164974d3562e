"""Every benchmark script loads tokenmill before torch, so it measures at the OpenMP wait policy
``tokenmill serve`` runs at.

Importing ``tokenmill`` sets ``GOMP_SPINCOUNT``/``OMP_WAIT_POLICY`` (``model/thread_policy.py``),
and libgomp reads them once, when torch loads it. A script that imports torch first runs every
parallel region at libgomp's own ~300,000 spins: on the AMX Xeon, SmolLM2's int4 one-stream step
took 3.9 ms in such a script and 7 ms served (``docs/benchmarks.md``), a gap that was the
script's, not the server's. Ruff's import sorting puts ``torch`` (third-party) above
``tokenmill`` (first-party), so the order is checked here rather than left to habit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _imported(node: ast.stmt) -> list[str]:
    """Top-level package names a statement imports (empty for anything else)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def _statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A scope's statements in order, into ``if``/``try``/``with`` blocks but not into
    nested functions or classes (they run later, as their own scopes), nor into
    ``if TYPE_CHECKING:`` (it never runs)."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "handlers", "finalbody"):
                for child in getattr(node, field, []):
                    if isinstance(child, ast.ExceptHandler):
                        yield from _statements(child.body)
                    else:
                        yield from _statements([child])


def _first_torch_before_tokenmill(body: Iterable[ast.stmt], tokenmill_loaded: bool) -> int | None:
    """Line of the first statement in a scope that loads torch before tokenmill is loaded,
    counting a sibling benchmark module that does so at its own import; None if there is none."""
    for node in _statements(body):
        for name in _imported(node):
            if name == "tokenmill":
                tokenmill_loaded = True
            elif not tokenmill_loaded and (name == "torch" or _loads_torch_first(name)):
                return node.lineno
    return None


@cache
def _loads_torch_first(module: str) -> bool:
    """Whether importing the benchmark module ``module`` (a sibling script) loads torch
    before tokenmill."""
    path = BENCHMARKS / f"{module}.py"
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text(), str(path))
    return _first_torch_before_tokenmill(tree.body, False) is not None


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_tokenmill_is_loaded_before_torch(script: Path) -> None:
    tree = ast.parse(script.read_text(), str(script))
    line = _first_torch_before_tokenmill(tree.body, False)
    assert line is None, f"{script.name}:{line} loads torch before tokenmill"
    module_loads_tokenmill = any(
        name == "tokenmill" for node in _statements(tree.body) for name in _imported(node)
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            line = _first_torch_before_tokenmill(node.body, module_loads_tokenmill)
            assert line is None, f"{script.name}:{line} ({node.name}) loads torch before tokenmill"


def test_the_check_finds_torch_first() -> None:
    """The check itself: torch first is found at module level, in a function, and through a
    sibling module; tokenmill first passes."""
    first = ast.parse("import os\nimport torch\nimport tokenmill\n").body
    assert _first_torch_before_tokenmill(first, False) == 2
    assert (
        _first_torch_before_tokenmill(ast.parse("import tokenmill\nimport torch\n").body, False)
        is None
    )
    in_function = ast.parse("def f():\n    if True:\n        from torch import nn\n").body[0]
    assert isinstance(in_function, ast.FunctionDef)
    assert _first_torch_before_tokenmill(in_function.body, False) == 3
    assert _first_torch_before_tokenmill(in_function.body, True) is None
    assert _loads_torch_first("engine_core") is False
    assert _first_torch_before_tokenmill(ast.parse("import os\n").body, False) is None
    type_only = "if TYPE_CHECKING:\n    import tokenmill\nimport torch\n"
    assert _first_torch_before_tokenmill(ast.parse(type_only).body, False) == 3
