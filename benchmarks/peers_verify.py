"""peers_run.py's v-verify step: ``tokenmill verify`` at the precisions the A steps serve, so
the report puts each tokenmill speed row beside its accuracy (``peers_report.py``'s verify
column). Kept apart from the runner, which holds the servers' steps."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_plan import PRECISIONS, Context


def step_verify(ctx: Context) -> dict[str, Any]:
    """``tokenmill verify`` at each served precision, with the flags it is served at: 8
    prompts x 64 greedy float32 tokens, teacher-forced top-1 agreement and mean KL against
    float32 transformers, so each speed row stands beside its accuracy."""
    results: dict[str, Any] = {}
    for name, flags in PRECISIONS.items():
        saved = ctx.out / "raw" / f"v-verify-{name}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        command = [
            str(Path(sys.executable).with_name("tokenmill")),
            "verify",
            "--model",
            str(ctx.dense),
            "--num-prompts",
            "8",
            "--max-tokens",
            "64",
            *flags,
            "--save-result",
            str(saved),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if not saved.is_file():  # verify's FAIL exits 1 but still saves its figures
            raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr[-2000:]}")
        data = json.loads(saved.read_text())
        results[name] = {
            "command": shlex.join(command),
            "top1_agreement": data["top1_agreement"],
            "mean_kl": data["mean_kl"],
            "num_positions": data["num_positions"],
            "passed": data["passed"],
        }
    return {"precisions": results}
