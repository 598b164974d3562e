import os, sys, time, statistics
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
model = sys.argv[1]
eng = LLMEngine(EngineConfig.from_kwargs(model=model, kv_cache="paged", max_num_seqs=16, max_model_len=2048, num_threads=2, kv_cache_memory="1GiB", max_num_batched_tokens=1024))
P = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
n = [0]
def run(k, L):
    for _ in range(k):
        i = n[0]; n[0] += 1
        eng.add_request(str(i), [4 + (i * 7919 + t * 31) % 30000 for t in range(L)], P)
    t = time.perf_counter()
    while eng.has_unfinished_requests(): eng.step()
    return (time.perf_counter() - t) * 1e3
run(2, 1024)
res = {("old", c): [] for c in ("1x1024", "16x128")} | {("new", c): [] for c in ("1x1024", "16x128")}
for r in range(int(sys.argv[2])):
    for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
        if v == "old": os.environ["TM_OLD_GEMM"] = "1"
        else: os.environ.pop("TM_OLD_GEMM", None)
        res[(v, "1x1024")].append(run(1, 1024))
        res[(v, "16x128")].append(run(16, 128))
wins = {c: sum(n < o for n, o in zip(res[("new", c)], res[("old", c)])) for c in ("1x1024", "16x128")}
for k, v in res.items(): print(k, "median", round(statistics.median(v)), [round(x) for x in v])
print("new faster in", wins, "of", sys.argv[2])
