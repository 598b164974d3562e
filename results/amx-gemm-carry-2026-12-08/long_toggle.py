import os, sys, statistics
sys.path.insert(0, "/work/main/benchmarks")
import tokenmill
from pathlib import Path
from long_prompt_steps import run
model = Path(sys.argv[1])
res = {"flush": [], "carry": []}
for rep in range(int(os.environ.get("REPS", "3"))):
    for m in (("flush", "carry") if rep % 2 == 0 else ("carry", "flush")):
        if m == "flush": os.environ["TM_NO_CARRY2"] = "1"
        else: os.environ.pop("TM_NO_CARRY2", None)
        r = run(model)
        res[m].append(r["total_s"])
        print(m, r["total_s"], r["prompt_step_median_ms"], r["decode_step_median_ms"], flush=True)
a, b = statistics.median(res["flush"]), statistics.median(res["carry"])
print(f"{model.name} long workload total: flush {a:.2f} s carry {b:.2f} s ratio {b/a:.3f}")
