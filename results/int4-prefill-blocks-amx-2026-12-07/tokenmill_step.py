# LLMEngine prompt steps (paged, 2 threads), STEP = max_num_batched_tokens (default 2048; the CPU default is 1024), as run:
#   STEP=1024 QUANT=int4 PYTHONPATH=src .venv/bin/python results/int4-prefill-blocks-amx-2026-12-07/tokenmill_step.py MODEL_DIR 1024
import os, sys, time, statistics, torch
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
model = sys.argv[1]; L = int(sys.argv[2]) if len(sys.argv) > 2 else 1024; prof = "--prof" in sys.argv
eng = LLMEngine(EngineConfig.from_kwargs(model=model, kv_cache="paged", max_num_seqs=16, max_model_len=2048, num_threads=2, kv_cache_memory="1GiB", max_num_batched_tokens=int(os.environ.get("STEP", "2048")), quantization=os.environ.get("QUANT") or None))
V = 30000
P = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
n = [0]
def add(k, L):
    for _ in range(k):
        i = n[0]; n[0] += 1
        eng.add_request(str(i), [4 + (i * 7919 + t * 31) % V for t in range(L)], P)
def drain():
    while eng.has_unfinished_requests(): eng.step()
add(2, L); drain()
for case, k, LL in (("1x%d" % L, 1, L), ("16x128", 16, 128)):
    ts = []
    for r in range(5):
        add(k, LL); t = time.perf_counter(); drain(); ts.append((time.perf_counter() - t) * 1e3)
    print(f"tm {case} ms:", [round(x) for x in ts], "median", round(statistics.median(ts)))
if prof:
    add(1, L)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        drain()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
