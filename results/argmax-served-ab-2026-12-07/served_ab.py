"""Served A/B of two trees, alternating: one server per tree per round, the peers' 16-stream
and one-stream workloads on each (32 x (128 -> 64) at 16 streams, 6 x (128 -> 64) at 1).

    .venv/bin/python results/argmax-served-ab-2026-12-07/served_ab.py MODEL OUT ROUNDS SRC_A SRC_B
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import Server, bench_serve, free_port, source_env  # noqa: E402
from peers_servers import tokenmill_serve  # noqa: E402

model, out, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
trees = {"a": Path(sys.argv[4]), "b": Path(sys.argv[5])}
out.mkdir(parents=True, exist_ok=True)
rows = []
for r in range(rounds):
    for name in (("a", "b") if r % 2 == 0 else ("b", "a")):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = source_env(trees[name])
        command = tokenmill_serve(port, model, ["--dtype", "bfloat16"], 2048, 32)
        with Server(command, base, log=out / f"serve-{name}-{r}.log", env=env):
            for wl, n, c in (("many", 32, 16), ("single", 6, 1)):
                raw = bench_serve(
                    base, out / f"{name}-{wl}-{r}.json", num_prompts=n, concurrency=c,
                    input_len=128, output_len=64, tokenizer=model, num_warmups=2, env=env,
                )
                row = {"tree": name, "round": r, "workload": wl,
                       "tok_s": round(raw["output_throughput"], 1),
                       "ttft_ms": round(raw["mean_ttft_ms"], 1), "tpot_ms": round(raw["mean_tpot_ms"], 2)}
                rows.append(row)
                print(row, flush=True)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
