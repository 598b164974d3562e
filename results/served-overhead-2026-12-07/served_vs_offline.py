"""Where SmolLM2's served 16-stream TPOT goes: the same 32 x (128 -> 64) workload at 16 streams
served (client clock and server clock) and in process (``bench offline``), alternating.

    PYTHONPATH=src .venv/bin/python results/served-overhead-2026-12-07/served_vs_offline.py MODEL OUT [ROUNDS]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import Server, bench_serve, free_port, tokenmill_command  # noqa: E402
from peers_servers import tokenmill_serve  # noqa: E402

model, out = Path(sys.argv[1]), Path(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
flags = sys.argv[4].split() if len(sys.argv) > 4 else ["--dtype", "bfloat16"]
out.mkdir(parents=True, exist_ok=True)
rows = []


def served(r: int) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with Server(tokenmill_serve(port, model, flags, 2048, 32), base, log=out / f"serve-{r}.log"):
        raw = bench_serve(
            base, out / f"served-{r}.json", num_prompts=32, concurrency=16,
            input_len=128, output_len=64, tokenizer=model, num_warmups=2,
        )
    sm = raw.get("server_metrics") or {}
    rows.append({
        "kind": "served", "round": r, "tok_s": raw["output_throughput"],
        "ttft": raw["mean_ttft_ms"], "tpot": raw["mean_tpot_ms"],
        "server_ttft": sm.get("server_mean_ttft_ms"), "server_tpot": sm.get("server_mean_tpot_ms"),
        "client_cpu_s": raw.get("client_cpu_s"), "duration": raw["duration"],
    })
    print(rows[-1], flush=True)


def offline(r: int) -> None:
    path = out / f"offline-{r}.json"
    cmd = tokenmill_command(
        "bench", "offline", "--model", str(model), "--backends", "tokenmill",
        "--dtype", "bfloat16", "--num-prompts", "32", "--input-len", "128",
        "--output-len", "64", "--engine-arg", "max_num_seqs=16",
        "--engine-arg", "max_model_len=2048", "--save-result", str(path),
    )
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    raw = json.loads(path.read_text())
    rows.append({"kind": "offline", "round": r, "raw": raw})
    print(json.dumps(raw)[:1500], flush=True)


for r in range(rounds):
    served(r)
    offline(r)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
