"""Model-load cost: wall time and peak RSS growth of ``load_model``, in a fresh process.

Peak RSS (``ru_maxrss``) counts mapped checkpoint pages as well as copies, which is what
the loader's direct file reads are for. Each repeat runs in its own process so one load's
peak cannot hide the next.

    .venv/bin/python benchmarks/load_memory.py --model ~/.cache/tokenmill/bench-llama-250m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
import psutil, torch
torch.set_num_threads(2)
from tokenmill.model.loader import load_model
base = psutil.Process().memory_info().rss
start = time.perf_counter()
model = load_model(sys.argv[1], torch.float32, torch.device("cpu"), 512)
seconds = time.perf_counter() - start
from pathlib import Path
weights = sum(f.stat().st_size for f in Path(sys.argv[1]).glob("*.safetensors"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": seconds, "peak_rss_growth_bytes": peak - base, "checkpoint_bytes": weights}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, args.model], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for run in runs:
        print(
            f"load {run['load_s']:.2f} s, peak RSS growth {run['peak_rss_growth_bytes'] / 2**30:.2f} GiB "
            f"(checkpoint {run['checkpoint_bytes'] / 2**30:.2f} GiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
