"""What sampling a token costs: ``Sampler`` on random logits, per step, for the real
checkpoints' vocabularies and 1 or 16 rows, greedy and sampled (temperature 0.8, and with
top-p 0.95). A/B across trees: each tree runs in its own process, alternating.

    .venv/bin/python benchmarks/sampler_cost.py --tree OLD/src --tree src [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VOCABS = {"SmolLM2 (49,152)": 49_152, "Qwen (151,936)": 151_936, "Gemma 3 (262,144)": 262_144}
CASES = {
    "greedy": {"temperature": 0.0},
    "t=0.8": {"temperature": 0.8},
    "t=0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
}


def child(threads: int) -> None:
    """Times every case in this process; prints one JSON object of medians in ms."""
    import tokenmill  # noqa: I001, F401  (before torch: the OpenMP wait policy)
    import torch

    from tokenmill.core.request import Request
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.sampling.sampler import Sampler

    torch.set_num_threads(threads)
    out = {}
    for vname, vocab in VOCABS.items():
        for rows in (1, 16):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
            for cname, kw in CASES.items():
                params = SamplingParams(**kw)
                reqs = [
                    Request(f"r{i}", [1, 2], params, eos_token_ids=frozenset()) for i in range(rows)
                ]
                sampler = Sampler(torch.device("cpu"))
                times = []
                for _ in range(12):
                    start = time.perf_counter()
                    sampler(logits, reqs)
                    times.append((time.perf_counter() - start) * 1e3)
                out[f"{vname} x{rows} {cname}"] = statistics.median(times[2:])
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="a src folder (repeat)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.threads)
        return
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in args.tree}
    for r in range(args.rounds):
        for tree in args.tree if r % 2 == 0 else list(reversed(args.tree)):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    "--tree",
                    tree,
                    "--threads",
                    str(args.threads),
                ],
                env={"PYTHONPATH": tree, "PATH": ""},
                capture_output=True,
                text=True,
                check=True,
            )
            runs[tree].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = args.tree[0]
    print(f"{'case':44}" + "".join(f"{t[-24:]:>26}" for t in args.tree))
    for case in runs[first][0]:
        meds = [statistics.median(run[case] for run in runs[t]) for t in args.tree]
        cells = "".join(f"{m:17.3f} ms x{m / meds[0]:5.3f}" for m in meds)
        print(f"{case:44}{cells}")


if __name__ == "__main__":
    main()
