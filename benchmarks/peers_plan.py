"""What a peers run is made of: its workloads, its steps and the context they share.

Kept apart from ``peers_run.py`` (the servers, the steps and the runner) so that
``peers_report.py`` can read a run without importing the runner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

THREADS = os.cpu_count() or 1


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int

    def describe(self) -> str:
        return (
            f"{self.num_prompts} x ({self.input_len} -> {self.output_len}) "
            f"at {self.concurrency} stream{'s' if self.concurrency > 1 else ''}"
        )


FULL_WORKLOADS = {
    "single": Workload(6, 1, 128, 64),
    "many": Workload(32, 16, 128, 64),
    "long": Workload(16, 8, 1024, 64),
    "moe1": Workload(4, 1, 128, 64),
    "moe16": Workload(32, 16, 128, 64),
}


PRECISIONS = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
}
"""tokenmill's precisions as the compiled steps, a-pairs and v-verify run them: their flags
(the report's verify column matches its rows to these names)."""


TINY_WORKLOADS = {
    "single": Workload(2, 1, 16, 8),
    "many": Workload(4, 4, 16, 8),
    "long": Workload(4, 2, 128, 8),
    "moe1": Workload(2, 1, 16, 8),
    "moe16": Workload(4, 4, 16, 8),
}


@dataclass
class Step:
    name: str
    group: str
    minutes: float
    """Estimated wall time on a quiet 2-core machine, models built and peers installed."""
    run: Callable[[Context], dict[str, Any]]
    describe: str = ""


@dataclass
class Context:
    args: argparse.Namespace
    out: Path
    workloads: dict[str, Workload]
    dense: Path
    moe: Path
    gguf_name: str
    ref_src: Path | None = None
    current: str = ""
    """The step running now (dense_server_step's closures name their files by it)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.args.port}"


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


def load(ctx: Context, name: str) -> dict[str, Any] | None:
    path = ctx.out / f"{name}.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data
